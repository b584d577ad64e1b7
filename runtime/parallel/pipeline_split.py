"""The stage split of pipeline parallelism: each stage a module (PipelineChunk) that runs the model's own forward,
the stages built and run in one process (split_model, run_stages) and checked against the model (check_split).

What a stage computes. stage_modules[s] lists the module paths stage s runs (the plan's units, e.g.
['model.embed_tokens', 'model.layers.0'], ['model.layers.1', 'model.norm', 'lm_head']). A path whose parent
is a ModuleList, ModuleDict or Sequential is a block; the paths before the first block are the embedding,
the paths after the last block the head. Every stage runs the model's own forward (its class's `forward`)
on the micro-batch, on a shallow copy of the model in which the units of the other stages are stood in for:
  - a unit before the stage's first unit: an embedding module gives zeros shaped like the hidden state the
    stage received, a block gives that hidden state itself (so the first block of this stage receives it);
  - a unit after the stage's last unit ends the stage's forward: what it was called with (the hidden state
    leaving this stage's last block) is the stage's output, sent to the next stage.
So what the forward computes outside the units runs on every stage as in one process: positions, rotary
tables and attention masks built from the batch and the hidden state's shape, blocks nested in a submodule
(Hugging Face's `model.layers`) and called with extra arguments, work after the head (a logit soft-cap).
Stage 0 gets the micro-batch from the schedule; the others get it by its index (a keyword the schedule
hands every stage) from the micro-batches step() was given, which every pipeline rank holds. The last
stage sends on the model's output: a tensor, or the logits of an output object (`.logits`, as Hugging
Face models return); the loss receives that output object itself (with a loss the forward computed from
the batch's labels). Logits split over the vocabulary (runtime/parallel/vocab_parallel.py) cross the schedule
as this rank's part, a plain tensor, and reach the loss as their DTensor again.

A model satisfies this contract when:
  1. its forward runs the embedding, then the blocks in order, each called with the hidden state as its
     first argument (or `hidden_states=`) and returning the next hidden state (one tensor), then the head;
     between the embedding and the first block it computes only from the batch and from the embedding's
     output's shape, dtype and device (later stages see zeros in its place);
  2. its output is a tensor, or an object holding the logits (`.logits`) that the loss reads;
  3. the root module holds no parameters of its own (put them in a submodule inside a unit);
  4. batches are tensors, or tuples, lists or dicts of tensors, with the batch in dim 0.
build_pipeline checks the split: the stages composed in one process must reproduce model(example)
(eval mode, within 1e-5), else PipelineSplitError says which of the above to fix.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from zplan.model.meta_ops import CachedMetaOps, MetaOpCache
from zplan.model.model_file import logits_of
from zplan.runtime.compression.activations import receive_int8, send_int8
from zplan.runtime.parallel.pipeline_units import (
    EndOfStage,
    PipelineSplitError,
    ReceivedForBlock,
    ReceivedIntoBlock,
    UnitRoles,
    ZerosForEmbedding,
    _local,
    _Received,
    _StageOutput,
    unit_roles,
)
from zplan.runtime.parallel.vocab_parallel import loss_parallel_scope
from zplan.schemas.spec import ActivationCompression

SPLIT_TOLERANCE = 1e-5  # max |stages composed - model(example)|, eval mode, fp32
MICRO_BATCH_INDEX = "micro_batch_index"  # the keyword by which a stage learns which micro-batch it runs


# ---- stage modules -------------------------------------------------------------------------------


def _attach(root: nn.Module, model: nn.Module, paths: Sequence[str], containers: Sequence[str]) -> None:
    """Register model's modules at `paths` under `root` with the same names (parents as ModuleDicts), so
    parameter names and state-dict keys stay the model file's ('blocks.3.attn.q.weight'). Every block
    container is created, empty if the stage has none of its blocks (so root.get_submodule('blocks') works)."""
    for path in [*containers, *paths]:
        node = root
        *parents, leaf = path.split(".")
        for name in parents:
            if name not in node._modules:
                node.add_module(name, nn.ModuleDict())
            node = node._modules[name]
        if leaf not in node._modules:
            node.add_module(leaf, model.get_submodule(path) if path in paths else nn.ModuleDict())


def _skeleton(model: nn.Module, stand_ins: dict[str, nn.Module], unit_paths: Sequence[str]) -> nn.Module:
    """A shallow copy of `model` in which the unit modules in `stand_ins` are replaced. Only the modules on the
    way to a unit are copied; every other module, and every unit not replaced, is the model's own object."""

    def copy_along(module: nn.Module, prefix: str) -> nn.Module:
        clone = copy.copy(module)
        clone._modules = dict(module._modules)  # the copy shares the dict otherwise
        for name, child in module._modules.items():
            path = prefix + name
            if path in stand_ins:
                clone._modules[name] = stand_ins[path]
            elif child is not None and path not in unit_paths and any(u.startswith(path + ".") for u in unit_paths):
                clone._modules[name] = copy_along(child, path + ".")
        return clone

    return copy_along(model, "")


