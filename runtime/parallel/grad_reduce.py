"""Data-parallel gradient reduction for tensor-parallel models (ZeRO 0/1 at tp > 1): what DDP does for plain ones.

DistributedDataParallel cannot hold DTensor parameters. FSDP2's replicate can, but it keeps a second copy of every
parameter from the unit's forward to its backward (its all-gather output, though nothing is sharded) and further
copies of the gradients while it reduces them: with 16-bit parameters the dry run measured 2 bytes a parameter more
than the parameters and 3 copies of the gradients at the backward's peak (Llama-3-8B, tp 2, ZeRO-1). This does what
DDP does with gradient_as_bucket_view=True, on the DTensors' local tensors:
  - the gradients are views of flat buckets (one dtype and device each, at most BUCKET_BYTES, parameters in reverse
    order: the order the backward makes their gradients), made at construction, so that autograd accumulates each
    micro-batch's gradient into them in place (one copy, in the parameters' dtype);
  - in the last micro-batch's backward of a step (the num_micro_batches-th since the last wait), a bucket is averaged
    over dp (divided by dp, then all-reduced) as soon as its last gradient is in (a post-accumulate-grad hook per
    parameter counts them), so the reduction overlaps the rest of the backward;
  - wait() completes the reductions and starts the count again; the training loop calls it before the clipping
    (runtime.training.loop), and clears the gradients in place between steps.
It counts the backward passes instead of being told which is the last, so it works inside a pipeline stage too, where
the schedule runs the backward. Under expert parallel the routed experts' gradients (runtime.parallel.experts: each
rank's E / ep experts, which already hold the tokens of its ep group) are summed over the edp ranks that hold the same
experts and divided by dp, as the others: together the gradient of the mean loss over all dp ranks' tokens. Like DDP
without find_unused_parameters, it expects every parameter to get a gradient in every backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

BUCKET_BYTES = 25 * 1024**2  # DDP's bucket_cap_mb=25, as the planner assumes (planner.cost.memory.DDP_BUCKET_BYTES)
_ATTRIBUTE = "_zplan_gradient_reducer"


@dataclass
class _Bucket:
    flat: torch.Tensor  # (numel,): the gradients of `params`, back to back
    params: list[nn.Parameter] = field(default_factory=list)
    group: dist.ProcessGroup | None = None  # summed over it
    divisor: int = 1  # after dividing by this
    ready: int = 0  # gradients accumulated since the last wait, over all the step's micro-batches
    work: dist.Work | None = None


class GradientReducer:
    """The gradients of `module`'s parameters as bucket views, averaged over `group` after `num_micro_batches`
    backward passes (module docstring)."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, num_micro_batches: int,
                 bucket_bytes: int = BUCKET_BYTES, expert_params: list[nn.Parameter] = (),
                 expert_group: dist.ProcessGroup | None = None):
        if num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
        self.num_micro_batches = num_micro_batches
        world = dist.get_world_size(group)
        experts = {id(p) for p in expert_params}
        params = [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]  # tied ones once
        dense = [p for p in reversed(params) if id(p) not in experts]
        routed = [p for p in reversed(params) if id(p) in experts]
        self.buckets = [*_buckets(dense, bucket_bytes, group, world),
                        *_buckets(routed, bucket_bytes, expert_group, world)]
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(_counting_hook(self, bucket))
        setattr(module, _ATTRIBUTE, self)

    def _gradient_in(self, bucket: _Bucket) -> None:
        bucket.ready += 1
        if bucket.ready == len(bucket.params) * self.num_micro_batches and bucket.divisor > 1:
            bucket.flat.div_(bucket.divisor)  # gloo has no average: divide, then sum (DDP's order)
            if dist.get_world_size(bucket.group) > 1:
                bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)

    def zero_gradients(self) -> None:
        """Every gradient zeroed in place (they are views of the buckets)."""
        for bucket in self.buckets:
            bucket.flat.zero_()

    def wait(self) -> None:
        """The reductions of this step done; the next backward passes count anew. Every dp rank calls it."""
        for bucket in self.buckets:
            expected = len(bucket.params) * self.num_micro_batches
            if bucket.ready != expected:
                raise RuntimeError(f"a gradient bucket saw {bucket.ready} gradients in this step, expected {expected} "
                                   f"({len(bucket.params)} parameters x {self.num_micro_batches} micro-batches): a "
                                   "parameter got no gradient, or the step ran another number of micro-batches")
            if bucket.work is not None:
                bucket.work.wait()
            bucket.ready, bucket.work = 0, None


def _counting_hook(reducer: GradientReducer, bucket: _Bucket):
    """A parameter's post-accumulate-grad hook: reducer._gradient_in(bucket), holding both weakly. The hook lives in
    the parameter's C++ autograd state, where the garbage collector cannot see it: a strong reference to the bucket
    (which lists the parameter) would keep the parameters, their meshes and so their process groups alive for good once
    the model is dropped (runtime.launch.distributed.close_distributed counts them). The module holds the reducer."""
    reducer_ref, bucket_ref = weakref.ref(reducer), weakref.ref(bucket)

    def hook(_param: nn.Parameter) -> None:
        reducer_now, bucket_now = reducer_ref(), bucket_ref()
        if reducer_now is not None and bucket_now is not None:
            reducer_now._gradient_in(bucket_now)
    return hook


def _buckets(params: list[nn.Parameter], bucket_bytes: int, group: dist.ProcessGroup, divisor: int) -> list[_Bucket]:
    """Consecutive parameters of one dtype and device, at most `bucket_bytes` of gradients each (a larger parameter
    alone), each gradient made a view of its bucket's flat buffer, reduced over `group` after dividing by
    `divisor`."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = _local(p).numel() * p.element_size()
        same_kind = groups and (groups[-1][0].dtype, groups[-1][0].device) == (p.dtype, p.device)
        if not groups or not same_kind or size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    buckets = []
    for members in groups:
        local = [_local(p) for p in members]
        flat = torch.zeros(sum(t.numel() for t in local), dtype=members[0].dtype, device=local[0].device)
        offset = 0
        for p, t in zip(members, local, strict=True):
            view = flat[offset:offset + t.numel()].view(t.shape)
            offset += t.numel()
            p.grad = (DTensor.from_local(view, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                         stride=p.stride()) if isinstance(p, DTensor) else view)
        buckets.append(_Bucket(flat, members, group, divisor))
    return buckets


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def gradient_reducer(module: nn.Module) -> GradientReducer | None:
    """The reducer attached to `module` (GradientReducer), if any."""
    return getattr(module, _ATTRIBUTE, None)
