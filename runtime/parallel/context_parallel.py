"""Context parallelism (plan.parallel.cp): each sequence split over cp ranks, attention over the whole of it.

Sources: Megatron-LM's context parallelism (its load-balanced sequence split, get_batch_on_this_cp_rank in
megatron/training/utils.py; Transformer Engine's cp_comm_type "all_gather") and the Llama 3 paper (Dubey et al.
2024, sec. 3.3.2), whose all-gather variant this is: the keys and values of every layer are all-gathered over the cp
group and each rank's queries attend to all of them (not ring attention's pass-around).

Layout. A sequence of s tokens is cut into 2*cp chunks of c = s / (2*cp) tokens; cp rank r holds chunks r and
2*cp-1-r, so under the causal mask every rank has the same work (an early chunk sees few keys, a late one many):

    s = 16, cp = 2, c = 4:  rank 0 holds positions 0-3 and 12-15, rank 1 positions 4-11

    input_ids, position_ids, targets  (B, s/cp) per rank; position_ids are the tokens' global positions
    targets[b, i] = the full sequence's token after position_ids[i], IGNORE_INDEX at position s-1: taken from the
                    whole sequence before the split, so no target is lost at a chunk boundary

Attention. While a micro-batch's forward and backward run (ContextParallelBatch.attention()), a TorchFunctionMode
(and, for activation recompute, torch.nn.functional's attribute: ContextParallelAttention) replaces
F.scaled_dot_product_attention(q, k, v): q, k, v (B, H, s/cp, d) are this rank's tokens; k and v are
all-gathered over the cp group along the sequence (an autograd function whose backward reduce-scatters their
gradient: the sum over ranks of what each rank's queries sent back), put in global order (B, H, s, d), and the
local queries attend to them under the causal mask of global positions (query at position i sees keys at <= i):
an additive (s/cp, s) mask in the queries' dtype (causal_bias), made once per scope and handed to every layer's
attention. scaled_dot_product_attention saves its mask for the backward, and given a boolean one it converts it to
an additive one first (every backend: aten's convert_boolean_attn_mask), so a boolean mask per call would leave each
layer holding its own (s/cp, s) copy until its backward: 64 MiB a layer at s = 8192, cp 2, bf16, 2 GiB over
Llama-3-8B's 32 (measured by the dry run). What the model passes as its own mask must be causal: None,
is_causal=True, or a mask equal to the local causal mask (or to the block-causal mask Hugging Face builds when it
reads the jump in position_ids as two packed sequences); anything else (padding, sliding window) is refused. GQA
passes through (enable_gqa, or heads repeated by the model before the call).

Every cp rank must hand the gather tensors of one shape. A Hugging Face model (transformers 5) given position_ids
and no attention_mask reads the jump between a rank's two chunks as two packed sequences, builds a block-causal mask
and then repeats the key/value heads before the call (GQA), while the last rank, whose chunks are adjacent, gets
is_causal and enable_gqa with fewer heads: a collective of mismatched sizes. So a forward that names attention_mask
gets an all-ones one (no padding): every rank then takes the same path (mask None, is_causal, enable_gqa).

Loss. Each rank computes next-token cross-entropy on its own logits (B, s/cp, V) and targets:
    local loss = cp * sum(local token CE) / (targets in the whole sequences, B * (s - 1))
Summed over the cp ranks that is cp times the one-process mean; data parallel averages gradients over the
dp * cp ranks of mesh["dp_cp"], which divides that cp back out: gradients, and the loss the training loop logs (the
mean over all ranks), equal one process's on the same global batch. Only the default next-token loss can be split
so (model.model_file.next_token_loss); a model file's own loss_fn is refused (runtime.plan.check).

What a model needs (checked at run time; the planner may check it at trace time): a forward that names
position_ids (and uses them: a model that numbers its tokens 0..n-1 itself would see wrong positions), self-attention
through F.scaled_dot_product_attention (Hugging Face's default "sdpa"; "eager" attention is not reached), causal and
unpadded (no sliding window), the default next-token loss, token-id batches (a tensor, or a dict of input_ids only).
What a plan needs: seq_len a multiple of 2*cp, and seq_len / cp a multiple of tp under sequence parallel;
no offload, no compression, no delayed update (runtime.plan.check.context_parallel_problems).

Memory per rank: activations of s/cp tokens; every layer's attention saves its gathered keys and values for the
backward, (B, H_kv, s, d) each, of which (cp - 1)/cp came from the other ranks; and one (s/cp, s) mask in the compute
dtype, from the first layer's forward until the last layer's backward (planner.cost.memory prices both).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from zplan.errors import PlanMismatchError
from zplan.model.model_file import logits_of

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index: the last position has no next token
_SDPA = F.scaled_dot_product_attention  # torch's own, whatever ContextParallelAttention sets the attribute to


# ---- the batch split -----------------------------------------------------------------------------------


def chunk_positions(seq_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global positions of cp rank `cp_rank`'s tokens, (seq_len / cp_size,) int64: chunk r, then chunk 2cp-1-r."""
    if seq_len % (2 * cp_size):
        raise PlanMismatchError(f"context parallel over {cp_size} ranks cuts each sequence into {2 * cp_size} equal "
                                f"chunks: the sequence length {seq_len} must be a multiple of {2 * cp_size}")
    c = seq_len // (2 * cp_size)
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


