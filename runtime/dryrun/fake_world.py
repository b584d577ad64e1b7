"""One rank of a world of any size in this process, on fake tensors: the dry run's stage (zplan.dryrun).

    with fake_world(rank=5, world_size=1024) as ctx:   # ctx: a RunContext on the CPU, backend "fake"
        mesh = plan_mesh(plan, "cpu")                    # outside the fake mode: a mesh is made of real ranks
        with fake_tensors():
            ... the runtime's own calls (build_meta_model, parallelize, plan_optimizer, optimizer_step)

The process group is torch's fake backend (torch.testing._internal.distributed.fake_pg.FakeStore): every
collective returns at once without touching its tensors, so a rank runs alone what it would run among
`world_size` peers. Tensors are FakeTensorMode's: shapes, dtypes and devices, no storage, so a shard of a 70B
model costs nothing. What this cannot show: values (a loss, a gradient norm are not computed), timings, and
kernels the fake mode does not run the way a GPU does (see zplan.dryrun on attention).

torch 2.13's DeviceMesh computes its coordinates with tensor ops (mesh == rank).nonzero(), which a fake tensor
cannot answer; DeviceMesh.__init__ runs outside the fake mode here (it is bookkeeping on a small real tensor of
ranks, FSDP2 builds such meshes inside fully_shard too). Exchanges that read values across ranks are answered by
this rank alone (_pipeline_vote_on_this_rank), and DDP, whose C++ reducer reads values, is FakeRankDDP, which
holds what the reducer holds. F.rms_norm takes the fused kernel a GPU takes (_rms_norm_as_on_gpu). These patches
live only inside fake_tensors (Hugging Face models see whole sequences on fake tensors as on real ones: the model
file's loader tells transformers so, model.model_file.hf_models_see_whole_sequences). After the build,
drop_cached_tensors empties FakeTensorMode's dispatch cache, whose keys hold the replay's full tensors.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import functional as F

from zplan.runtime.launch.distributed import RunContext, close_distributed

GPUS_PER_NODE_DEFAULT = 8


@contextlib.contextmanager
def _mesh_outside_fake_mode() -> Iterator[None]:
    original = DeviceMesh.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


class Mailbox:
    """Objects sent point to point by the fake ranks this process ran, for the ranks it runs later."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int], list] = collections.defaultdict(list)  # (source, destination) -> sent
        self.last: list | None = None  # the last objects sent by any rank

    def clear(self) -> None:
        self.queues.clear()
        self.last = None


MAILBOX = Mailbox()


@contextlib.contextmanager
def _objects_through_mailbox() -> Iterator[None]:
    """send_object_list / recv_object_list between fake ranks run one after the other in this process: a send is
    kept in MAILBOX and a later rank's receive takes it (the runtime's pipeline sends each stage's activation shapes
    to the next stage once: runtime/parallel/pipeline.py _activation_examples; the dry run runs the stages in order). A
    receive with nothing sent to it from its source yet (an interleaved schedule's wrap-around from the last rank
    to the first) takes the last objects sent by any rank: every boundary between blocks carries the same shapes."""
    original_send, original_recv = dist.send_object_list, dist.recv_object_list

    def send(objects, dst=None, group=None, device=None, group_dst=None, **_):  # torch's use_batch, ...
        target = dst if group_dst is None else dist.get_global_rank(group, group_dst)
        MAILBOX.queues[(dist.get_rank(), target)].append(list(objects))
        MAILBOX.last = list(objects)

    def recv(objects, src=None, group=None, device=None, group_src=None, **_):
        source = src if group_src is None else dist.get_global_rank(group, group_src)
        queue = MAILBOX.queues.get((source, dist.get_rank()))
        received = queue.pop(0) if queue else MAILBOX.last
        if received is None:
            raise RuntimeError(f"rank {dist.get_rank()} waits for objects from rank {source}, which no rank this dry "
                               "run ran before sent: dry-run the stages in order")
        objects[:] = received
        return source

    dist.send_object_list, dist.recv_object_list = send, recv
    try:
        yield
    finally:
        dist.send_object_list, dist.recv_object_list = original_send, original_recv


@contextlib.contextmanager
def _pipeline_vote_on_this_rank() -> Iterator[None]:
    """torch.distributed.pipelining's first step has every stage vote, over p2p, whether the stages' shapes are
    static, and reads the result back (.item()): a fake rank receives nothing. Here the vote is this rank's own
    stages' (each votes as InferenceMode.needs_dynamic says); the other stages are built by the same runtime code
    from the same plan (runtime/parallel/pipeline.py gives every stage its input and output shapes), so they vote
    alike."""
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    original = _PipelineSchedule._warmup_p2p

    def vote(self, stages, has_backward, p2p_done=False):
        dynamic = any(InferenceMode.needs_dynamic(stage._user_meta, has_backward) for stage in stages)
        for stage in stages:
            stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    _PipelineSchedule._warmup_p2p = vote
    try:
        yield
    finally:
        _PipelineSchedule._warmup_p2p = original


class _NoReducer:
    def prepare_for_backward(self, outputs) -> None:
        pass


