"""ZeRO stage 1: AdamW whose states are sharded over the data-parallel ranks (Rajbhandari et al., ZeRO,
SC'20, Sec. 5.1, P_os), for a model replicated under DDP.

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
around the forward), so the parameter rows are the master weights and are updated in place.

State dict: optimizer.state[param] = {"step": fp32 scalar, "exp_avg", "exp_avg_sq": DTensor}, each moment a
DTensor of the parameter's global shape, Shard(0) on the dp mesh (DTensor.from_local with shape= and
stride=, so uneven chunks are described exactly). torch.distributed.checkpoint therefore saves each
rank's rows once and reshards them into any other layout: plain tensors (ZeRO 0, another dp size) or
FSDP2's Shard(0) DTensors (ZeRO 2/3), and back. get_state_dict / set_state_dict work on it as on
torch.optim.AdamW, since it is a torch.optim.Optimizer over the model's own parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
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
                if isinstance(p, DTensor):
                    raise NotImplementedError("ZeroOneAdamW holds plain tensors; tensor-parallel DTensor "
                                              "parameters are not supported")
                if p.dim() == 0 or p.numel() == 0 or not p.is_contiguous():
                    raise ValueError("ZeroOneAdamW shards non-empty, contiguous parameters of >= 1 dim by rows; "
                                     f"got shape {tuple(p.shape)}, contiguous={p.is_contiguous()}")
                start, stop, c = owned_rows(p.shape[0], self._rank, self._world)
                self._rows[p] = _Rows(start, stop, c, p.numel() // p.shape[0])
                self.state[p] = self._fresh_state(p)
        self._buckets = self._make_buckets(bucket_bytes)

    # ---- states ------------------------------------------------------------------------------------

    def _fresh_state(self, p: torch.Tensor) -> dict:
        rows = self._rows[p]
        local_shape = (rows.stop - rows.start, *p.shape[1:])

        def moment() -> DTensor:  # (rows owned, *p.shape[1:]) of a (d0, *p.shape[1:]) DTensor
            local = torch.zeros(local_shape, dtype=p.dtype, device=p.device)  # as torch's AdamW: param dtype
            return DTensor.from_local(local, self.dp_mesh, [Shard(0)], run_check=False, shape=p.shape,
                                      stride=p.stride())

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
        return p.numel() * p.element_size() >= self._direct_min_bytes

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
            params.append(p.detach()[rows.start:rows.stop])  # views: the update lands in the parameter
            grads.append(p.grad[rows.start:rows.stop])
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
        works = []
        for r in range(self._world):
            start, stop, _ = owned_rows(p.shape[0], r, self._world)
            if stop > start:
                works.append(dist.broadcast(p.detach()[start:stop], src=self._global_ranks[r], group=self._group,
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
            send[offset:offset + owned].copy_(p.detach()[rows.start:rows.stop].reshape(-1))
            offset += rows.chunk_numel
        recv = torch.empty(self._world * send.numel(), dtype=send.dtype, device=send.device)  # (N * S,)
        return bucket, recv, dist.all_gather_into_tensor(recv, send, group=self._group, async_op=True)

    def _copy_out(self, bucket: list[torch.Tensor], recv: torch.Tensor, work: dist.Work) -> None:
        work.wait()
        by_rank = recv.view(self._world, -1)  # (N, S): row r is rank r's chunks
        offset = 0
        for p in bucket:
            rows = self._rows[p]
            _copy_chunks_into(p.detach().view(-1), by_rank[:, offset:offset + rows.chunk_numel], p.shape[0], rows)
            offset += rows.chunk_numel


def _copy_chunks_into(flat: torch.Tensor, chunks: torch.Tensor, d0: int, rows: _Rows) -> None:
    """flat (d0 * row_numel,) <- the first d0 rows of chunks (N, c * row_numel), without a temporary: the
    k = d0 // c full chunks in one strided copy, then the remainder rows of chunk k."""
    full = d0 // rows.chunk_rows
    flat[:full * rows.chunk_numel].view(full, rows.chunk_numel).copy_(chunks[:full])
    remainder = (d0 - full * rows.chunk_rows) * rows.row_numel
    if remainder:
        flat[full * rows.chunk_numel:].copy_(chunks[full, :remainder])
