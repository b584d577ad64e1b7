"""A Hugging Face checkpoint's tensor names as transformers 5 loads them: the model's renamings, and a mixture of
experts' per-expert tensors joined into the stacked parameters the model has (what --init-from reads through
runtime.checkpoint.pretrained).

    sources = loaded_names(model, file_names)          # {name as loaded: the file's tensor name, or a Joined}
    pieces = joined.pieces(shape)                      # [(file tensor name, its shape)] of a joined tensor of `shape`
    piece = read_joined(joined, tensors, indices)      # a rank's slice, read from just those rows of the pieces

transformers 5 builds its MoE families (Mixtral, Qwen2/3-MoE, DeepSeek-V3, OLMoE, ...) with the experts stacked:
gate_up_proj (E, 2F, h), gate rows then up rows, and down_proj (E, h, F); save_pretrained writes, and the Hub's
checkpoints hold, one tensor per expert: Mixtral's model.layers.N.block_sparse_moe.experts.K.w1 (gate), w3 (up) and
w2 (down) .weight, Qwen3-MoE's model.layers.N.mlp.experts.K.gate_proj / up_proj / down_proj.weight, (F, h) or (h, F)
each. from_pretrained renames a file's tensor by the model's conversion mapping
(transformers.conversion_mapping.get_model_conversion_mapping; its legacy renamings are left out here): every
WeightRenaming in turn (Mixtral's block_sparse_moe -> mlp), then at most one WeightConverter
(core_model_loading.rename_source_key). The converters read here are those whose operations are

    MergeModulelist(dim=0)                       the tensors of experts 0..E-1 (the number at the pattern's `*`)
                                                 stacked on dim 0
    MergeModulelist(dim=0), Concatenate(dim=d)   then the patterns' stacks (gate, up) concatenated on dim d in the
                                                 patterns' order, equal parts (save_pretrained splits them back so,
                                                 Concatenate's reverse being Chunk)

as every MoE family of transformers 5 joins its experts. A tensor another converter matches keeps its renamed name,
which the model lacks: pretrained.py refuses it as unexpected. Without transformers 5, or for a model it did not
build, the names are the file's.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from zplan.runtime.checkpoint.safetensors_read import TensorEntry, read_slice


@dataclass(frozen=True)
class Joined:
    """A tensor the file holds in pieces: expert e's part p is the file's tensor parts[p][0] + str(e) + parts[p][1];
    the experts are stacked on dim 0 and the parts (one, or gate and up) concatenated on `dim`, in equal parts."""

    name: str  # the tensor as transformers names it, e.g. model.layers.0.mlp.experts.gate_up_proj
    parts: tuple[tuple[str, str], ...]  # per part: the file's name before and after the expert number
    dim: int | None  # Concatenate's dim; None: one part

    def piece(self, expert: int, part: int) -> str:
        before, after = self.parts[part]
        return f"{before}{expert}{after}"

    def pieces(self, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """(file tensor name, its shape) of every piece of a joined tensor of `shape` (E, ...): E experts' parts,
        each the shape without dim 0, `dim` divided by the parts."""
        piece = list(shape[1:])
        if self.dim is not None:
            piece[self.dim - 1] //= len(self.parts)
        return [(self.piece(e, p), tuple(piece)) for e in range(shape[0]) for p in range(len(self.parts))]


def _mapping(model: nn.Module):
    """(transformers' rename_source_key, the WeightRenamings, the WeightConverters) from_pretrained applies to
    `model`'s checkpoint names (module docstring), or None where transformers 5 did not build it."""
    if "transformers" not in sys.modules:  # a model transformers built has imported it
        return None
    try:  # optional dependency: transformers (zplan[hf]); 4.x has no conversion mapping
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    transforms = get_model_conversion_mapping(model, add_legacy=False)
    return (rename_source_key, [t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def _literal(pattern: str) -> str:
    """A conversion pattern's text, its regex escapes undone: r'\\.experts.*.w2.weight' -> '.experts.*.w2.weight'."""
    return re.sub(r"\\(.)", r"\1", pattern.removeprefix("^"))


def _joined(converter, target: str, pattern: str, name: str) -> Joined | None:
    """The Joined that file tensor `name`, matched by `converter`'s source `pattern` and renamed to `target`, is a
    piece of; None when the converter is not one of the module docstring's."""
    steps = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    patterns = converter.source_patterns
    stacked = steps == [("MergeModulelist", 0)] and len(patterns) == 1
    concatenated = (len(steps) == 2 and steps[0] == ("MergeModulelist", 0) and steps[1][0] == "Concatenate"
                    and isinstance(steps[1][1], int) and steps[1][1] >= 1)
    if not (stacked or concatenated) or any(_literal(p).count("*") != 1 for p in patterns):
        return None
    match = re.search(pattern.replace("*", r"\d+"), name)
    if match is None:
        return None
    before = name[:match.start()]  # the module path the pattern follows
    parts = []
    for source in patterns:
        head, tail = _literal(source).split("*")
        parts.append((before + head, tail))
    joined = Joined(target, tuple(parts), steps[1][1] if concatenated else None)
    head, tail = parts[patterns.index(pattern)]
    return joined if re.fullmatch(re.escape(head) + r"\d+" + re.escape(tail), name) else None


def loaded_names(model: nn.Module, names: Iterable[str]) -> dict[str, str | Joined]:
    """{name as from_pretrained loads it: the file's tensor of that name, or the Joined of per-expert tensors} for
    the file's tensor `names` (module docstring); of two names loaded as one, the first (sorted) is taken."""
    mapping = _mapping(model)
    if mapping is None:
        return {name: name for name in names}
    rename, renamings, converters = mapping
    by_pattern = {p: converter for converter in converters for p in converter.source_patterns}
    loaded: dict[str, str | Joined] = {}
    for name in sorted(names):
        target, pattern = rename(name, renamings, converters)
        joined = None if pattern is None else _joined(by_pattern[pattern], target, pattern, name)
        if joined is None:
            loaded.setdefault(rename(name, renamings, [])[0], name)
        else:
            loaded.setdefault(target, joined)
    return loaded


def read_joined(joined: Joined, tensors: dict[str, TensorEntry], indices: list[torch.Tensor]) -> torch.Tensor:
    """`joined` at the global indices `indices` (one int64 vector per dimension), in the file's dtype, read from
    just those rows and columns of its pieces: dim 0's indices are experts, those of `dim` (part, row within it)."""
    rest = list(indices[1:])  # the pieces' dimensions
    if len(indices[0]) == 0:
        return torch.empty((0, *map(len, rest)), dtype=tensors[joined.piece(0, 0)].dtype)

    def piece(expert: int, part: int, at: list[torch.Tensor]) -> torch.Tensor:
        name = joined.piece(expert, part)
        return read_slice(tensors[name], name, at)

    if joined.dim is None:
        return torch.stack([piece(e, 0, rest) for e in indices[0].tolist()])
    d = joined.dim - 1  # the parts' dimension in a piece
    size = tensors[joined.piece(0, 0)].shape[d]
    part, row = indices[joined.dim] // size, indices[joined.dim] % size
    by_part = torch.argsort(part, stable=True)  # the rows as the parts' blocks give them
    back = None if torch.equal(by_part, torch.arange(len(part))) else torch.argsort(by_part)

    def expert(e: int) -> torch.Tensor:
        blocks = [piece(e, p, rest[:d] + [row[part == p]] + rest[d + 1:]) for p in part.unique().tolist() or [0]]
        block = torch.cat(blocks, dim=d)
        return block if back is None else block.index_select(d, back)

    return torch.stack([expert(e) for e in indices[0].tolist()])