def _weak_hook(ddp: FakeRankDDP):
    """ddp._into_bucket as a post-accumulate-grad hook holding `ddp` weakly: a parameter keeps its hooks in C++
    autograd state the garbage collector cannot see, so a bound method there would keep the wrapper, its module and
    their parameters alive after the run (runtime.parallel.grad_reduce holds its reducer so too)."""
    ref = weakref.ref(ddp)

    def hook(p: torch.Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner._into_bucket(p)

    return hook


class FakeRankDDP(nn.parallel.DistributedDataParallel):
    """DistributedDataParallel on a fake rank, without its C++ reducer (which reads and writes tensor data: its
    constructor exchanges parameter shapes, its bucket rebuild and all-reduce futures carry values). It holds
    what the reducer holds with gradient_as_bucket_view (runtime.parallel.data_parallel): flat buckets of every
    parameter's gradient, one per dtype, made at construction; a gradient that exists then becomes its view of the
    bucket, and one computed later outside no_sync is copied into that view and replaced by it (torch's reducer does the
    same in mark_variable_ready; under no_sync such a gradient accumulates in its own tensor). The all-reduce is in
    place on the buckets (NCCL's is too) and costs no memory; comm hooks (int8 gradient compression) are not run,
    so their copies of a bucket are not counted."""

    def __init__(self, module: nn.Module, process_group=None, device_ids=None, **_options) -> None:
        nn.Module.__init__(self)
        self.module = module
        self.process_group = process_group
        self.reducer = _NoReducer()  # torch.distributed.pipelining's stage calls it before a DDP stage's backward
        self._syncing = True
        params = [p for p in module.parameters() if p.requires_grad]
        self._bucket_views: dict[int, torch.Tensor] = {}
        for dtype in dict.fromkeys(p.dtype for p in params):
            same = [p for p in params if p.dtype == dtype]
            bucket = torch.empty(sum(p.numel() for p in same), dtype=dtype, device=same[0].device)
            for p, view in zip(same, bucket.split([q.numel() for q in same]), strict=True):
                self._bucket_views[id(p)] = view.view_as(p)
                if p.grad is not None:  # as the reducer's bucket views initialisation does
                    self._bucket_views[id(p)].copy_(p.grad)
                    p.grad = self._bucket_views[id(p)]
                p.register_post_accumulate_grad_hook(_weak_hook(self))

    def _into_bucket(self, p: torch.Tensor) -> None:
        view = self._bucket_views[id(p)]
        if self._syncing and p.grad is not view:
            view.copy_(p.grad)
            p.grad = view

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def register_comm_hook(self, state, hook) -> None:
        pass


@contextlib.contextmanager
def _ddp_on_a_fake_rank() -> Iterator[None]:
    """torch.nn.parallel.DistributedDataParallel is FakeRankDDP inside (runtime.parallel.data_parallel looks it up when
    it runs)."""
    original = nn.parallel.DistributedDataParallel
    nn.parallel.DistributedDataParallel = FakeRankDDP
    try:
        yield
    finally:
        nn.parallel.DistributedDataParallel = original


class _FusedRMSNorm(torch.autograd.Function):
    """rms_norm with what CUDA's fused kernel keeps for backward: the input, the weight and the per-row reciprocal
    RMS (aten._fused_rms_norm and its backward; on the CPU the op decomposes into fp32 ops that autograd records)."""

    @staticmethod
    def forward(ctx, input, normalized_shape, weight, eps):
        with torch.no_grad():
            out, rstd = torch.ops.aten._fused_rms_norm(input, list(normalized_shape), weight, eps)
        ctx.normalized_shape = list(normalized_shape)
        ctx.save_for_backward(input, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        input, weight, rstd = ctx.saved_tensors
        grad_input, grad_weight = torch.ops.aten._fused_rms_norm_backward(
            grad_out, input, ctx.normalized_shape, rstd, weight, [True, weight is not None])
        return grad_input, None, grad_weight, None


@contextlib.contextmanager
def _rms_norm_as_on_gpu() -> Iterator[None]:
    """F.rms_norm (nn.RMSNorm) as CUDA runs it (_FusedRMSNorm): torch's rms_norm takes a fused kernel on a GPU,
    which keeps the input and the per-row reciprocal RMS, and a composite of fp32 ops on the CPU, which keeps fp32
    copies of the input; the dry run runs on the CPU and holds what the GPU holds. An RMSNorm written out in the
    model file (Hugging Face's LlamaRMSNorm) runs as written, on the GPU too."""
    original = F.rms_norm

    def rms_norm(input, normalized_shape, weight=None, eps=None):
        return _FusedRMSNorm.apply(input, tuple(normalized_shape), weight, eps)

    F.rms_norm = rms_norm
    try:
        yield
    finally:
        F.rms_norm = original


@contextlib.contextmanager
def fake_world(rank: int, world_size: int, gpus_per_node: int = GPUS_PER_NODE_DEFAULT) -> Iterator[RunContext]:
    """Be rank `rank` of `world_size` (module docstring) until the block ends; the process group is closed after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a process group")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    ctx = RunContext(rank=rank, local_rank=rank % gpus_per_node, world_size=world_size,
                     device=torch.device("cpu"), backend="fake")
    try:
        yield ctx
    finally:
        close_distributed(clean=True)  # a barrier of the fake backend returns at once; DTensor's caches are emptied


@contextlib.contextmanager
def fake_tensors() -> Iterator[FakeTensorMode]:
    """Every tensor made inside is a fake one (module docstring); meshes made inside (FSDP2's) stay real."""
    with _mesh_outside_fake_mode(), _pipeline_vote_on_this_rank(), _ddp_on_a_fake_rank(), _objects_through_mailbox(), \
            _rms_norm_as_on_gpu(), \
            FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode
        FakeTensorMode.cache_clear()


def drop_cached_tensors() -> None:
    """Release what FakeTensorMode's dispatch cache holds: its keys keep the storages passed to aten.set_ (the
    initialisation's replay makes its views that way), which would keep every full tensor of the replay alive."""
    FakeTensorMode.cache_clear()
    gc.collect()
