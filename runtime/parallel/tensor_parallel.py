"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al.
2022, section 4.2.2) with DTensor's `parallelize_module` (docs/design.md decision 4).

The plan names each Linear of a block by its path inside the block and gives its split:

    colwise  ColwiseParallel: weight (out/tp, in) and bias (out/tp,) per rank; input replicated (B, T, in),
             output this rank's features (B, T, out/tp), a plain tensor.
    rowwise  RowwiseParallel: weight (out, in/tp) per rank, bias replicated; input this rank's features
             (B, T, in/tp), output summed over the tp ranks: all-reduced to (B, T, out), or with sequence
             parallel reduce-scattered to this rank's tokens (B, T/tp, out).

A colwise Linear of q, k or v hands each rank a whole number of heads, and attention keeps them when it
reshapes with view(B, T, -1, head_dim) (docs/design.md facts): a/tp query heads and, for grouped-query
attention, kv_heads/tp key/value heads per rank, which pair up as in one process when tp divides
kv_heads. The split is checked before anything is sharded (see check_block_split).

The token embedding and the output head are split by vocabulary rows where the plan says so
(plan.parallel.vocab_parallel: runtime/parallel/vocab_parallel.py; the logits then a DTensor sharded on the
vocabulary, never gathered, the loss computed on them). Everything else outside the plan (norms, a position table; the
embedding and head of a plan that does not split them) stays replicated: every tp rank holds and updates the same full
tensors. Its parameters become Replicate DTensors on the tp mesh as well, so
that every parameter of the model is a DTensor on one mesh: clip_grad_norm_ and the fused AdamW step
refuse a mix of plain tensors and DTensors, and FSDP2 then shards all of them alike over dp. The module
that owns such a parameter still computes on plain tensors: a forward pre-hook puts the parameter's
local tensor in its place (to_local, whose backward hands the gradient back to the DTensor parameter as
Replicate: it is the full gradient on every rank, computed from replicated activations) and the
forward hook puts the parameter back. So activations between blocks and inside attention are plain
tensors throughout (use_local_output=True everywhere) except under sequence parallel, below.

Sequence parallel: between blocks each rank keeps its own T/tp tokens of the residual stream (B, T/tp, h).
  - the first block's input is cut to this rank's tokens (backward: the gradient is all-gathered);
  - norms inside blocks (classes named *Norm) run on their tokens with SequenceParallel: Replicate
    parameters, gradients Partial until reduced; their output is a DTensor sharded on the sequence;
  - the module holding colwise Linears (e.g. `attn`, `mlp`) all-gathers its DTensor inputs once, to
    Replicate (backward: reduce-scatter), so that it sees the full (B, T, h) and its x.shape is global;
  - rowwise Linears reduce-scatter to (B, T/tp, h) instead of all-reducing (same bytes: Megatron's point);
  - the last block's output is all-gathered back to (B, T, h) for the replicated final norm and head.

Initialisation: the model is split while still on the meta device; runtime.training.materialize then fills
each rank's local slice from the replayed single-process initialisation, one tensor at a time.

Fused projections (one module computing q, k and v, or gate and up, its output sliced by the forward): the
output features are stored group by group (model/fused_layout.py), so that the column split gives each rank
whole groups of every part; a forward hook puts the rank's output back in the model file's order, and the
module slicing it has its head counts made this rank's (localize_head_counts: Phi-3 reads
config.num_attention_heads, GPT-2 split_size). transformers' Conv1D (GPT-2: weight (in, out)) is split by
Conv1DColwise / Conv1DRowwise, its forward running on DTensors.

fp8 (plan.train.precision 'fp8'): the blocks' Linears are torchao Float8Linears before this runs
(runtime.precision.float8);
each gets torchao's Float8ColwiseParallel / Float8RowwiseParallel instead of the plain style (same sharding, the
casts to fp8 on whole DTensors, so with the one-process scales), the collectives above unchanged and in bf16.

Not done yet: parameterised modules inside a module that holds split Linears, other than those Linears and per-head
norms, are refused.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from zplan.errors import PlanMismatchError
from zplan.model.fused_layout import FusedLayout, check_layout, give_output_in_file_order, mark_fused
from zplan.model.modules import is_conv1d, parent_path, transformer_blocks, unsplit_parameter_owners
from zplan.runtime.parallel.vocab_parallel import split_vocabulary
from zplan.runtime.precision.float8 import float8_parallel_styles

