"""Expert parallelism (GShard, Lepikhin et al. 2020; as Megatron-Core and torchtitan run it): ep ranks that see
different tokens (carved out of the data-parallel ranks) each hold E/ep experts and exchange the routed tokens.

    shard_experts(module, names, ep_mesh)           # stacked parameters -> Shard(0) DTensors: rank r holds experts
                                                    # [r*E/ep, (r+1)*E/ep), the rows of the single-process weights
    exchange_and_run(routed, counts, ep_mesh, run)  # in an experts forward (runtime.parallel.experts)

The exchange, dropless: a rank's T*k routed copies, grouped by expert, are grouped by destination rank too (experts
are contiguous per rank). The ranks swap their counts per expert (one all_to_all_single of an (ep, E/ep) int
tensor, read on the host), then the copies (all_to_all_single with those split sizes; its backward is the reverse
exchange). What a rank receives comes by source rank, then by local expert: it is regrouped by local expert, run,
put back, and sent back the same way (the combine). The router runs on every rank on its own tokens; only the
experts' parameters are sharded.

On meta and fake tensors (the dry run) nothing is exchanged: every rank is taken to route as this one, with balanced
counts, so each receives and sends back T*k rows, E/ep experts' worth.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from zplan.errors import PlanMismatchError
from zplan.runtime.precision.float8 import on_fake_tensors


def values_unreadable(tensor: torch.Tensor) -> bool:
    """True on meta tensors and fake ones (the dry run), whose values cannot be read."""
    return tensor.device.type == "meta" or isinstance(tensor, FakeTensor) or on_fake_tensors()


def balanced_counts(copies: int, experts: int) -> list[int]:
    """`copies` routed copies spread evenly over `experts`, the remainder one each on the first experts."""
    return [copies // experts + (e < copies % experts) for e in range(experts)]


def shard_experts(module: nn.Module, names: list[str], ep_mesh: DeviceMesh) -> None:
    """Make `module`'s parameters `names` (E leading) Shard(0) DTensors over the 1-d `ep_mesh`, without
    communication (on meta before materialize_weights fills each rank's rows, or slicing equal real copies).
    PlanMismatchError when ep does not divide E."""
    ep = ep_mesh.size()
    for name in names:
        param = module._parameters[name]
        if isinstance(param, DTensor):
            raise PlanMismatchError(f"{type(module).__name__}.{name} is already a DTensor ({param.placements}): "
                                    "shard the experts over ep before any other parallel step")
        if param.shape[0] % ep:
            raise PlanMismatchError(f"{type(module).__name__}.{name} holds {param.shape[0]} experts, which do not "
                                    f"divide over ep={ep} ranks: choose an ep that divides {param.shape[0]}")
        sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
        module._parameters[name] = nn.Parameter(sharded, requires_grad=param.requires_grad)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """(sum(in_splits), ...) -> (sum(out_splits), ...): rows in_splits[r] to rank r, out_splits[r] from it."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    if not values_unreadable(x):
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _Exchange(torch.autograd.Function):
    """_all_to_all, whose backward sends the gradients back the reverse way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def exchange_counts(counts: torch.Tensor | list[int], ep_mesh: DeviceMesh) -> tuple[list[list[int]], list[list[int]]]:
    """(sent, received): sent[r][e] copies this rank sends to rank r's local expert e, received[s][e] copies rank s
    sends to this rank's local expert e. `counts` (E,): copies per expert on this rank; a list where values cannot
    be read (every rank then routes as this one)."""
    ep = ep_mesh.size()
    if isinstance(counts, list):
        local = len(counts) // ep
        rows = [counts[r * local:(r + 1) * local] for r in range(ep)]
        return rows, [rows[ep_mesh.get_local_rank()]] * ep
    sent = counts.view(ep, -1)  # (ep, E/ep)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent.contiguous(), group=ep_mesh.get_group())
    return sent.tolist(), received.tolist()


def exchange_and_run(routed: torch.Tensor, counts: torch.Tensor | list[int], ep_mesh: DeviceMesh,
                     run: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> torch.Tensor:
    """This rank's routed copies `routed` (N, h), grouped by expert with counts[e] (E,) for expert e, through the
    experts of every rank: sent to the rank holding their expert, run there by `run(rows grouped by local expert,
    rows per local expert)`, sent back. Returns (N, h) in `routed`'s order."""
    ep, group = ep_mesh.size(), ep_mesh.get_group()
    if len(counts) % ep:
        raise PlanMismatchError(f"{len(counts)} experts do not divide over ep={ep} ranks")
    sent, received = exchange_counts(counts, ep_mesh)
    local = len(sent[0])  # E/ep
    send_splits, receive_splits = [sum(row) for row in sent], [sum(row) for row in received]
    arrived = _Exchange.apply(routed, receive_splits, send_splits, group)  # (R, h): by source rank, local expert
    device = routed.device
    block_expert = torch.arange(local, device=device).repeat(ep)  # (ep*E/ep,) local expert of block (s, e)
    block_rows = torch.tensor([n for row in received for n in row], device=device)  # (ep*E/ep,)
    expert_of_row = block_expert.repeat_interleave(block_rows, output_size=arrived.shape[0])  # (R,)
    by_expert = expert_of_row.argsort(stable=True)  # (R,) arrived rows grouped by local expert
    out = run(arrived[by_expert], [sum(row[e] for row in received) for e in range(local)])  # (R, h)
    back = torch.empty_like(out).index_copy(0, by_expert, out)  # by source rank again
    return _Exchange.apply(back, send_splits, receive_splits, group)  # (N, h)