@dataclass
class ContextParallelBatch:
    """One micro-batch as this cp rank runs it (module docstring)."""

    inputs: dict  # the forward's keywords: input_ids, position_ids (B, s/cp) each, attention_mask (ones) when taken
    targets: torch.Tensor  # (B, s/cp) int64, IGNORE_INDEX where no next token
    target_count: int  # targets in the whole sequences of the micro-batch (every cp rank's)
    positions: torch.Tensor  # (s/cp,) this rank's global positions
    cp_size: int
    group: dist.ProcessGroup | None  # the cp group

    def to(self, device: torch.device, non_blocking: bool = False) -> ContextParallelBatch:
        return ContextParallelBatch(
            inputs={k: v.to(device, non_blocking=non_blocking) for k, v in self.inputs.items()},
            targets=self.targets.to(device, non_blocking=non_blocking), target_count=self.target_count,
            positions=self.positions.to(device, non_blocking=non_blocking), cp_size=self.cp_size, group=self.group)

    def attention(self) -> ContextParallelAttention:
        """The scope (forward and backward, which recomputes under activation recompute) of the gathered attention."""
        return ContextParallelAttention(self.positions, self.cp_size, self.group)


def token_ids_of(batch) -> torch.Tensor:
    """The (B, s) token ids of a micro-batch: a tensor, or a dict whose only key is input_ids."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict) and set(batch) == {"input_ids"}:
        return batch["input_ids"]
    keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
    raise PlanMismatchError(f"context parallel splits batches of token ids (a tensor, or a dict with input_ids only); "
                            f"train_data yielded {keys}: a padding mask or other inputs cannot be split along the "
                            "sequence. Recompile with --cp 1")


def shard_batch(batch, cp_rank: int, cp_size: int, group: dist.ProcessGroup | None = None,
                attention_mask: bool = False, ids_name: str = "input_ids") -> ContextParallelBatch:
    """This cp rank's part of a micro-batch of whole sequences (B, s) (module docstring). `attention_mask`: pass the
    forward an all-ones (B, s/cp) attention_mask too (no padding), for Hugging Face models (module docstring);
    `ids_name`: the forward's argument for the token ids (its first: input_ids, a model file's idx)."""
    ids = token_ids_of(batch)  # (B, s)
    b, s = ids.shape
    positions = chunk_positions(s, cp_rank, cp_size).to(ids.device)  # (s/cp,)
    no_target = torch.full((b, 1), IGNORE_INDEX, dtype=ids.dtype, device=ids.device)
    targets = torch.cat([ids[:, 1:], no_target], dim=1)  # (B, s): the token after each position
    inputs = {ids_name: ids[:, positions], "position_ids": positions.expand(b, -1)}
    if attention_mask:
        inputs["attention_mask"] = torch.ones(b, positions.numel(), dtype=torch.long, device=ids.device)
    return ContextParallelBatch(
        inputs=inputs,
        targets=targets[:, positions], target_count=b * (s - 1), positions=positions, cp_size=cp_size, group=group)


class _ShardedBatches:
    """An iterator of ContextParallelBatch over one of whole-sequence micro-batches; its state is the inner one's."""

    def __init__(self, batches: Iterator, cp_rank: int, cp_size: int, group, attention_mask: bool, ids_name: str):
        self.batches, self.cp_rank, self.cp_size, self.group = batches, cp_rank, cp_size, group
        self.attention_mask, self.ids_name = attention_mask, ids_name
        if hasattr(batches, "state_dict") and hasattr(batches, "load_state_dict"):
            self.state_dict, self.load_state_dict = batches.state_dict, batches.load_state_dict

    def __iter__(self):
        return self

    def __next__(self) -> ContextParallelBatch:
        return shard_batch(next(self.batches), self.cp_rank, self.cp_size, self.group, self.attention_mask,
                           self.ids_name)