def _call_with_batch(fn: Callable, module: nn.Module, batch: Any) -> Any:
    """fn(module, batch) for a tensor, fn(module, *batch) for a tuple/list, fn(module, **batch) for a dict
    (the convention of runtime.training.step.forward_batch)."""
    if isinstance(batch, dict):
        return fn(module, **batch)
    if isinstance(batch, (tuple, list)):
        return fn(module, *batch)
    return fn(module, batch)


class MicroBatches:
    """The micro-batches of the step in progress, which stages after the first read by index (shared)."""

    def __init__(self):
        self.batches: list[Any] = []

    def get(self, index: torch.Tensor | int | None) -> Any:
        if index is None:
            raise PipelineSplitError(f"a pipeline stage after the first needs the {MICRO_BATCH_INDEX} keyword")
        if isinstance(index, FakeTensor):  # the dry run (runtime.dryrun.fake_world): no value, and every
            return self.batches[0]  # micro-batch of a step has the same shapes, so the first stands in
        return self.batches[int(index.reshape(-1)[0]) if isinstance(index, torch.Tensor) else index]


class PipelineChunk(nn.Module):
    """One pipeline stage (a model chunk): its modules under their original names, and the forward that
    runs them (module docstring). Stage 0 takes the leaves of a batch (tensors) and rebuilds the batch; the
    others take the hidden state of the stage before, and the micro-batch's index."""

    def __init__(self, model: nn.Module, paths: Sequence[str], stage_index: int, num_stages: int,
                 roles: UnitRoles, micro_batches: MicroBatches, activation_compression: ActivationCompression = "none"):
        super().__init__()
        if activation_compression not in ("none", "int8"):
            raise PipelineSplitError(f"activation compression between stages is none or int8, got "
                                     f"{activation_compression!r}")
        # int8: the hidden state leaves this stage, and its gradient comes back, as int8 (compression.activations)
        self._int8_out = activation_compression == "int8" and stage_index < num_stages - 1
        self._int8_in = activation_compression == "int8" and stage_index > 0
        _attach(self, model, list(paths), roles.block_containers)
        self._stage_index, self._num_stages = stage_index, num_stages
        self._paths = tuple(paths)
        self._micro_batches = micro_batches
        self._received = _Received()
        first, last = roles.all_paths.index(paths[0]), roles.all_paths.index(paths[-1])
        stand_ins: dict[str, nn.Module] = {}
        for position, path in enumerate(roles.all_paths):
            if position < first:
                stand_ins[path] = (ZerosForEmbedding(model.get_submodule(path), self._received)
                                   if path in roles.embedding else ReceivedForBlock(self._received))
            elif position > last:
                stand_ins[path] = EndOfStage()
        if stage_index > 0 and paths[0] not in roles.head:  # the stage starts with a block: it takes the hidden state
            stand_ins[paths[0]] = ReceivedIntoBlock(model.get_submodule(paths[0]), self._received)
        self._skeleton_of = (_skeleton(model, stand_ins, roles.all_paths), type(model).forward)  # not registered
        # the modules the skeleton runs outside the units (copies and the model's own): they follow train/eval
        self._outside_units = tuple(
            module for name, module in self._skeleton_of[0].named_modules()
            if not any(name == p or name.startswith(p + ".") for p in roles.all_paths))
        self._output: Any = None  # the last stage: the model's output object of the micro-batch just run
        self._split_logits: DTensor | None = None  # the last stage: its logits split over the vocabulary, as made
        self._batch_spec: pytree.TreeSpec | None = None  # stage 0: the structure of a batch

    @property
    def stage_index(self) -> int:
        return self._stage_index

    @property
    def skeleton(self) -> nn.Module:
        """The shallow copy of the model this stage runs the forward on: tensors held outside the units (e.g.
        a rotary table's inv_freq) are reached through it."""
        return self._skeleton_of[0]

    def forward(self, *args: torch.Tensor, micro_batch_index: torch.Tensor | None = None) -> torch.Tensor:
        skeleton, model_forward = self._skeleton_of
        for module in self._outside_units:
            module.training = self.training
        if self._stage_index == 0:
            batch = pytree.tree_unflatten(list(args), self._batch_spec) if self._batch_spec else args[0]
        elif len(args) == 1:
            (hidden,) = args
            if self._int8_in:
                hidden = receive_int8(hidden)
            self._received.tensor = hidden
            batch = self._micro_batches.get(micro_batch_index)
        else:
            raise PipelineSplitError(f"pipeline stage {self._stage_index} received {len(args)} tensors: the "
                                     "stages must pass one hidden-state tensor (a block returns one tensor)")
        self._output = self._split_logits = None  # what a forward whose loss was never taken left (the shapes' one)
        try:
            output = _call_with_batch(model_forward, skeleton, batch)
        except _StageOutput as end:
            x = end.hidden
        else:
            if self._stage_index < self._num_stages - 1:
                raise PipelineSplitError(f"the forward of {type(skeleton).__name__} returned before reaching the "
                                         f"units of pipeline stage {self._stage_index + 1}")
            x = output if isinstance(output, torch.Tensor) else logits_of(output)
            self._output = None if isinstance(output, torch.Tensor) else output
            if isinstance(x, DTensor):  # split over the vocabulary (runtime/parallel/vocab_parallel.py): the schedule
                self._split_logits, x = x, x.to_local()  # gets this rank's, the loss the DTensor (outputs_for_loss)
        finally:
            self._received.tensor = None
        if self._int8_out:
            x = send_int8(x)
        return x

    def outputs_for_loss(self, logits: torch.Tensor) -> Any:
        """What the loss receives from the last stage: its tensor, or the model's own output object of the
        micro-batch just run (the schedule computes each micro-batch's loss right after its forward) holding
        `logits`, with what else the forward computed from the batch (a Hugging Face model's .loss from the
        batch's labels). Logits split over the vocabulary come back as their DTensor, made from `logits` (this rank's
        part, which the schedule handled), so that the loss's backward runs through them."""
        output, self._output = self._output, None
        split, self._split_logits = self._split_logits, None
        if split is not None:
            logits = DTensor.from_local(logits, split.device_mesh, split.placements, run_check=False,
                                        shape=split.shape, stride=split.stride())
        if output is None:
            return logits
        if isinstance(output, tuple):
            return (logits, *output[1:])
        if isinstance(output, dict):  # Hugging Face's ModelOutput is a dict whose items are its attributes
            output["logits"] = logits
        else:
            output.logits = logits
        return output


