"""ZeRO stage 1: AdamW whose states are sharded over the data-parallel ranks (Rajbhandari et al., ZeRO,
SC'20, Sec. 5.1, P_os), for a model replicated over dp: under DDP, or, with tensor parallelism, under
FSDP2's replicate (runtime.tensor_parallel.replicate_over_data_parallel).

Every rank holds the whole model and, after DDP's all-reduce, the whole averaged gradient. Of each
parameter of shape (d0, ...) rank r owns the rows [r*c, min((r+1)*c, d0)) with c = ceil(d0 / N) (the
dim-0 chunks of torch.chunk, which FSDP2 and DTensor's Shard(0) use too; the last ranks' chunks may be
shorter or empty). It keeps Adam moments (fp32, as the parameters) for those rows only and steps them
with torch's fused AdamW kernel (the same kernel and arithmetic as torch.optim.AdamW(fused=True), so the
result equals one process); the updated rows then reach every rank's parameters: a large parameter's
rows are contiguous, so each rank broadcasts its own rows straight into the others' parameters (no
buffer, no copy); the small ones (biases, norms) share flat padded buckets of at most BUCKET_BYTES,
one all_gather_into_tensor each (fewer collectives), two in flight so that the copy-out of one overlaps the
transfer of the next.

No master copy: the runtime keeps the parameters in fp32 under ZeRO 0/1 (mixed precision is autocast
around the forward, or FSDP2's MixedPrecisionPolicy under tensor parallel), so the parameter rows are the
master weights and are updated in place.

Tensor parallel: a parameter is then a DTensor on the 2-D (dp, tp) mesh, (Replicate(), tp placement),
as FSDP2's replicate leaves it (colwise weights and biases Shard(0), rowwise weights Shard(1), the rest
Replicate; its gradient is laid out alike, already averaged over dp). Everything above applies to the
parameter's tp-local tensor (p.to_local(), p.grad.to_local()): rank r of the dp group of this tp rank
owns rows [r*c, min((r+1)*c, d0_local)) of it, and the rows travel within that dp group only.

State dict: optimizer.state[param] = {"step": fp32 scalar, "exp_avg", "exp_avg_sq": DTensor}, each moment a
DTensor of the parameter's global shape (DTensor.from_local with shape= and stride=, so uneven chunks
are described exactly):
  - plain parameter: Shard(0) on the dp mesh;
  - tensor-parallel parameter: on the parameter's (dp, tp) mesh, the tp placement the parameter's, and on
    dp Shard(0) when that is not Shard(0); when it is (tp splits dim 0 into tp blocks, then dp splits each
    block by rows), _StridedShard(0, split_factor=tp) on dp: the layout FSDP2 gives a Shard(0)
    tensor-parallel parameter (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _init_sharding_spec_tp).
torch.distributed.checkpoint therefore saves each rank's rows once and reshards them into any other
layout: plain tensors (ZeRO 0, another dp size), FSDP2's Shard(0) DTensors (ZeRO 2/3), tensor-parallel
shards, and back. get_state_dict / set_state_dict work on it as on torch.optim.AdamW, since it is a
torch.optim.Optimizer over the model's own parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.optim.adam import adam

BUCKET_BYTES = 25 * 1024**2  # gathered bytes per all-gather: DDP's bucket_cap_mb=25, as the planner assumes
# A parameter of at least this many bytes is sent in place: each rank broadcasts its rows (contiguous in the
# parameter) straight into the others' parameters, no buffer and no copy (measured on gloo, 2 ranks, 5.3M
# parameters: 2x less CPU than a flat all-gather and its copies). Smaller ones share padded flat buckets,
# one all-gather each (fewer collectives, small copies).
DIRECT_MIN_BYTES = 256 * 1024


@dataclass(frozen=True)
class _Rows:
    """The dim-0 chunk of one parameter that this rank owns."""

    start: int  # first row
    stop: int  # one past the last row (== start when this rank's chunk is empty)
    chunk_rows: int  # c = ceil(d0 / N): every rank's chunk padded to this for the all-gather
    row_numel: int  # elements per row: numel / d0

    @property
    def chunk_numel(self) -> int:  # padded elements per rank in the flat all-gather buffer
        return self.chunk_rows * self.row_numel


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (a view: in-place updates reach the DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def state_layout(p: torch.Tensor, dp_mesh: DeviceMesh) -> tuple[DeviceMesh, list[Placement]]:
    """Mesh and placements of the moments of `p` (module docstring): Shard(0) on `dp_mesh` for a plain
    parameter; for a DTensor parameter replicated over dp on its (dp, tp) mesh, the dp row split of its
    tp-local tensor followed by its tp placement."""
    if not isinstance(p, DTensor):
        return dp_mesh, [Shard(0)]
    mesh, placements = p.device_mesh, p.placements
    if mesh.ndim != 2 or not isinstance(placements[0], Replicate) or mesh.size(0) != dp_mesh.size():
        raise ValueError(f"ZeroOneAdamW takes tensor-parallel parameters replicated over dp on a (dp, tp) mesh "
                         f"(FSDP2's replicate); got placements {placements} on {mesh}")
    tp_placement = placements[1]
    if isinstance(tp_placement, Replicate) or (isinstance(tp_placement, Shard) and tp_placement.dim != 0):
        return mesh, [Shard(0), tp_placement]
    if type(tp_placement) is Shard and p.shape[0] % mesh.size(1) == 0:  # tp blocks first, then dp rows of each
        return mesh, [_StridedShard(0, split_factor=mesh.size(1)), tp_placement]
    raise ValueError(f"ZeroOneAdamW cannot describe the states of a parameter of shape {tuple(p.shape)} placed "
                     f"{tp_placement} over tp={mesh.size(1)}: dim 0 must split evenly into tensor-parallel blocks")


def owned_rows(d0: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, stop, c) of rank `rank`'s dim-0 chunk of `d0` rows, torch.chunk's split: c = ceil(d0/N)."""
    c = -(-d0 // world) if d0 else 0
    start = min(rank * c, d0)
    return start, min(start + c, d0), c


class ZeroOneAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW (decoupled weight decay, Loshchilov & Hutter 2019) with its states sharded over
    `dp_mesh` (module docstring). Hyper-parameters as torch.optim.AdamW; param groups as usual."""

    def __init__(self, params, dp_mesh: DeviceMesh, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, fused: bool = True,
                 bucket_bytes: int = BUCKET_BYTES, direct_min_bytes: int = DIRECT_MIN_BYTES):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.dp_mesh = dp_mesh
        self.fused = fused
        self._group = dp_mesh.get_group()
        self._rank, self._world = dp_mesh.get_local_rank(), dp_mesh.size()
        self._rows: dict[nn.Parameter, _Rows] = {}
        self._direct_min_bytes = direct_min_bytes
        self._global_ranks = [dist.get_global_rank(self._group, r) for r in range(self._world)]
        for group in self.param_groups:
            for p in group["params"]:
                local = _local(p)  # the tp-local tensor of a tensor-parallel parameter
                if local.dim() == 0 or local.numel() == 0 or not local.is_contiguous():
                    raise ValueError("ZeroOneAdamW shards non-empty, contiguous parameters of >= 1 dim by rows; "
                                     f"got local shape {tuple(local.shape)}, contiguous={local.is_contiguous()}")
                start, stop, c = owned_rows(local.shape[0], self._rank, self._world)
                self._rows[p] = _Rows(start, stop, c, local.numel() // local.shape[0])
                self.state[p] = self._fresh_state(p)
        self._buckets = self._make_buckets(bucket_bytes)

    # ---- states ------------------------------------------------------------------------------------

    def _fresh_state(self, p: torch.Tensor) -> dict:
        rows, local_param = self._rows[p], _local(p)
        local_shape = (rows.stop - rows.start, *local_param.shape[1:])
        mesh, placements = state_layout(p, self.dp_mesh)

        def moment() -> DTensor:  # (rows owned, *local.shape[1:]) of a DTensor of p's global shape
            local = torch.zeros(local_shape, dtype=p.dtype, device=p.device)  # as torch's AdamW: param dtype
            return DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())

        # the step is a float32 scalar on the parameter's device, as torch's fused AdamW keeps it
        return {"step": torch.zeros((), dtype=torch.float32, device=p.device), "exp_avg": moment(),
                "exp_avg_sq": moment()}

    def _make_buckets(self, bucket_bytes: int) -> list[list[torch.Tensor]]:
        """Parameters in order, cut into buckets of at most `bucket_bytes` gathered (N padded chunks) and
        of one dtype and device (one flat buffer each); a large parameter is a bucket of its own, broadcast
        in place (DIRECT_MIN_BYTES)."""
        buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for group in self.param_groups:
            for p in group["params"]:
                if self._broadcasts_in_place(p):
                    buckets.insert(len(buckets) - 1, [p])  # before the open padded bucket, which stays open
                    continue
                gathered = self._world * self._rows[p].chunk_numel * p.element_size()
                other_kind = buckets[-1] and (buckets[-1][0].dtype, buckets[-1][0].device) != (p.dtype, p.device)
                if buckets[-1] and (size + gathered > bucket_bytes or other_kind):
                    buckets.append([])
                    size = 0
                buckets[-1].append(p)
                size += gathered
        return [b for b in buckets if b]

    def _broadcasts_in_place(self, p: torch.Tensor) -> bool:
        return _local(p).numel() * p.element_size() >= self._direct_min_bytes

    # ---- the step ------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._adamw_on_owned_rows(group)
        if self._world > 1:
            self._all_gather_parameters()
        return loss

    def _adamw_on_owned_rows(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:  # as torch's AdamW: no gradient, no step (DDP makes this the same on every rank)
                continue
            rows, state = self._rows[p], self.state[p]
            if rows.stop == rows.start:  # this rank owns no row of p: only the step count advances
                state["step"] += 1
                continue
            # views of the (tp-local) tensors: the update lands in the parameter
            params.append(_local(p.detach())[rows.start:rows.stop])
            grads.append(_local(p.grad)[rows.start:rows.stop])
            exp_avgs.append(state["exp_avg"].to_local())
            exp_avg_sqs.append(state["exp_avg_sq"].to_local())
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None if self.fused else True,
             fused=self.fused or None, decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
             lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def _all_gather_parameters(self) -> None:
        """Every rank's updated rows into every rank's parameters: broadcasts in place for the large ones,
        one all-gather per padded bucket for the rest, at most two buckets in flight (the planner's
        2 x 25 MiB of communication buffers), so that the copy-out of one overlaps the next transfer."""
        in_flight: list[tuple[list[torch.Tensor], torch.Tensor, dist.Work]] = []
        broadcasts: list[dist.Work] = []  # no buffers: all may be in flight
        for bucket in self._buckets:
            if len(bucket) == 1 and self._broadcasts_in_place(bucket[0]):
                broadcasts.extend(self._broadcast_rows(bucket[0]))
                continue
            in_flight.append(self._start_padded(bucket))
            if len(in_flight) == 2:
                self._copy_out(*in_flight.pop(0))
        for pending in in_flight:
            self._copy_out(*pending)
        for work in broadcasts:
            work.wait()

    def _broadcast_rows(self, p: torch.Tensor) -> list[dist.Work]:
        """Rank r's rows [r*c, min((r+1)*c, d0)) of `p`, contiguous, broadcast from r into every rank's `p`."""
        works, local = [], _local(p.detach())
        for r in range(self._world):
            start, stop, _ = owned_rows(local.shape[0], r, self._world)
            if stop > start:
                works.append(dist.broadcast(local[start:stop], src=self._global_ranks[r], group=self._group,
                                            async_op=True))
        return works

    def _start_padded(self, bucket: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor, dist.Work]:
        """Copy this rank's chunks of `bucket` into a flat buffer and start its all-gather."""
        send = torch.empty(sum(self._rows[p].chunk_numel for p in bucket), dtype=bucket[0].dtype,
                           device=bucket[0].device)  # (S,): this rank's chunks, padded, back to back
        offset = 0
        for p in bucket:
            rows = self._rows[p]
            owned = (rows.stop - rows.start) * rows.row_numel
            send[offset:offset + owned].copy_(_local(p.detach())[rows.start:rows.stop].reshape(-1))
            offset += rows.chunk_numel
        recv = torch.empty(self._world * send.numel(), dtype=send.dtype, device=send.device)  # (N * S,)
        return bucket, recv, dist.all_gather_into_tensor(recv, send, group=self._group, async_op=True)

    def _copy_out(self, bucket: list[torch.Tensor], recv: torch.Tensor, work: dist.Work) -> None:
        work.wait()
        by_rank = recv.view(self._world, -1)  # (N, S): row r is rank r's chunks
        offset = 0
        for p in bucket:
            rows = self._rows[p]
            local = _local(p.detach())
            _copy_chunks_into(local.view(-1), by_rank[:, offset:offset + rows.chunk_numel], local.shape[0], rows)
            offset += rows.chunk_numel


def _copy_chunks_into(flat: torch.Tensor, chunks: torch.Tensor, d0: int, rows: _Rows) -> None:
    """flat (d0 * row_numel,) <- the first d0 rows of chunks (N, c * row_numel), without a temporary: the
    k = d0 // c full chunks in one strided copy, then the remainder rows of chunk k."""
    full = d0 // rows.chunk_rows
    flat[:full * rows.chunk_numel].view(full, rows.chunk_numel).copy_(chunks[:full])
    remainder = (d0 - full * rows.chunk_rows) * rows.row_numel
    if remainder:
        flat[full * rows.chunk_numel:].copy_(chunks[full, :remainder])