STYLES = ("colwise", "rowwise")
SEQUENCE_DIM = 1  # activations are (B, T, h)


# ---- the plan as ParallelStyles ---------------------------------------------------------------------


def _distribute_parameters(placements: dict[str, Placement], src_data_rank: int | None):
    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            dist = distribute_tensor(param, mesh, [placements[param_name]], src_data_rank=src_data_rank)
            module.register_parameter(param_name, nn.Parameter(dist, requires_grad=param.requires_grad))

    return partition


class Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for transformers' Conv1D (weight (in, out)): weight Shard(1), bias Shard(0). Its forward
    (addmm and views with the global out features, nf) runs on DTensors, so nothing else changes."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, _distribute_parameters({"weight": Shard(1), "bias": Shard(0)}, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel for Conv1D: weight Shard(0) (its input features), bias Replicate (DTensor adds it once to
    the partial sums, as for nn.Linear)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, _distribute_parameters({"weight": Shard(0), "bias": Replicate()}, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def block_styles(tp_plan: dict[str, str], sequence_parallel: bool, norm_paths: list[str],
                 conv1d_paths: frozenset[str] = frozenset(),
                 float8_paths: frozenset[str] = frozenset()) -> dict[str, ParallelStyle]:
    """The ParallelStyle of each planned Linear (Conv1D: `conv1d_paths`; torchao Float8Linear, precision fp8:
    `float8_paths`) and, with sequence parallel, of each norm of one block.

    Without sequence parallel both styles take and give plain tensors (use_local_output=True).
    With it, rowwise output is reduce-scattered over the sequence; a colwise Linear directly in the block
    all-gathers its own input (one held by a sub-module gets it gathered by that sub-module's pre-hook).
    A Float8Linear gets torchao's Float8ColwiseParallel / Float8RowwiseParallel (the same sharding;
    runtime.precision.float8 float8_parallel_styles says what they add); a Linear fp8 skipped keeps the plain style.
    """
    styles: dict[str, ParallelStyle] = {}
    for path, style in tp_plan.items():
        if style not in STYLES:
            raise PlanMismatchError(f"tensor-parallel style of {path!r} is {style!r}; expected one of {STYLES}")
        conv1d = path in conv1d_paths
        if path in float8_paths:
            colwise, rowwise = float8_parallel_styles()
        else:
            colwise, rowwise = (Conv1DColwise, Conv1DRowwise) if conv1d else (ColwiseParallel, RowwiseParallel)
        if style == "colwise":
            gathers_itself = sequence_parallel and not parent_path(path)
            styles[path] = colwise(input_layouts=Shard(SEQUENCE_DIM)) if gathers_itself else colwise()
        else:
            styles[path] = rowwise(output_layouts=Shard(SEQUENCE_DIM)) if sequence_parallel else rowwise()
    if sequence_parallel:
        for path in norm_paths:
            styles[path] = SequenceParallel(sequence_dim=SEQUENCE_DIM)
    return styles


# ---- checks before anything is sharded ---------------------------------------------------------------


def is_float8_linear(module: nn.Module) -> bool:
    """A torchao Float8Linear (runtime.precision.float8 converted it: precision fp8), by class name: no torchao
    import."""
    return type(module).__name__ == "Float8Linear"


def projection_features(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of an nn.Linear or a transformers Conv1D; None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        return tuple(module.weight.shape)
    return None


def check_block_split(block: nn.Module, block_name: str, tp_plan: dict[str, str], tp: int,
                      sequence_parallel: bool, fused: dict[str, FusedLayout] | None = None) -> list[str]:
    """Raise PlanMismatchError when the plan cannot split this block over `tp` ranks (`fused`: the layouts of its
    fused projections); return the paths of the block's norms (the modules sequence parallel runs token-wise)."""
    fused = fused or {}
    problems = []
    for path, style in tp_plan.items():
        try:
            linear = block.get_submodule(path)
        except AttributeError:
            problems.append(f"{block_name}.{path} does not exist")
            continue
        features = projection_features(linear)
        if features is None:
            problems.append(f"{block_name}.{path} is a {type(linear).__name__}, not an nn.Linear or a Conv1D")
            continue
        split_features = features[1] if style == "colwise" else features[0]
        if split_features % tp:
            side = "output" if style == "colwise" else "input"
            problems.append(f"{block_name}.{path} has {split_features} {side} features, not a multiple of tp={tp}")
            continue
        if path in fused:
            problems += fused_problems(block, block_name, {path: fused[path]}, tp, style)
            continue
        head_dim = getattr(block.get_submodule(parent_path(path)), "head_dim", None) if parent_path(path) else None
        if style == "colwise" and isinstance(head_dim, int) and (split_features // tp) % head_dim:
            problems.append(f"{block_name}.{path} has {split_features // head_dim} heads of {head_dim}, "
                            f"not a multiple of tp={tp}: a rank would hold part of a head")
    norms = []
    for name, module, role in unsplit_parameter_owners(block, set(tp_plan)):
        where, kind = (f"{block_name}.{name}" if name else block_name), type(module).__name__
        if role == "beside":  # it would see this rank's features or heads only: its gradient, a partial sum
            problems.append(f"{where} ({kind}) has parameters of its own beside the split Linears")
        elif sequence_parallel and role == "norm":
            norms.append(name)
        elif sequence_parallel:  # it would see this rank's tokens only: its gradient, a partial sum
            problems.append(f"{where} ({kind}) has parameters and is not a norm: sequence parallel cannot run "
                            "it on this rank's tokens")
    if problems:
        raise PlanMismatchError(
            f"the tensor-parallel plan does not fit the model at tp={tp}: " + "; ".join(problems)
            + ". Recompile the plan for this model, or pin tp=1."
        )
    return norms


def head_norms(block: nn.Module, tp_plan: dict[str, str]) -> list[str]:
    """The paths of the block's per-head norms beside its split Linears (model.modules.unsplit_parameter_owners)."""
    return [name for name, _, role in unsplit_parameter_owners(block, set(tp_plan)) if role == "head_norm"]


def fused_problems(block: nn.Module, block_name: str, fused: dict[str, FusedLayout], tp: int,
                   style: str = "colwise") -> list[str]:
    """What does not fit in the plan's fused layouts for this block: the parts must add up to the module's output
    features, and a column split over tp must keep whole groups."""
    problems = []
    for path, layout in fused.items():
        features = projection_features(block.get_submodule(path))
        if features is None or sum(layout.parts) != features[1] or check_layout(layout.parts, layout.groups):
            problems.append(f"{block_name}.{path} has {features[1] if features else 'no'} output features; the plan "
                            f"fuses {list(layout.parts)} in {layout.groups} groups")
        elif tp > 1 and (style != "colwise" or layout.groups % tp):
            problems.append(f"{block_name}.{path} fuses {len(layout.parts)} projections in {layout.groups} groups, "
                            f"which a {style} split over tp={tp} cannot keep whole")
    return problems


# ---- head counts of a module that slices a fused projection ---------------------------------------------------

# Attributes a forward reads to slice a fused output or count heads (Phi-3: config.num_attention_heads and
# num_key_value_heads; GPT-2: split_size). Unfused projections need none: attention reshapes with
# view(B, T, -1, head_dim) (docs/design.md facts).
HEAD_COUNT_NAMES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head", "n_heads",
                    "n_kv_heads", "split_size")


def localize_head_counts(holder: nn.Module, layout: FusedLayout, tp: int) -> list[str]:
    """Divide by tp the head counts and part widths `holder` (the module slicing a fused projection's output)
    reads: each attribute in HEAD_COUNT_NAMES, on the module or on its `config` (copied first: the model's other
    modules share it), whose value is a part's width or its number of heads. Returns the attributes changed."""
    head_dim = getattr(holder, "head_dim", None)
    global_values = set(layout.parts) | ({p // head_dim for p in layout.parts} if isinstance(head_dim, int) else set())
    changed = []
    config = getattr(holder, "config", None)
    if config is not None and any(getattr(config, n, None) in global_values for n in HEAD_COUNT_NAMES):
        holder.config = config = copy.copy(config)
    for owner, prefix in ((holder, ""), (config, "config.")):
        for name in HEAD_COUNT_NAMES:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value in global_values and value % tp == 0:
                setattr(owner, name, value // tp)
                changed.append(prefix + name)
    return changed


# ---- hooks -------------------------------------------------------------------------------------------


def _map_tensors(value, fn: Callable):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _gather_sequence_inputs(module: nn.Module, args: tuple, kwargs: dict):
    """Pre-hook of a module holding colwise Linears under sequence parallel: DTensor inputs sharded on
    the sequence become Replicate (one all-gather; backward reduce-scatter), and stay DTensors so the
    colwise Linears' Partial input gradients are summed by that reduce-scatter."""
    def gather(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor) and any(isinstance(p, Shard) for p in t.placements):
            return t.redistribute(placements=[Replicate()])
        return t

    return _map_tensors(args, gather), _map_tensors(kwargs, gather)


def _first_arg_hook(fn: Callable[[torch.Tensor], torch.Tensor]):
    def hook(module: nn.Module, args: tuple):
        if not args or not isinstance(args[0], torch.Tensor):
            raise PlanMismatchError(f"sequence parallel needs the hidden states (B, T, h) as the first positional "
                                    f"argument of each block; {type(module).__name__} was called without")
        return (fn(args[0]), *args[1:])

    return hook


def _first_output_hook(fn: Callable[[torch.Tensor], torch.Tensor]):
    def hook(module: nn.Module, args: tuple, output):
        if isinstance(output, torch.Tensor):
            return fn(output)
        return (fn(output[0]), *output[1:])  # blocks that return (hidden, extras...)

    return hook


def _scatter_sequence(tp_mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """(B, T, h) replicated -> this rank's tokens (B, T/tp, h); backward all-gathers the gradient."""
    tp = tp_mesh.size()

    def scatter(x: torch.Tensor) -> torch.Tensor:
        if x.size(SEQUENCE_DIM) % tp:
            raise PlanMismatchError(
                f"sequence parallel splits the sequence over tp={tp} ranks, but this batch has "
                f"{x.size(SEQUENCE_DIM)} tokens per sequence: use a multiple of {tp}"
            )
        full = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
        return full.redistribute(placements=[Shard(SEQUENCE_DIM)]).to_local()

    return scatter


def _gather_sequence(tp_mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """This rank's tokens (B, T/tp, h) -> (B, T, h) on every rank; backward keeps this rank's slice."""
    def gather(x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, tp_mesh, [Shard(SEQUENCE_DIM)], run_check=False)
        # clone: to_local() is a view, and FSDP2 warns about a block that returns one (an in-place op on
        # it would skip FSDP's pre-backward hook); the copy costs less than the all-gather before it.
        return x.redistribute(placements=[Replicate()]).to_local().clone()

    return gather


# ---- replicated parameters ---------------------------------------------------------------------------


def _compute_on_local_parameters(module: nn.Module, names: list[str]) -> None:
    """Let `module` compute on plain tensors although its parameters `names` are Replicate DTensors.

    The pre-hook puts each parameter's local tensor in its place (whatever parameter is registered at
    that moment: FSDP2 swaps its own unsharded parameters in before this hook runs), the forward hook
    puts the parameters back.
    """
    swapped: list[dict[str, torch.Tensor]] = []

    def to_local(mod: nn.Module, args):
        saved = {}
        for name in names:
            param = mod._parameters[name]
            if isinstance(param, DTensor):
                saved[name] = param
                mod._parameters[name] = param.to_local()  # backward: Replicate gradient into `param`
        swapped.append(saved)

    def restore(mod: nn.Module, args, output):
        mod._parameters.update(swapped.pop())

    module.register_forward_pre_hook(to_local)
    module.register_forward_hook(restore, always_call=True)


def replicate_remaining_parameters(model: nn.Module, tp_mesh: DeviceMesh) -> int:
    """Make every plain parameter a Replicate DTensor on `tp_mesh` (tied parameters stay one object) and
    let its module keep computing on plain tensors. Returns how many parameters were converted."""
    replicated: dict[int, nn.Parameter] = {}
    for module in model.modules():
        names = [n for n, p in module._parameters.items() if p is not None and not isinstance(p, DTensor)]
        for name in names:
            param = module._parameters[name]
            if id(param) not in replicated:
                # distribute_tensor broadcasts tp rank 0's values: replicas start equal even if the
                # model file's initialisation is not deterministic across processes.
                replicated[id(param)] = nn.Parameter(
                    distribute_tensor(param.detach(), tp_mesh, [Replicate()]), requires_grad=param.requires_grad
                )
            module._parameters[name] = replicated[id(param)]
        if names:
            _compute_on_local_parameters(module, names)
    return len(replicated)


# ---- the step ----------------------------------------------------------------------------------------


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: dict[str, str], block_prefix: str,
                          sequence_parallel: bool, fused: dict[str, FusedLayout] | None = None,
                          stage_starts: tuple[int, ...] = (), vocab: int = 0) -> nn.Module:
    """Split each block's planned Linears over `tp_mesh` (tp_plan: path inside the block -> 'colwise' or
    'rowwise'), with sequence parallel when planned; replicate every other parameter over `tp_mesh`. `fused`
    (path inside the block -> layout): the fused projections, stored grouped at every tp (model/fused_layout.py)
    and the head counts their holders read made this rank's. `stage_starts`: the blocks that begin a pipeline stage
    after the first; under sequence parallel the hidden state crosses each stage boundary whole, as it enters the
    first block and leaves the last (the model's forward around the blocks, rotary positions from the hidden
    state's length for one, runs on every stage), so the block before each gathers and the block itself scatters.
    `vocab` > 0: the plan splits the vocabulary of the embedding and the head (runtime/parallel/vocab_parallel.py);
    0 leaves them replicated.

    Returns `model`, changed in place. tp = 1 only stores the fused projections grouped.
    """
    tp, fused = tp_mesh.size(), fused or {}
    blocks = transformer_blocks(model, block_prefix)
    if tp == 1:
        for index, block in enumerate(blocks):
            problems = fused_problems(block, f"{block_prefix}.{index}", fused, 1)
            if problems:
                raise PlanMismatchError(f"the plan's fused projections do not fit the model: {'; '.join(problems)}. "
                                        "Recompile the plan for this model.")
            for path, layout in fused.items():
                mark_fused(block.get_submodule(path), layout)
                give_output_in_file_order(block.get_submodule(path), 1)
        return model
    if not tp_plan:
        raise PlanMismatchError(f"the plan has tp={tp} but no tensor-parallel rules: recompile the plan")
    for index, block in enumerate(blocks):
        norms = check_block_split(block, f"{block_prefix}.{index}", tp_plan, tp, sequence_parallel, fused)
        for path, layout in fused.items():  # grouped before the split, so that each rank's slice is whole groups
            mark_fused(block.get_submodule(path), layout)
        conv1d = frozenset(path for path in tp_plan if is_conv1d(block.get_submodule(path)))
        float8 = frozenset(path for path in tp_plan if is_float8_linear(block.get_submodule(path)))
        parallelize_module(block, tp_mesh, block_styles(tp_plan, sequence_parallel, norms, conv1d, float8))
        for path in head_norms(block, tp_plan):
            # each rank normalises its own heads (any dim but the last: the norm runs over head_dim); the weights
            # replicated, their gradient summed over the ranks (a partial sum each, as sequence parallel's norms)
            parallelize_module(block.get_submodule(path), tp_mesh, SequenceParallel(sequence_dim=0,
                                                                                    use_local_output=True))
        for path, layout in fused.items():
            give_output_in_file_order(block.get_submodule(path), tp)
            localize_head_counts(block.get_submodule(parent_path(path)) if parent_path(path) else block, layout, tp)
        if sequence_parallel:
            for holder in sorted({parent_path(path) for path in tp_plan} - {""}):
                block.get_submodule(holder).register_forward_pre_hook(_gather_sequence_inputs, with_kwargs=True)
    if sequence_parallel:  # once a block: a stage of the embedding alone makes block 0 a stage start too
        starts = sorted({0, *stage_starts})
        for start in starts:
            blocks[start].register_forward_pre_hook(_first_arg_hook(_scatter_sequence(tp_mesh)))
        for end in sorted({start - 1 for start in starts if start > 0} | {len(blocks) - 1}):
            blocks[end].register_forward_hook(_first_output_hook(_gather_sequence(tp_mesh)))
    if vocab:
        split_vocabulary(model, tp_mesh, block_prefix, vocab)
    replicate_remaining_parameters(model, tp_mesh)
    return model


def has_tensor_parallel_parameters(model: nn.Module) -> bool:
    """True once apply_tensor_parallel made the parameters DTensors (tp > 1)."""
    return any(isinstance(p, DTensor) for p in model.parameters())