def batch_leaves(batch: Any) -> tuple[list[torch.Tensor], pytree.TreeSpec]:
    """The tensors of a batch (a tensor, or a tuple/list/dict of tensors) and its structure."""
    leaves, spec = pytree.tree_flatten(batch)
    if not leaves or not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        kinds = sorted({type(leaf).__name__ for leaf in leaves})
        raise PipelineSplitError(f"a batch under pipeline parallelism must be a tensor or a tuple, list or dict "
                                 f"of tensors (split along dim 0); this one holds {kinds or 'nothing'}")
    return leaves, spec


def split_model(model: nn.Module, stage_modules: Sequence[Sequence[str]],
                roles: UnitRoles | None = None, activation_compression: ActivationCompression = "none"
                ) -> list[PipelineChunk]:
    """Every stage of the pipeline, in one process (they share the model's modules and one MicroBatches)."""
    roles = roles or unit_roles(model, stage_modules)
    micro_batches = MicroBatches()
    return [PipelineChunk(model, paths, index, len(stage_modules), roles, micro_batches, activation_compression)
            for index, paths in enumerate(stage_modules)]


def run_stages(chunks: Sequence[PipelineChunk], batch: Any) -> list[torch.Tensor]:
    """The output of each stage for `batch`, the stages run one after the other in this process."""
    leaves, spec = batch_leaves(batch)
    outputs: list[torch.Tensor] = []
    for chunk in chunks:
        chunk._micro_batches.batches = [batch]
        if chunk.stage_index == 0:
            chunk._batch_spec = spec
            outputs.append(chunk(*leaves))
        else:
            outputs.append(chunk(outputs[-1], micro_batch_index=0))
    return outputs


