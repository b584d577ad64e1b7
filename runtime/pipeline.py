"""Pipeline parallelism: the model cut into stages at the plan's boundaries, run by a
torch.distributed.pipelining schedule (GPipe, 1F1B or interleaved 1F1B; DESIGN.md decision 4).

    run = build_pipeline(model, mesh["pp"], stage_modules, "1f1b", num_micro_batches, loss_fn, example)
    loss = run.step(micro_batches)          # forward + backward of one optimizer step, on every pp rank
    grad_norm = run.clip_grad_norm_(1.0)    # the norm over all stages, as one process would compute it
    optimizer.step()                        # over run.parameters(): this rank's stages only

Layout (Megatron's, Narayanan et al. 2021, section 2.2): with pp pipeline ranks and v model chunks per
rank, stage s = c * pp + r is chunk c of pipeline rank r (torch's PipelineStage maps stage s to group
rank s % pp). GPipe and 1F1B run one stage per rank (v = 1); interleaved 1F1B runs v >= 2.

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
the batch's labels).

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

Parameters registered under several names (a tied output head: lm_head.weight is wte.weight) that end
up on several pipeline ranks have their gradients summed over those ranks after each step (Megatron's
embedding all-reduce); the norm for clipping counts them once. The losses of the micro-batches (the
model file's loss_fn(outputs, batch), a mean per micro-batch) are averaged, and so are the gradients
(each scaled by 1 / num_micro_batches), as one process accumulating the same micro-batches would.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from zplan.errors import ZplanError
from zplan.planner.model_file import logits_of
from zplan.runtime.context_parallel import ContextParallelBatch
from zplan.runtime.grad_norm import total_norm_fp32
from zplan.runtime.grad_reduce import gradient_reducer

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}  # in
# torch.distributed.pipelining, imported when a schedule is built: it pulls in torch._dynamo (~1 s per process)
BLOCK_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
SPLIT_TOLERANCE = 1e-5  # max |stages composed - model(example)|, eval mode, fp32
MICRO_BATCH_INDEX = "micro_batch_index"  # the keyword by which a stage learns which micro-batch it runs


class PipelineSplitError(ZplanError):
    """The plan's stages do not fit the model, or the model's forward cannot be cut at them."""


# ---- stand-ins for the units of other stages -----------------------------------------------------


class _Received:
    """The hidden state this stage received for the forward in progress (shared by its stand-ins)."""

    tensor: torch.Tensor | None = None


def _meta_replica(module: nn.Module) -> nn.Module:
    """A copy of `module` whose parameters and buffers are meta tensors of the same shapes and dtypes (no memory)."""
    def meta(t: torch.Tensor) -> torch.Tensor:  # the global shape of a DTensor too
        return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")

    clone = copy.copy(module)
    clone._parameters = {n: None if p is None else nn.Parameter(meta(p), p.requires_grad)
                         for n, p in module._parameters.items()}
    clone._buffers = {n: None if b is None else meta(b) for n, b in module._buffers.items()}
    clone._modules = {n: None if m is None else _meta_replica(m) for n, m in module._modules.items()}
    return clone


class ZerosForEmbedding(nn.Module):
    """Stands in for an embedding module of stage 0 on a later stage: zeros shaped like the received hidden
    state (B, T, h), in its dtype, so the code between the embedding and the first block runs as in one
    process (what it computes from them is thrown away when the first block hands over the hidden state).
    Other attributes are the embedding's, read from a meta replica (e.g. a forward reading its weight's dtype)."""

    def __init__(self, embedding: nn.Module, received: _Received):
        super().__init__()
        self._received = received
        self._replica = (_meta_replica(embedding),)  # in a tuple: not a submodule

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_replica"][0], name)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        hidden = self._received.tensor
        return torch.zeros(tuple(hidden.shape), dtype=hidden.dtype, device=_local(hidden).device)


class ReceivedForBlock(nn.Module):
    """Stands in for a block of an earlier stage: gives the hidden state this stage received."""

    def __init__(self, received: _Received):
        super().__init__()
        self._received = received

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self._received.tensor


class ReceivedIntoBlock(nn.Module):
    """Wraps this stage's first block (when the stage starts with one): the block is called as the forward calls
    it, with the received hidden state in place of the one the forward computed (from the stand-ins)."""

    def __init__(self, block: nn.Module, received: _Received):
        super().__init__()
        self._block = (block,)  # in a tuple: the block is the chunk's, not this wrapper's
        self._received = received

    def forward(self, *args, **kwargs):
        if args:
            args = (self._received.tensor, *args[1:])
        elif "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": self._received.tensor}
        else:
            raise PipelineSplitError("a pipeline stage hands its successor the hidden state a block is called with: "
                                     "call each block with it as the first argument or as hidden_states=")
        return self._block[0](*args, **kwargs)


class _StageOutput(BaseException):  # not an Exception: a model's own `except Exception` must not catch it
    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


class EndOfStage(nn.Module):
    """Stands in for the first unit of a later stage: ends the forward with the hidden state it is given."""

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor):
            raise PipelineSplitError("a pipeline stage hands its successor the hidden state a block is called with: "
                                     "call each block with it as the first argument or as hidden_states=")
        raise _StageOutput(hidden)


# ---- which module does what ----------------------------------------------------------------------


@dataclass(frozen=True)
class UnitRoles:
    """The module paths of all stages, sorted into embedding, blocks and head (see the module docstring)."""

    embedding: tuple[str, ...]  # before the first block: only stage 0 runs them
    head: tuple[str, ...]  # after the last block: the last stage runs them
    block_containers: tuple[str, ...]  # parents of the blocks, e.g. ('model.layers',)
    all_paths: tuple[str, ...]  # every stage's paths, in stage order


def _is_block(model: nn.Module, path: str) -> bool:
    parent, _, _ = path.rpartition(".")
    return bool(parent) and isinstance(model.get_submodule(parent), BLOCK_CONTAINERS)


def unit_roles(model: nn.Module, stage_modules: Sequence[Sequence[str]]) -> UnitRoles:
    """Check that `stage_modules` cover the model's parameters exactly once; sort the paths by role."""
    if len(stage_modules) < 2:
        raise PipelineSplitError(f"a pipeline needs at least 2 stages, got {len(stage_modules)}")
    flat = [path for stage in stage_modules for path in stage]
    for index, stage in enumerate(stage_modules):
        if not stage:
            raise PipelineSplitError(f"pipeline stage {index} runs no module: give every stage at least one unit")
    for path in flat:
        try:
            model.get_submodule(path)
        except AttributeError as error:
            raise PipelineSplitError(
                f"stage module {path!r} is not a module of {type(model).__name__}: the plan was made for "
                "another model; compile it again for this model file") from error
    seen: set[str] = set()
    for path in flat:
        clash = next((p for p in seen if p == path or path.startswith(p + ".") or p.startswith(path + ".")), None)
        if clash is not None:
            raise PipelineSplitError(f"module {path!r} is in two pipeline stages (with {clash!r}): each module "
                                     "must belong to exactly one stage")
        seen.add(path)
    if dict(model.named_parameters(recurse=False)):
        names = ", ".join(dict(model.named_parameters(recurse=False)))
        raise PipelineSplitError(f"{type(model).__name__} holds parameters at its root ({names}), which no "
                                 "pipeline stage can own: move them into a submodule (e.g. the embedding's)")
    uncovered = [name for name, _ in model.named_parameters(remove_duplicate=False)
                 if not any(name.startswith(path + ".") for path in flat)]
    if uncovered:
        raise PipelineSplitError(f"parameters {', '.join(uncovered[:5])} are in no pipeline stage: the stages "
                                 "must list every module that holds parameters")
    blocks = [i for i, path in enumerate(flat) if _is_block(model, path)]
    if not blocks:
        raise PipelineSplitError(f"none of the stage modules of {type(model).__name__} is a block (a child of a "
                                 "ModuleList, ModuleDict or Sequential): keep the repeated blocks in one of those")
    embedding, head = tuple(flat[: blocks[0]]), tuple(flat[blocks[-1] + 1:])
    if not set(embedding) <= set(stage_modules[0]):
        raise PipelineSplitError(f"the embedding modules {list(embedding)} must all be in pipeline stage 0")
    if not set(head) <= set(stage_modules[-1]):
        raise PipelineSplitError(f"the head modules {list(head)} must all be in the last pipeline stage")
    containers = tuple(dict.fromkeys(flat[i].rpartition(".")[0] for i in blocks))
    return UnitRoles(embedding=embedding, head=head, block_containers=containers, all_paths=tuple(flat))



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
    (the convention of runtime.train_loop.forward_batch)."""
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
        if isinstance(index, FakeTensor):  # the dry run (runtime.fake_world): no value, and every micro-batch of a
            return self.batches[0]  # step has the same shapes, so the first stands in
        return self.batches[int(index.reshape(-1)[0]) if isinstance(index, torch.Tensor) else index]


class PipelineChunk(nn.Module):
    """One pipeline stage (a model chunk): its modules under their original names, and the forward that
    runs them (module docstring). Stage 0 takes the leaves of a batch (tensors) and rebuilds the batch; the
    others take the hidden state of the stage before, and the micro-batch's index."""

    def __init__(self, model: nn.Module, paths: Sequence[str], stage_index: int, num_stages: int,
                 roles: UnitRoles, micro_batches: MicroBatches, activation_compression: str = "none"):
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
                from zplan.runtime.compression.activations import receive_int8

                hidden = receive_int8(hidden)
            self._received.tensor = hidden
            batch = self._micro_batches.get(micro_batch_index)
        else:
            raise PipelineSplitError(f"pipeline stage {self._stage_index} received {len(args)} tensors: the "
                                     "stages must pass one hidden-state tensor (a block returns one tensor)")
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
        finally:
            self._received.tensor = None
        if self._int8_out:
            from zplan.runtime.compression.activations import send_int8

            x = send_int8(x)
        return x

    def outputs_for_loss(self, logits: torch.Tensor) -> Any:
        """What the loss receives from the last stage: its tensor, or the model's own output object of the
        micro-batch just run (the schedule computes each micro-batch's loss right after its forward) holding
        `logits`, with what else the forward computed from the batch (a Hugging Face model's .loss from the
        batch's labels)."""
        output, self._output = self._output, None
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
                roles: UnitRoles | None = None, activation_compression: str = "none") -> list[PipelineChunk]:
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

    A model on the meta device (built by runtime.materialize before its weights exist) has no values to
    compare: there the check is of the output's shape only, the forward still run through every stage, each
    distinct operation once (planner.tracers.CachedMetaOps: the blocks repeat)."""
    from zplan.planner.tracers import CachedMetaOps, MetaOpCache

    on_meta = any(_local(p).is_meta for p in model.parameters())
    was_training = model.training
    model.eval()
    for chunk in chunks:  # the modules outside the units follow the chunk's mode (PipelineChunk.forward)
        chunk.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), \
                CachedMetaOps(MetaOpCache()) if on_meta else contextlib.nullcontext():
            expected = _call_with_batch(lambda module, *a, **k: module(*a, **k), model, example_batch)
            outputs = run_stages(chunks, example_batch)
    except PipelineSplitError:
        raise
    except Exception as error:
        raise PipelineSplitError(
            f"the pipeline stages of {type(model).__name__} cannot run its forward ({type(error).__name__}: "
            f"{error}): every stage runs the forward with the other stages' units stood in for (runtime/pipeline.py "
            "says what the forward may do)") from error
    finally:
        for chunk in chunks:
            chunk.train(was_training)
        model.train(was_training)
    got = outputs[-1]
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
            "output's shape, and each block must return the next hidden state (runtime/pipeline.py says more)")
    return outputs


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


# ---- tied parameters across pipeline ranks -------------------------------------------------------


def _stage_of(name: str, stage_modules: Sequence[Sequence[str]]) -> int:
    return next(i for i, paths in enumerate(stage_modules) if any(name.startswith(p + ".") for p in paths))


def tied_parameters(model: nn.Module, stage_modules: Sequence[Sequence[str]], pp: int) -> list[tuple[str, ...]]:
    """Names of each parameter registered under several names whose names fall on more than one pipeline
    rank (e.g. ('wte.weight', 'lm_head.weight')), in a fixed order."""
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    tied = [tuple(names) for names in names_of.values()
            if len({_stage_of(name, stage_modules) % pp for name in names}) > 1]
    return sorted(tied)


# ---- the run -------------------------------------------------------------------------------------


class PipelineRun(nn.Module):
    """This pipeline rank's part of the model, and the schedule that trains it.

    As an nn.Module it holds this rank's stage modules under their original names (what the optimizer,
    checkpoints and state dicts see: 'blocks.2.ln1.weight', not 'chunks.0....'); forward is not used:
    call step(). `chunks` are the stage modules the schedule runs; data parallelism wraps them (DDP or
    fully_shard, each chunk like a model) before the first step(), which builds the PipelineStages.
    """

    def __init__(self, chunks: list[PipelineChunk], model: nn.Module, roles: UnitRoles, group: dist.ProcessGroup,
                 schedule: str, num_micro_batches: int, loss_fn: Callable,
                 tied: list[tuple[str, ...]], stage_modules: Sequence[Sequence[str]]):
        super().__init__()
        _attach(self, model, [p for chunk in chunks for p in chunk._paths], roles.block_containers)
        self._chunks: list[nn.Module] = list(chunks)
        self._built_chunks = tuple(chunks)  # as built, before data parallelism wraps them (not registered)
        self._stage_indices = [chunk.stage_index for chunk in chunks]
        # stage 0's chunk as built (the wrappers of data parallelism replace it in `chunks`); in a tuple, so
        # that it is not registered as a submodule (its modules are already, under their own names)
        self._first_chunk = tuple(chunk for chunk in chunks if chunk.stage_index == 0)
        self._num_stages = len(stage_modules)
        self._group = group
        self._pp_rank, self._pp = dist.get_rank(group), dist.get_world_size(group)
        self._schedule_name = schedule
        self._num_micro_batches = num_micro_batches
        self._loss_fn = loss_fn
        self._loss_scale = 1.0  # step() sets it: the factor of fp16 loss scaling
        self._loss_batches = MicroBatches()  # step() sets them: the micro-batches the loss receives
        self._schedule = None
        self._micro_batches = chunks[0]._micro_batches  # shared by the chunks: what later stages read
        self._last_chunk = tuple(chunk for chunk in chunks if chunk.stage_index == self._num_stages - 1)
        # Tied parameters on several ranks: this rank's name of each, the pipeline ranks holding it, and
        # whether this rank counts it in the gradient norm (the first holder does).
        self._tied: list[tuple[str, list[int]]] = []
        self._tied_names: dict[str, str] = {}
        self._not_in_norm: set[str] = set()
        for names in tied:
            holders = sorted({_stage_of(n, stage_modules) % self._pp for n in names})
            if self._pp_rank not in holders:
                continue
            mine = next(n for n in names if _stage_of(n, stage_modules) % self._pp == self._pp_rank)
            self._tied.append((mine, holders))
            self._tied_names[mine] = names[0]
            if self._pp_rank != holders[0]:
                self._not_in_norm.add(mine)

    @property
    def chunks(self) -> list[nn.Module]:
        """This rank's stage modules (wrap them in place for data parallelism before the first step)."""
        return self._chunks

    @property
    def model_forward(self) -> Callable:
        """The model class's forward (unbound), which every stage runs: what it takes is what a batch holds."""
        return self._built_chunks[0]._skeleton_of[1]

    @property
    def stage_indices(self) -> list[int]:
        return list(self._stage_indices)

    @property
    def _device(self) -> torch.device:
        """Where this rank's stages compute: read when needed, as a model built on meta gets its weights
        after the split (runtime.materialize)."""
        return next(self.parameters()).device

    def weight_roots(self) -> list[nn.Module]:
        """The modules under which each tensor of this rank's stages appears with its model-file name:
        the stage modules and the model copies the first and last stage run (runtime.materialize)."""
        return [*self._built_chunks, *(chunk.skeleton for chunk in self._built_chunks)]

    @property
    def tied_names(self) -> dict[str, str]:
        """{this rank's name of a tied parameter: its first name in the whole model}, e.g. {'lm_head.weight':
        'wte.weight'} on the last rank. A checkpoint of the whole model keys a tied parameter's optimizer
        state by the first name only, so loading one on this rank must read that name's entries."""
        return dict(self._tied_names)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs through PipelineRun.step(micro_batches), not forward()")

    def train(self, mode: bool = True) -> PipelineRun:
        super().train(mode)
        for chunk in self._chunks:
            chunk.train(mode)
        return self

    def _activation_examples(self, first_micro_batch: Any) -> dict[int, tuple[tuple, tuple]] | None:
        """(inputs, outputs) of each local stage for one micro-batch, as meta tensors: one forward of every
        stage, in stage order, under no_grad and through the chunks as wrapped for data parallelism (so
        mixed precision shows in the dtypes); each rank sends the shapes and dtypes of its outputs to the
        next stage's rank. None if an activation is a DTensor (sequence parallel): torch infers those.

        torch's own inference (PipelineStage without example tensors) also runs a backward, which breaks
        DDP's reducer with 2 chunks per rank (torch 2.13); the forward alone under no_grad does not."""

        def meta(t: torch.Tensor, grad: bool) -> torch.Tensor:
            t = torch.empty(t.shape, dtype=t.dtype, device="meta")
            return t.requires_grad_(True) if grad and t.is_floating_point() else t

        examples: dict[int, tuple[tuple, tuple]] = {}
        has_dtensor = False
        local = dict(zip(self._stage_indices, self._chunks, strict=True))
        self._micro_batches.batches = [first_micro_batch]
        outputs: tuple = ()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for stage in range(self._num_stages):
                if stage not in local:
                    continue
                if stage == 0:
                    inputs = tuple(batch_leaves(first_micro_batch)[0])
                elif stage - 1 in local:
                    inputs = outputs
                else:
                    received: list[Any] = [None]
                    dist.recv_object_list(received, group=self._group, group_src=(stage - 1) % self._pp)
                    inputs = tuple(torch.zeros(shape, dtype=dtype, device=self._device)
                                   for shape, dtype in received[0])
                result = local[stage](*inputs, **{MICRO_BATCH_INDEX: torch.zeros(1, dtype=torch.long)})
                outputs = result if isinstance(result, tuple) else (result,)
                has_dtensor |= any(isinstance(t, DTensor) for t in (*inputs, *outputs))
                examples[stage] = (tuple(meta(t, grad=stage > 0) for t in inputs),
                                   tuple(meta(t, grad=True) for t in outputs))
                if stage + 1 < self._num_stages and stage + 1 not in local:
                    shapes = [(tuple(t.shape), t.dtype) for t in outputs]
                    dist.send_object_list([shapes], group=self._group, group_dst=(stage + 1) % self._pp)
        return None if has_dtensor else examples

    def _build_schedule(self, first_micro_batch: Any):
        from torch.distributed import pipelining

        examples = self._activation_examples(first_micro_batch)
        stages = []
        for chunk, index in zip(self._chunks, self._stage_indices, strict=True):
            inputs, outputs = examples[index] if examples else (None, None)
            stages.append(pipelining.PipelineStage(_as_stage_module(chunk), index, self._num_stages, self._device,
                                                   input_args=inputs, output_args=outputs, group=self._group))
        schedule_class = getattr(pipelining, SCHEDULES[self._schedule_name])
        # scale_grads=False: step() divides the gradients by num_micro_batches itself, once per parameter
        # (torch scales per stage, twice for a parameter shared by two chunks of one rank).
        if schedule_class is pipelining.ScheduleInterleaved1F1B:
            return schedule_class(stages, self._num_micro_batches, loss_fn=self._micro_batch_loss,
                                  scale_grads=False)
        return schedule_class(stages[0], self._num_micro_batches, loss_fn=self._micro_batch_loss,
                              scale_grads=False)

    def _micro_batch_loss(self, output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        # The schedule hands the loss a slice of `target`; step() passes the micro-batch indices as target,
        # so that loss_fn receives the whole micro-batch (any structure), as in the non-pipelined loop.
        loss = self._loss_fn(self._last_chunk[0].outputs_for_loss(output), self._loss_batches.get(index))
        return loss * self._loss_scale

    def step(self, micro_batches: Sequence[Any], loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of one optimizer step over `micro_batches` (num_micro_batches batches as the
        data iterator yields them, on the device; every pipeline rank passes the same ones). Gradients are
        the mean over the micro-batches of the gradients of loss * `loss_scale` (fp16 loss scaling:
        runtime.loss_scale unscales them), tied gradients summed over ranks. Returns the mean loss
        (unscaled), on every pipeline rank."""
        if len(micro_batches) != self._num_micro_batches:
            raise ValueError(f"expected {self._num_micro_batches} micro-batches, got {len(micro_batches)}")
        # the loss gets each micro-batch as given; the stages its forward inputs (a context-parallel batch's inputs:
        # runtime.context_parallel, whose attention scope the caller holds around step)
        self._loss_batches.batches = list(micro_batches)
        micro_batches = [batch.inputs if isinstance(batch, ContextParallelBatch) else batch for batch in micro_batches]
        holds_first, holds_last = 0 in self._stage_indices, self._num_stages - 1 in self._stage_indices
        args: tuple = ()
        if holds_first:
            per_micro = [batch_leaves(batch) for batch in micro_batches]
            self._first_chunk[0]._batch_spec = per_micro[0][1]  # stage 0 rebuilds a micro-batch from its tensors
            # the schedule splits each tensor along dim 0 into num_micro_batches equal parts: these ones
            args = tuple(torch.cat(parts) for parts in zip(*(leaves for leaves, _ in per_micro), strict=True))
        if self._schedule is None:
            self._schedule = self._build_schedule(micro_batches[0])
        self._micro_batches.batches = list(micro_batches)
        self._loss_scale = loss_scale
        target = torch.arange(self._num_micro_batches) if holds_last else None
        losses: list[torch.Tensor] = []
        self._schedule.step(*args, target=target, losses=losses if holds_last else None, return_outputs=False,
                            **{MICRO_BATCH_INDEX: torch.arange(self._num_micro_batches)})  # one index per stage call
        self._micro_batches.batches, self._loss_batches.batches = [], []
        for chunk in self.chunks:  # tensor parallel's data-parallel reductions done (DDP waits in its backward)
            reducer = gradient_reducer(chunk)
            if reducer is not None:
                reducer.wait()
        for param in self.parameters():  # unique parameters of this rank
            if param.grad is not None:
                param.grad.div_(self._num_micro_batches)
        for name, holders in self._tied:
            grad = self.get_parameter(name).grad
            self._sum_over_ranks(grad.to_local() if isinstance(grad, DTensor) else grad, holders)
        loss = (torch.stack([x.detach().float() for x in losses]).mean() / loss_scale if holds_last
                else torch.zeros((), device=self._device))
        dist.broadcast(loss, group=self._group, group_src=(self._num_stages - 1) % self._pp)
        return loss

    def _sum_over_ranks(self, local: torch.Tensor, holders: list[int]) -> None:
        """local <- the sum of `local` over the pipeline ranks `holders`, added in rank order on each (so the
        copies stay bit-identical). Point-to-point over the pp group: no process group per tied parameter. Two
        holders (a tied embedding and head) add in place: a + b is b + a to the bit, so one received copy is the
        only temporary."""
        others = [r for r in holders if r != self._pp_rank]
        received = {r: torch.empty_like(local) for r in others}
        ops = [dist.P2POp(dist.isend, local, group=self._group, group_peer=r) for r in others]
        ops += [dist.P2POp(dist.irecv, received[r], group=self._group, group_peer=r) for r in others]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if len(holders) == 2:
            local.add_(received[others[0]])
            return
        parts = {**received, self._pp_rank: local.clone()}
        total = parts[holders[0]]
        for r in holders[1:]:
            total = total + parts[r]
        local.copy_(total)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole pipeline: the norm of all stages' gradients (tied
        ones counted once, accumulated in fp32), the same on every rank; grads scaled by min(1, max_norm / (norm +
        1e-6)).
        max_norm <= 0 or inf: only the norm."""
        named = [(name, p) for name, p in self.named_parameters() if p.grad is not None]
        counted = [p.grad for name, p in named if name not in self._not_in_norm]
        # in fp32: 16-bit gradients may still carry an fp16 loss scale (runtime.train_loop)
        local = total_norm_fp32(counted, norm_type).to(self._device)
        if math.isinf(norm_type):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._group)
            total = local
        else:
            power = local**norm_type
            dist.all_reduce(power, group=self._group)
            total = power ** (1.0 / norm_type)
        if max_norm > 0 and not math.isinf(max_norm):  # on the device, no value read back (nor a sync)
            torch.nn.utils.clip_grads_with_norm_([p for _, p in named], max_norm, total)
        return total


class _ShardedStage(nn.Module):
    """An FSDP2 chunk (ZeRO 2/3) as torch.distributed.pipelining sees it: a plain module. Given an FSDPModule, the
    pipeline stage keeps every unit's parameters gathered and its gradients unsharded from the first micro-batch's
    backward to the step's end, reducing once (set_reshard_after_backward / set_requires_gradient_sync False):
    measured by the dry run, 6 bytes a parameter of the stage more than ZeRO-3 holds (70B, tp 4 x pp 2, 61.5 GiB for
    11.7 planned). Seen as a plain module, the chunk runs as ZeRO 2/3 run outside a pipeline and as the planner
    prices them: each unit's gradients reduce-scattered every micro-batch, ZeRO-3's parameters gathered for each
    forward and backward and freed after."""

    def __init__(self, chunk: nn.Module):
        super().__init__()
        self.chunk = chunk

    def forward(self, *args, **kwargs):
        return self.chunk(*args, **kwargs)


def _as_stage_module(chunk: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import FSDPModule

    return _ShardedStage(chunk) if isinstance(chunk, FSDPModule) else chunk


def _process_group(pp: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    return pp.get_group() if isinstance(pp, DeviceMesh) else pp


def build_pipeline(
    model: nn.Module,
    pp: DeviceMesh | dist.ProcessGroup,
    stage_modules: Sequence[Sequence[str]],
    schedule: str,
    num_micro_batches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    example_micro_batch: Any,
    activation_compression: str = "none",
) -> PipelineRun:
    """This rank's stages of `model` and `schedule` over them (module docstring).

    stage_modules[s]: the module paths of stage s (plan units expanded with stage_module_paths); with
    interleaved 1F1B, len(stage_modules) = v * pp and stage s is chunk s // pp of pipeline rank s % pp.
    loss_fn(outputs, micro_batch) -> scalar mean over the micro-batch (the model file's loss_fn).
    activation_compression: 'none', or 'int8': hidden states and their gradients travel between stages as int8
    (runtime.compression.activations).
    example_micro_batch: a batch the model takes, e.g. the model file's example_inputs(micro_batch,
    seq_len); used to check the split (check_split). The stages learn their activations' shapes and
    dtypes at the first step(), from its first micro-batch through the chunks as data parallelism wrapped
    them (PipelineRun._activation_examples). Every rank passes the whole model, on the meta device (as
    runtime.materialize.build_meta_model makes it: materialize_weights then fills only this rank's stages)
    or real; drop the reference to `model` afterwards so that only this rank's stages stay in memory.
    """
    if schedule not in SCHEDULES:
        raise PipelineSplitError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    group = _process_group(pp)
    pp_size, pp_rank = dist.get_world_size(group), dist.get_rank(group)
    num_stages = len(stage_modules)
    if num_stages % pp_size:
        raise PipelineSplitError(f"{num_stages} stages cannot be spread evenly over {pp_size} pipeline ranks")
    chunks_per_rank = num_stages // pp_size
    if schedule != "interleaved-1f1b" and chunks_per_rank != 1:
        raise PipelineSplitError(f"{schedule} runs one stage per pipeline rank: got {num_stages} stages for "
                                 f"{pp_size} ranks (use interleaved-1f1b for {chunks_per_rank} chunks per rank)")
    if schedule == "1f1b" and num_micro_batches < num_stages:
        raise PipelineSplitError(f"1F1B needs at least as many micro-batches as stages: {num_micro_batches} "
                                 f"< {num_stages}")
    if schedule == "interleaved-1f1b" and num_micro_batches % max(1, num_micro_batches // pp_size):
        raise PipelineSplitError(f"interleaved 1F1B needs num_micro_batches ({num_micro_batches}) to be a "
                                 f"multiple of num_micro_batches // pp ({num_micro_batches // pp_size})")
    roles = unit_roles(model, stage_modules)
    chunks = split_model(model, stage_modules, roles, activation_compression)
    device = _local(next(model.parameters())).device  # meta for a model built on meta
    example_micro_batch = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
                                          example_micro_batch)
    # the split is checked exactly, without the (lossy) int8 activations
    check_split(model, split_model(model, stage_modules, roles) if activation_compression != "none" else chunks,
                example_micro_batch)
    mine = [chunks[s] for s in range(pp_rank, num_stages, pp_size)]
    tied = tied_parameters(model, stage_modules, pp_size)
    return PipelineRun(mine, model, roles, group, schedule, num_micro_batches, loss_fn, tied, stage_modules)


# ---- helpers for the emitted script --------------------------------------------------------------


def stage_module_paths(stage_layer_names: Sequence[Sequence[str]], layers: Sequence[Any]) -> list[list[str]]:
    """The plan's stages (unit names, Stage.layer_names) as module paths: each unit's LayerCost.modules
    (e.g. 'embedding' -> ['wte', 'wpe']), or the unit name itself when it lists none (a hand-made plan
    whose units are module paths)."""
    modules_of = {layer.name: list(layer.modules) for layer in layers}
    return [[path for name in names for path in (modules_of.get(name) or [name])] for names in stage_layer_names]


def gather_full_state_dict(run: PipelineRun, optimizer: torch.optim.Optimizer | None = None
                           ) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict (full CPU tensors, original names and order; a 16-bit parameter's fp32 master
    where `optimizer` keeps one: runtime.zero1) on pipeline rank 0, None on the others. Collective over the pipeline
    group, and over data/tensor parallel meshes for DTensors."""
    from zplan.runtime.fused_layout import stored_layouts, to_original_state
    from zplan.runtime.zero1 import with_master_weights

    local = {}
    for name, tensor in with_master_weights(run.state_dict(), optimizer)[0].items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        local[name] = full.detach().cpu()
    layouts = {name: layout for root in run.weight_roots() for name, layout in stored_layouts(root).items()}
    local = to_original_state(local, layouts)  # fused projections in the model file's order
    gathered: list[dict | None] = [None] * run._pp if run._pp_rank == 0 else None
    dist.gather_object(local, gathered, group=run._group, group_dst=0)
    if run._pp_rank != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    return merged
