"""Smaller models from a teacher, and a model file for the result: layer reduction (zplan.layer_reduction) and
attention-head pruning (zplan.head_pruning) applied by a written model file.

Model file (write_reduced_model_file). Writes a Python model file whose build_model() imports the teacher file
(by its path relative to the new file), builds it, loads teacher weights if given (not on the meta device,
where there are no values), keeps the chosen layers and prunes the chosen heads; the choices are written in
the file as literals, so the file is deterministic and the planner (`zplan compile`) takes it like any other.
The runtime records and replays the file's initialisation shard by shard (runtime.training.materialize) when there are
no weights; loaded weights cannot be replayed, so with weights each rank builds the whole model (with a warning).
The teacher's build_model() must build the same structure for the recorded choices to fit (BUILD_KWARGS fixes
its arguments); moving the written file away from the teacher breaks its relative import.
"""

from __future__ import annotations

import ast
import itertools
import os
import pprint
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zplan.head_pruning import (
    HEAD_COUNT_ATTRS,
    Attention,
    attention_modules,
    default_block_prefix,
    find_attention,
    head_importance,
    least_important_heads,
    mask_heads,
    prune_heads,
)
from zplan.layer_reduction import LAYER_COUNT_ATTRS, ReductionError, _is_int, block_container, keep_layers
from zplan.model.model_file import default_example_inputs, load_model_file

__all__ = ["HEAD_COUNT_ATTRS", "LAYER_COUNT_ATTRS", "Attention", "ReducedModelFile", "ReductionError",
           "attention_modules", "block_container", "default_block_prefix", "find_attention", "head_importance",
           "import_model_file", "keep_layers", "least_important_heads", "load_state_dict_file", "mask_heads",
           "prune_heads", "reduce_model", "write_reduced_model_file"]


# ---- the reduced model and its file ----------------------------------------------------------------------


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from a .safetensors file or a torch.save'd dict of tensors (loaded with weights_only)."""
    path = Path(path)
    if not path.is_file():
        raise ReductionError(f"teacher weights {path} do not exist: pass a state-dict file (.pt or .safetensors).")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ReductionError(f"{path} is not a state dict (a dict of tensors, as model.state_dict() gives).")
    return state


def reduce_model(model: nn.Module, block_prefix: str, keep: Sequence[int] | None = None,
                 prune: Mapping[int, Sequence[int]] | None = None, weights: str | Path | None = None) -> nn.Module:
    """Load the teacher `weights` (skipped on the meta device, where there are no values), then keep_layers,
    then prune_heads (`prune` indexes the layers left by `keep`); in place, returns `model`."""
    if weights is not None and not any(p.is_meta for p in model.parameters()):
        try:
            model.load_state_dict(load_state_dict_file(weights))
        except RuntimeError as exc:
            raise ReductionError(f"teacher weights {weights} do not fit the teacher: {str(exc).strip()}") from exc
    if keep is not None:
        keep_layers(model, block_prefix, keep)
    if prune:
        prune_heads(model, prune, block_prefix)
    return model


def import_model_file(path: str | Path) -> Any:
    """The module of a model file, imported fresh as zplan's loader does (model.model_file.load_model_file)."""
    return load_model_file(path).module


@dataclass
class ReducedModelFile:
    """What write_reduced_model_file wrote."""

    path: Path
    block_prefix: str
    teacher_layers: int
    keep: list[int] | None  # teacher layer indices kept; None: all
    prune: dict[int, list[int]]  # {student layer: [heads]}
    params_before: int  # teacher parameters (tied ones once)
    params_after: int


FORWARDED = ("SEQ_LEN", "VOCAB_SIZE", "example_inputs", "loss_fn", "train_data")

FILE_DOC = ("Written by zplan.model_reduction.write_reduced_model_file: write it again rather "
            "than editing it. Heads pruned: {source}. build_model() imports the teacher file at TEACHER (relative "
            "to this file), builds it with BUILD_KWARGS, loads the teacher state dict WEIGHTS if set (not on the "
            "meta device), keeps the teacher blocks KEEP_LAYERS of BLOCK_PREFIX (None: all) and prunes the "
            "attention heads PRUNE_HEADS ({{student layer: [heads]}}).")

FILE_TEMPLATE = '''"""A reduced {teacher_name}: {keep_text}, {prune_count} attention heads pruned.

{doc}
"""

from pathlib import Path

from zplan.model_reduction import import_model_file, reduce_model

HERE = Path(__file__).resolve().parent
TEACHER = {teacher_rel!r}
WEIGHTS = {weights_rel!r}
BUILD_KWARGS = {build_kwargs}
BLOCK_PREFIX = {block_prefix!r}
KEEP_LAYERS = {keep}
PRUNE_HEADS = {prune}

teacher = import_model_file(HERE / TEACHER)
{forwards}

def build_model():
    model = teacher.build_model(**BUILD_KWARGS)
    return reduce_model(model, BLOCK_PREFIX, KEEP_LAYERS, PRUNE_HEADS, WEIGHTS and HERE / WEIGHTS)
'''