def shard_batches(batches: Iterator, cp_rank: int, cp_size: int, group: dist.ProcessGroup | None,
                  attention_mask: bool = False, ids_name: str = "input_ids") -> Iterator:
    """Each micro-batch of `batches` (whole sequences, the same on every cp rank of a dp rank) split for `cp_rank`
    (shard_batch)."""
    return _ShardedBatches(iter(batches), cp_rank, cp_size, group, attention_mask, ids_name)


# ---- the attention -------------------------------------------------------------------------------------


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim` over `group` (ranks' parts in rank order); backward: reduce-scatter (sum) of the
    gradient, each rank keeping its own part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        # reduce_scatter_tensor splits dim 0: move the sequence dim there, (world * n, ...) -> (n, ...)
        moved = grad.movedim(ctx.dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // world, *moved.shape[1:]))
        # gloo has it (torch 2.13), NCCL too; reduce_scatter_single is its newer name
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, moved, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """`x` of every rank of `group` concatenated along `dim` in rank order, differentiable (_GatherSequence)."""
    return _GatherSequence.apply(x, dim, group)


def _causal_local(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The masks a model may build for this rank's s/cp tokens alone: causal in local order, and causal within each
    run of consecutive positions (Hugging Face's packed-sequence reading of the chunks' jump), (s/cp, s/cp) bool."""
    n = positions.numel()
    causal = torch.ones(n, n, dtype=torch.bool, device=positions.device).tril()
    run = torch.cat([positions.new_zeros(1), (positions.diff() != 1).long()]).cumsum(0)  # (s/cp,) run index
    return causal, causal & (run[:, None] == run[None, :])


def _is_causal_mask(mask: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether the model's own mask (bool: True attends; float: 0 attends, large negative does not) is causal."""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return True  # the dry run's fake tensors have no values to compare
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    if allowed.shape[-2:] != (positions.numel(), positions.numel()):
        return False
    return any(bool((allowed == expected).all()) for expected in _causal_local(positions))


# elements: the memory-efficient kernel copies (pads) a mask whose row stride is not a multiple of 8 or 16 (aten's
# preprocess_mask, per torch version): a copy each layer would hold
MASK_ROW_ALIGNMENT = 16


def causal_bias(positions: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive causal mask of this rank's queries over the whole sequence, (s/cp, s) in `dtype`: 0 where the query
    at global position positions[i] sees the key at position j (j <= positions[i]), the dtype's lowest finite value
    elsewhere (finite, as Hugging Face's additive masks and aten's conversion for cuDNN are; no row is all masked: a
    query sees itself). Its rows are MASK_ROW_ALIGNMENT-aligned, so no backend copies it to pad them."""
    n = positions.numel()
    row = -(-seq_len // MASK_ROW_ALIGNMENT) * MASK_ROW_ALIGNMENT
    bias = torch.zeros(n, row, dtype=dtype, device=positions.device)[:, :seq_len]
    blocked = positions[:, None] < torch.arange(seq_len, device=positions.device)[None, :]  # (s/cp, s) bool
    return bias.masked_fill_(blocked, torch.finfo(dtype).min)


def context_parallel_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                               enable_gqa=False, *, positions: torch.Tensor, cp_size: int, gather,
                               bias=None) -> torch.Tensor:
    """F.scaled_dot_product_attention of the local queries (B, H, s/cp, d) over the keys and values of the whole
    sequence, causal by global position; returns (B, H, s/cp, d_v). `positions` (s/cp,): this rank's; `gather(x,
    dim)`: x of every cp rank concatenated along dim in rank order (gather_sequence over the cp group); `bias(query)`:
    the (s/cp, s) causal_bias in the query's dtype, the same tensor for every layer (ContextParallelAttention's);
    default: made for this call."""
    n = positions.numel()
    if query.shape[-2] != n or key.shape[-2] != n:
        raise PlanMismatchError(f"context parallel attention expects self-attention over this rank's {n} tokens; got "
                                f"queries of {query.shape[-2]} and keys of {key.shape[-2]} tokens (cross-attention "
                                "or a cache cannot be split): recompile with --cp 1")
    if attn_mask is None and not is_causal:
        raise PlanMismatchError("context parallel attention runs causal attention only; the model called "
                                "scaled_dot_product_attention without a mask and is_causal=False (bidirectional "
                                "attention): recompile with --cp 1")
    if attn_mask is not None and not _is_causal_mask(attn_mask, positions):
        raise PlanMismatchError("context parallel attention runs causal attention only; the model passed another "
                                "mask (padding or a sliding window) to scaled_dot_product_attention: recompile with "
                                "--cp 1")
    if key.shape == value.shape:  # one collective for both: (2, B, H_kv, s/cp, d) -> (2, B, H_kv, s, d)
        key, value = gather(torch.stack([key, value]), 3).unbind(0)
    else:
        key, value = gather(key, 2), gather(value, 2)
    gathered_positions = torch.cat([chunk_positions(n * cp_size, r, cp_size) for r in range(cp_size)])  # (s,)
    order = gathered_positions.argsort().to(key.device)  # gathered index of each global position
    key, value = key.index_select(2, order), value.index_select(2, order)  # global order (B, H_kv, s, d)
    mask = bias(query) if bias is not None else causal_bias(positions, order.numel(), query.dtype)  # (s/cp, s)
    return _SDPA(query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)


class ContextParallelAttention(TorchFunctionMode):
    """Scaled dot-product attention calls become context_parallel_attention while this is entered: around a
    micro-batch's forward and backward (runtime.training.loop).

    Two hooks, because activation recompute (torch.utils.checkpoint) runs the forward again inside the backward,
    where the autograd engine runs no torch function mode: as a TorchFunctionMode it takes every call in the forward
    (F.scaled_dot_product_attention however the model named it), and it sets torch.nn.functional's attribute to
    its own function for the recompute (the model looks it up as F.scaled_dot_product_attention, as Hugging Face
    does). A model that imported the function under its own name before the run is not reached by the second:
    its recompute then saves other tensors than its forward, which torch.utils.checkpoint refuses (CheckpointError),
    so it fails loudly, not silently."""

    def __init__(self, positions: torch.Tensor, cp_size: int, group):
        super().__init__()
        self.positions, self.cp_size, self.group = positions, cp_size, group
        self._biases: dict = {}  # (dtype, device) -> causal_bias, made at the first attention of the scope

    def _gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return gather_sequence(x, dim, self.group)

    def _bias(self, query: torch.Tensor) -> torch.Tensor:
        """This scope's causal_bias in the query's dtype: one tensor that every layer's attention saves (its forward
        and its recompute), not a copy each (module docstring)."""
        key = (query.dtype, query.device)
        if key not in self._biases:
            self._biases[key] = causal_bias(self.positions.to(query.device), self.positions.numel() * self.cp_size,
                                            query.dtype)
        return self._biases[key]

    def _attention(self, *args, **kwargs) -> torch.Tensor:
        return context_parallel_attention(*args, **kwargs, positions=self.positions, cp_size=self.cp_size,
                                          gather=self._gather, bias=self._bias)

    def _by_attribute(self, *args, **kwargs) -> torch.Tensor:
        """torch.nn.functional.scaled_dot_product_attention while entered: the mode's (forward), or, where no mode
        runs (a recompute inside the backward), context_parallel_attention itself."""
        if self in torch.overrides._get_current_function_mode_stack():
            return _SDPA(*args, **kwargs)  # reaches __torch_function__
        return self._attention(*args, **kwargs)

    def __enter__(self):
        F.scaled_dot_product_attention = self._by_attribute
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        F.scaled_dot_product_attention = _SDPA
        return super().__exit__(exc_type, exc_value, traceback)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)


# ---- the loss ------------------------------------------------------------------------------------------


def context_parallel_loss(outputs, batch: ContextParallelBatch) -> torch.Tensor:
    """This rank's share of the next-token loss, cp * sum(local CE) / targets in the whole sequences (module
    docstring): logits (B, s/cp, V) against the pre-shifted targets (B, s/cp)."""
    logits = logits_of(outputs)  # (B, s/cp, V)
    ce_sum = F.cross_entropy(logits.flatten(0, 1).float(), batch.targets.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="sum")
    return ce_sum * (batch.cp_size / batch.target_count)


def accepts_position_ids(forward) -> bool:
    """Whether a forward names a position_ids argument, which context parallel passes it: by name only, since a
    forward that takes **kwargs and numbers its tokens 0..n-1 itself would silently see the wrong positions."""
    return "position_ids" in inspect.signature(forward).parameters


def token_ids_name(forward) -> str:
    """The name of a forward's first argument, which the token ids are passed as (Hugging Face: input_ids)."""
    return next(name for name in inspect.signature(forward).parameters if name != "self")


def takes_attention_mask(forward) -> bool:
    """Whether a forward names an attention_mask argument (Hugging Face's convention: (B, s) ones where no padding)."""
    return "attention_mask" in inspect.signature(forward).parameters
