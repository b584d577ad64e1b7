"""Which elements of each parameter a rank's AdamW updates, how its states are laid out, and how the updated
elements reach the other ranks: the layout part of runtime.optim.sharded_adamw.ShardedAdamW.

RowShards: ZeRO stage 1, the states sharded over the data-parallel ranks (Rajbhandari et al., ZeRO, SC'20,
Sec. 5.1, P_os), for a model replicated over dp: under DDP, or, with tensor parallelism, under zplan's reducer of
DTensor gradients (runtime.parallel.grad_reduce). WholeShards: the parameters are already this rank's shards
(FSDP2: ZeRO 2/3), or whole on every rank with every rank computing the same update (1-bit Adam under ZeRO 0):
the whole local tensor is updated, the states are laid out as it, and nothing is sent after the step.

What follows is RowShards.

Every rank holds the whole model and, after DDP's all-reduce, the whole averaged gradient. Of each
parameter of shape (d0, ...) rank r owns the rows [r*c, min((r+1)*c, d0)) with c = ceil(d0 / N) (the
dim-0 chunks of torch.chunk, which FSDP2 and DTensor's Shard(0) use too; the last ranks' chunks may be
shorter or empty). The optimizer keeps Adam moments (fp32) for those rows only and steps them (with the
device states, runtime.optim.device_states: torch's fused AdamW kernel, the same kernel and arithmetic as
torch.optim.AdamW(fused=True), so the result equals one process); the updated rows then reach every rank's
parameters: a large parameter's
rows are contiguous, so each rank broadcasts its own rows straight into the others' parameters (no
buffer, no copy); the small ones (biases, norms) share flat padded buckets of at most BUCKET_BYTES,
one all_gather_into_tensor each (fewer collectives), two in flight so that the copy-out of one overlaps the
transfer of the next.

Master weights (Rajbhandari et al., Sec. 3.1: mixed-precision Adam): with mixed precision the runtime holds the
parameters in the 16-bit compute dtype under ZeRO 0/1 (runtime.precision.mixed.cast_parameters), so their gradients are
16-bit too, and the optimizer keeps an fp32 master copy of its rows beside the fp32 moments (state "master", laid
out as the moments): 2 + 2 bytes per parameter on every rank, 12 of the shard, the paper's 4 + 12/N. A step
upcasts the owned gradient rows (divided by `grad_divisor`, the loss scale times the clipping factor, which the
training loop sets instead of unscaling the 16-bit gradients in place), steps the master rows with the fused
AdamW kernel, and writes them rounded into the parameter rows, which are then gathered as 16-bit values (half the
bytes of fp32). In fp32 the parameter rows are the master weights and are updated in place.
shard_states=False (ZeRO 0 with mixed precision): every rank owns every row, the states are replicated and nothing
is gathered.

Tensor parallel: a parameter is then a DTensor on the tp mesh (colwise weights and biases Shard(0), rowwise
weights Shard(1), the rest Replicate; its gradient is laid out alike, already averaged over dp), replicated over
dp. Everything above applies to the parameter's tp-local tensor (p.to_local(), p.grad.to_local()): rank r of the
dp group of this tp rank owns rows [r*c, min((r+1)*c, d0_local)) of it, and the rows travel within that dp group
only.

State dict: optimizer.state[param] = {"step": fp32 scalar, "exp_avg", "exp_avg_sq": DTensor}, each moment a
DTensor of the parameter's global shape (DTensor.from_local with shape= and stride=, so uneven chunks
are described exactly):
  - plain parameter: Shard(0) on the dp mesh;
  - tensor-parallel parameter: on the (dp, tp) mesh (the tp mesh's parent sliced), the tp placement the
    parameter's, and on dp Shard(0) when that is not Shard(0); when it is (tp splits dim 0 into tp blocks, then
    dp splits each block by rows, torch.chunk's split at both, uneven blocks too), _StridedShard(0, split_factor=tp)
    on dp: the layout FSDP2 gives a Shard(0) tensor-parallel parameter (torch/distributed/fsdp/_fully_shard/
    _fsdp_param.py, _init_sharding_spec_tp).
torch.distributed.checkpoint therefore saves each rank's rows once and reshards them into any other
layout: plain tensors (ZeRO 0, another dp size), FSDP2's Shard(0) DTensors (ZeRO 2/3), tensor-parallel
shards, and back. get_state_dict / set_state_dict work on it as on torch.optim.AdamW, since ShardedAdamW is a
torch.optim.Optimizer over the model's own parameters. The masters are not in state_dict(): they are the
model's weights, and runtime.checkpoint.save saves them as such (master_weights), so that a checkpoint holds fp32
weights whatever the stage that wrote it. ShardedAdamW.load_state_dict copies the loaded states into the optimizer's own
(fp32 moments of its rows): torch's would cast them to the parameter's 16-bit dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from zplan.runtime.parallel.mesh import DATA_PARALLEL_CP

# fp32 gradient rows upcast at a time in a 16-bit step (one fused AdamW call each): the step's temporary bytes.
STEP_CHUNK_BYTES = 64 * 1024**2
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


def host_dtensor_on(local: torch.Tensor, mesh: DeviceMesh, placements, p: torch.Tensor) -> DTensor:
    """A DTensor of p's global shape on `mesh` with `placements` whose local tensor is `local`, kept where it is:
    on the mesh's device, or on the host even on a CUDA mesh (DTensor.from_local would move it to the mesh's
    device; FSDP2's CPUOffloadPolicy holds host shards alike)."""
    if mesh.device_type == "cpu" or local.device.type != "cpu":
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(p.shape, p.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (a view: in-place updates reach the DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def state_layout(p: torch.Tensor, dp_mesh: DeviceMesh, sharded: bool = True
                 ) -> tuple[DeviceMesh, list[Placement]]:
    """Mesh and placements of the moments of `p` (module docstring): Shard(0) on `dp_mesh` for a plain
    parameter; for a DTensor parameter on the tp mesh, on the (dp, tp) mesh the dp row split of its tp-local tensor
    followed by its tp placement. sharded=False (ZeRO 0): Replicate on dp instead; an expert-parallel parameter
    (Shard(0) over the "ep" dim, runtime.parallel.expert_dispatch) keeps its own layout."""
    if not isinstance(p, DTensor):
        return dp_mesh, [Shard(0) if sharded else Replicate()]
    if not sharded and is_expert_parallel(p):  # ZeRO 0's experts: each rank's own, as the weights
        return p.device_mesh, list(p.placements)
    if p.device_mesh.ndim != 1:
        raise ValueError(f"RowShards takes tensor-parallel parameters on a 1-D tp mesh, replicated over dp "
                         f"(runtime.parallel.grad_reduce); got placements {p.placements} on {p.device_mesh}")
    mesh, tp_placement = dp_and_tp_mesh(dp_mesh, p.device_mesh), p.placements[0]
    if not sharded:
        return mesh, [Replicate(), tp_placement]
    if isinstance(tp_placement, Replicate) or (isinstance(tp_placement, Shard) and tp_placement.dim != 0):
        return mesh, [Shard(0), tp_placement]
    if type(tp_placement) is Shard:  # tp blocks first, then dp rows of each; torch.chunk's sizes at both, uneven
        # ones included (a vocabulary tp does not divide: torch 2.13's _StridedShard places them so)
        return mesh, [_StridedShard(0, split_factor=mesh.size(1)), tp_placement]
    raise ValueError(f"RowShards cannot describe the states of a parameter of shape {tuple(p.shape)} placed "
                     f"{tp_placement} over tp={mesh.size(1)}")


def dp_and_tp_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The 2-D (dp, tp) mesh of two 1-D slices of one named mesh (runtime.parallel.mesh.build_mesh's); `dp_mesh` may be
    the flattened (dp, cp) dim under context parallel (runtime.parallel.mesh.data_parallel_mesh), which torch no longer
    slices from the root together with another dim: the two are concatenated instead."""
    if dp_mesh.mesh_dim_names[0] == DATA_PARALLEL_CP:
        return DeviceMesh._concatenate([dp_mesh, tp_mesh])
    root = dp_mesh._get_root_mesh()
    return root[(dp_mesh.mesh_dim_names[0], tp_mesh.mesh_dim_names[0])]


def is_16bit(t: torch.Tensor) -> bool:
    """A parameter in a 16-bit compute dtype: its optimizer keeps an fp32 master of it."""
    return t.dtype in (torch.bfloat16, torch.float16)


def with_master_weights(state: dict[str, Any], optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    """`state` (a model state dict) with each 16-bit parameter's entry replaced by its fp32 master (ShardedAdamW.
    master_weights, a DTensor of the parameter's shape, each rank's rows), so that a checkpoint or a weights file
    holds fp32 weights whatever the stage that wrote it; and {key: the replaced entry}. Matched by storage: tied
    names share one master."""
    masters = optimizer.master_weights() if hasattr(optimizer, "master_weights") else {}  # None: no optimizer
    if not masters:
        return state, {}
    state, replaced = dict(state), {}
    for key, value in state.items():
        master = masters.get(_local(value).data_ptr()) if isinstance(value, torch.Tensor) else None
        if master is not None:
            replaced[key], state[key] = value, master
    return state, replaced


def owned_rows(d0: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, stop, c) of rank `rank`'s dim-0 chunk of `d0` rows, torch.chunk's split: c = ceil(d0/N)."""
    c = -(-d0 // world) if d0 else 0
    start = min(rank * c, d0)
    return start, min(start + c, d0), c


class RowShards:
    """ZeRO 0/1's layout (module docstring): this rank's dim-0 rows of every parameter (of its tp-local tensor), the
    states as DTensors of the parameter's global shape (state_layout), the updated rows sent to every dp rank after
    the step (publish). shard_states=False (ZeRO 0 with mixed precision): every rank owns every row, the states
    are replicated and nothing is sent. bucket_bytes, direct_min_bytes: how the rows travel (BUCKET_BYTES,
    DIRECT_MIN_BYTES)."""

    keeps_rows_of_replicas = True  # a 16-bit parameter's fp32 master rows may live beside it

    def __init__(self, dp_mesh: DeviceMesh, *, shard_states: bool = True, bucket_bytes: int = BUCKET_BYTES,
                 direct_min_bytes: int = DIRECT_MIN_BYTES):
        self.dp_mesh = dp_mesh
        self.shard_states = shard_states
        self._bucket_bytes = bucket_bytes
        self._direct_min_bytes = direct_min_bytes
        self._group = dp_mesh.get_group()
        self._rank, self._world = (dp_mesh.get_local_rank(), dp_mesh.size()) if shard_states else (0, 1)
        self._global_ranks = [dist.get_global_rank(self._group, r) for r in range(self._world)]
        self.rows: dict[torch.Tensor, _Rows] = {}
        self.buckets: list[list[torch.Tensor]] = []

    @property
    def _rows(self) -> dict[torch.Tensor, _Rows]:  # the name the gathering code below reads
        return self.rows

    @property
    def _buckets(self) -> list[list[torch.Tensor]]:
        return self.buckets

    def bind(self, params: list[torch.Tensor]) -> None:
        """Split every parameter (in param-group order) into rows and cut the send buckets."""
        for p in params:
            local = _local(p)  # the tp-local tensor of a tensor-parallel parameter
            if local.dim() == 0 or local.numel() == 0 or not local.is_contiguous():
                raise ValueError("RowShards shards non-empty, contiguous parameters of >= 1 dim by rows; "
                                 f"got local shape {tuple(local.shape)}, contiguous={local.is_contiguous()}")
            start, stop, c = owned_rows(local.shape[0], self._rank, self._world)
            self.rows[p] = _Rows(start, stop, c, local.numel() // local.shape[0])
        self.buckets = self._make_buckets(params, self._bucket_bytes)

    def owned(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's rows of p (a view of its tp-local tensor: writes land in the parameter), (rows, ...)."""
        rows = self.rows[p]
        return _local(p.detach())[rows.start:rows.stop]

    def grad(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's rows of p's gradient (a view)."""
        rows = self.rows[p]
        return _local(p.grad)[rows.start:rows.stop]

    def is_empty(self, p: torch.Tensor) -> bool:  # this rank owns no row of p
        return self.rows[p].stop == self.rows[p].start

    def as_state(self, local: torch.Tensor, p: torch.Tensor) -> DTensor:
        """This rank's rows `local` (device or host) as a DTensor of p's global shape, laid out as the moments."""
        mesh, placements = state_layout(p, self.dp_mesh, self.shard_states)
        return host_dtensor_on(local, mesh, placements, p)

    def rows_of(self, local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a loaded plain tensor of p's whole local shape; anything else as it is."""
        rows = self.rows[p]
        return local[rows.start:rows.stop] if local.shape == _local(p).shape else local

    def publish(self) -> None:
        """The updated rows to every dp rank (collective over dp); nothing with one rank."""
        if self._world > 1:
            self._all_gather_parameters()

    def _make_buckets(self, params: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
        """Parameters in order, cut into buckets of at most `bucket_bytes` gathered (N padded chunks) and
        of one dtype and device (one flat buffer each); a large parameter is a bucket of its own, broadcast
        in place (DIRECT_MIN_BYTES)."""
        buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for p in params:
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




class ExpertRowShards:
    """ZeRO 1 under expert parallel: RowShards over dp for every parameter but the routed experts', whose rows are
    sharded over the edp ranks that hold the same experts (an expert-parallel parameter is a Shard(0) DTensor over
    the "ep" dim: runtime.parallel.expert_dispatch), as the planner prices them (states over dp / ep)."""

    keeps_rows_of_replicas = True

    def __init__(self, dp_mesh: DeviceMesh, expert_dp_mesh: DeviceMesh):
        self.dense, self.experts = RowShards(dp_mesh), RowShards(expert_dp_mesh)

    def _of(self, p: torch.Tensor) -> RowShards:
        return self.experts if is_expert_parallel(p) else self.dense

    def bind(self, params: list[torch.Tensor]) -> None:
        self.dense.bind([p for p in params if not is_expert_parallel(p)])
        self.experts.bind([p for p in params if is_expert_parallel(p)])

    def owned(self, p: torch.Tensor) -> torch.Tensor:
        return self._of(p).owned(p)

    def grad(self, p: torch.Tensor) -> torch.Tensor:
        return self._of(p).grad(p)

    def is_empty(self, p: torch.Tensor) -> bool:
        return self._of(p).is_empty(p)

    def as_state(self, local: torch.Tensor, p: torch.Tensor) -> DTensor:
        return self._of(p).as_state(local, p)

    def rows_of(self, local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return self._of(p).rows_of(local, p)

    def publish(self) -> None:
        self.dense.publish()
        self.experts.publish()


def is_expert_parallel(p: torch.Tensor) -> bool:
    """A routed experts' parameter split over the expert-parallel ranks (a DTensor on the mesh's "ep" dim)."""
    return isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("ep",)


class WholeShards:
    """The layout of parameters that are already this rank's shards (FSDP2's DTensors under ZeRO 2/3), or whole
    plain tensors every rank updates alike (1-bit Adam under ZeRO 0): the whole local tensor is updated, a state
    is laid out as its parameter (its mesh and placements, the local tensor on the host or the device), and
    nothing is sent after the step (FSDP2 gathers the updated shards at the next forward)."""

    keeps_rows_of_replicas = False

    def bind(self, params: list[torch.Tensor]) -> None:
        for p in params:
            if not _local(p).is_contiguous():
                raise ValueError(f"WholeShards steps contiguous parameters, got {p.dtype} {tuple(_local(p).shape)}")

    def owned(self, p: torch.Tensor) -> torch.Tensor:
        return _local(p.detach())

    def grad(self, p: torch.Tensor) -> torch.Tensor:
        return _local(p.grad)

    def is_empty(self, p: torch.Tensor) -> bool:  # this rank holds no element of p
        return _local(p).numel() == 0

    def as_state(self, local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return host_dtensor_on(local, p.device_mesh, p.placements, p) if isinstance(p, DTensor) else local

    def rows_of(self, local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return local

    def publish(self) -> None:
        pass


def _copy_chunks_into(flat: torch.Tensor, chunks: torch.Tensor, d0: int, rows: _Rows) -> None:
    """flat (d0 * row_numel,) <- the first d0 rows of chunks (N, c * row_numel), without a temporary: the
    k = d0 // c full chunks in one strided copy, then the remainder rows of chunk k."""
    full = d0 // rows.chunk_rows
    flat[:full * rows.chunk_numel].view(full, rows.chunk_numel).copy_(chunks[:full])
    remainder = (d0 - full * rows.chunk_rows) * rows.row_numel
    if remainder:
        flat[full * rows.chunk_numel:].copy_(chunks[full, :remainder])