def check_split(model: nn.Module, chunks: Sequence[PipelineChunk], example_batch: Any) -> list[torch.Tensor]:
    """Run the stages one after the other on `example_batch` (eval mode, no grad) and compare with the
    model's own forward; return each stage's output. Raises PipelineSplitError on a mismatch.

    A model on the meta device (built by runtime.training.materialize before its weights exist) has no values to
    compare: there the check is of the output's shape only, the forward still run through every stage, each
    distinct operation once (model.meta_ops.CachedMetaOps: the blocks repeat)."""
    on_meta = any(_local(p).is_meta for p in model.parameters())
    was_training = model.training
    model.eval()
    for chunk in chunks:  # the modules outside the units follow the chunk's mode (PipelineChunk.forward)
        chunk.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), loss_parallel_scope(model), \
                CachedMetaOps(MetaOpCache()) if on_meta else contextlib.nullcontext():  # a forward's split-vocab loss
            expected = _call_with_batch(lambda module, *a, **k: module(*a, **k), model, example_batch)
            outputs = run_stages(chunks, example_batch)
    except PipelineSplitError:
        raise
    except Exception as error:
        raise PipelineSplitError(
            f"the pipeline stages of {type(model).__name__} cannot run its forward ({type(error).__name__}: "
            f"{error}): every stage runs the forward with the other stages' units stood in for "
            "(runtime/parallel/pipeline.py says what the forward may do)") from error
    finally:
        for chunk in chunks:
            chunk.train(was_training)
        model.train(was_training)
    got = logits_of(chunks[-1].outputs_for_loss(outputs[-1]))  # the logits the loss gets
    if not isinstance(expected, torch.Tensor):
        try:
            expected = logits_of(expected)
        except TypeError:
            pass
    if isinstance(expected, DTensor) and not on_meta:
        expected = expected.full_tensor()
    if isinstance(got, DTensor) and not on_meta:
        got = got.full_tensor()
    if not isinstance(expected, torch.Tensor) or not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        raise PipelineSplitError(
            f"the pipeline stages of {type(model).__name__} return {_describe(got)} where the model returns "
            f"{_describe(expected)}: the forward must return a tensor or an object with .logits")
    if on_meta:
        return outputs
    error = (got.float() - expected.float()).abs().max().item()
    if not error <= SPLIT_TOLERANCE * max(1.0, expected.float().abs().max().item()):
        raise PipelineSplitError(
            f"the pipeline stages of {type(model).__name__} do not reproduce its forward (max difference "
            f"{error:.3g}): every stage runs the forward with the other stages' units stood in for, so between the "
            "embedding and the first block the forward may compute only from the batch and the embedding "
            "output's shape, and each block must return the next hidden state (runtime/parallel/pipeline.py says more)")
    return outputs


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