def write_reduced_model_file(teacher_path: str | Path, out_path: str | Path, keep_layers: Sequence[int] | None = None,
                             prune: Mapping | None = None, weights: str | Path | None = None,
                             calibration_batches: int | Iterable[Any] = 8, *, block_prefix: str | None = None,
                             build_kwargs: Mapping[str, Any] | None = None, batch_size: int = 4,
                             seq_len: int | None = None, seed: int = 0) -> ReducedModelFile:
    """Write a model file for the teacher model file `teacher_path` reduced (module docstring, "Model file").

    keep_layers: teacher block indices to keep (None: all). prune: None, {"heads_per_layer": n} (the n heads of
    lowest head_importance in each layer of the layer-reduced model, computed once here, on the CPU, from the
    teacher weights if given, else from its initialisation under torch.manual_seed(seed)) or an explicit
    {student layer: [heads]}. weights: a teacher state-dict file (.pt or .safetensors). calibration_batches:
    a count of batches of (batch_size, seq_len) from the teacher's train_data, else its example_inputs, else
    synthetic tokens (seq_len default: the teacher's SEQ_LEN, at most 128), or the batches themselves.
    block_prefix: the block container (default: the planner's). build_kwargs: passed to the teacher's
    build_model, written in the file (literals only). The file forwards the teacher's FORWARDED names.
    Raises ZplanError subclasses (ReductionError, ModelLoadError) with nothing written.
    """
    teacher = load_model_file(teacher_path)
    build_kwargs = dict(build_kwargs or {})
    _check_literal(build_kwargs, "build_kwargs")
    out_path = Path(out_path)
    if out_path.resolve() == teacher.path.resolve():
        raise ReductionError(f"{out_path} is the teacher file itself: write the reduced model to another file.")
    if weights is not None and not Path(weights).is_file():
        raise ReductionError(f"teacher weights {weights} do not exist: pass a state-dict file (.pt or .safetensors).")
    # Choices are checked on the meta device (no memory); the head scores need values (CPU).
    student = teacher.build("meta", **build_kwargs)
    params_before = sum(p.numel() for p in student.parameters())
    block_prefix = block_prefix or default_block_prefix(student)
    layers = len(block_container(student, block_prefix))
    keep = None if keep_layers is None else list(keep_layers)
    reduce_model(student, block_prefix, keep)

    source = "none" if prune is None else "chosen by the caller"
    if prune is None:
        heads: dict[int, list[int]] = {}
    elif set(prune) == {"heads_per_layer"}:
        heads_per_layer = prune["heads_per_layer"]
        fewest = min(a.heads for a in attention_modules(student, block_prefix))  # the layout, checked on meta
        if not _is_int(heads_per_layer) or not 0 < heads_per_layer < fewest:
            raise ReductionError(f"heads_per_layer must be an int between 1 and {fewest - 1} (a layer has {fewest} "
                                 f"heads), got {heads_per_layer!r}.")
        with torch.random.fork_rng():  # the caller's RNG state is left as it was
            torch.manual_seed(seed)
            model = reduce_model(teacher.build(**build_kwargs), block_prefix, keep, None, weights)
            if isinstance(calibration_batches, int):
                seq = seq_len or min(teacher.seq_len or 128, 128)
                if teacher.user_train_data is None and teacher.example_inputs is not default_example_inputs:
                    batches = [teacher.example_inputs(batch_size, seq)]  # a fixed sample: one batch
                else:
                    batches = list(itertools.islice(teacher.train_data(batch_size, seq, seed=seed),
                                                    calibration_batches))
            else:
                batches = list(calibration_batches)
            scores = head_importance(model, batches, teacher.loss_fn, block_prefix)
        heads = least_important_heads(scores, heads_per_layer)
        source = (f"the {heads_per_layer} least important heads per layer by Michel et al. 2019's score on "
                  f"{len(batches)} calibration batches, {'teacher weights' if weights else 'initial weights'}")
    elif all(_is_int(layer) for layer in prune):
        heads = {layer: list(prune[layer]) for layer in prune if list(prune[layer])}
    else:
        raise ReductionError(f"prune must be None, {{'heads_per_layer': n}} or {{layer: [heads]}}, got {prune!r}.")
    prune_heads(student, heads, block_prefix)  # checks the choice
    heads = {layer: sorted(heads[layer]) for layer in sorted(heads)}

    teacher_rel = Path(os.path.relpath(Path(teacher_path).resolve(), out_path.resolve().parent)).as_posix()
    weights_rel = None if weights is None else \
        Path(os.path.relpath(Path(weights).resolve(), out_path.resolve().parent)).as_posix()
    forwards = "".join(f"{name} = teacher.{name}\n" for name in FORWARDED if hasattr(teacher.module, name))
    keep_text = f"{len(keep)} of {layers} teacher layers kept" if keep is not None else f"all {layers} layers kept"
    text = FILE_TEMPLATE.format(
        teacher_name=teacher.path.name, keep_text=keep_text, prune_count=sum(map(len, heads.values())),
        doc=textwrap.fill(FILE_DOC.format(source=source), width=110), teacher_rel=teacher_rel,
        weights_rel=weights_rel, block_prefix=block_prefix,
        build_kwargs=_literal(build_kwargs), keep=_literal(keep), prune=_literal(heads), forwards=forwards)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(text)
    return ReducedModelFile(out_path, block_prefix, layers, keep, heads, params_before,
                            sum(p.numel() for p in student.parameters()))


def _literal(value: Any) -> str:
    """Python source for a literal, sorted and wrapped at 100 characters (deterministic)."""
    return pprint.pformat(value, width=100, compact=True, sort_dicts=True)


def _check_literal(value: Any, name: str) -> None:
    try:
        same = ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError):
        same = False
    if not same:
        raise ReductionError(f"{name} must hold Python literals only (numbers, strings, lists, dicts), got {value!r}.")
