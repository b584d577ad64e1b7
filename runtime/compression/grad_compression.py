"""Compressed gradient reduction on the data-parallel path (ZeRO 0/1: DDP's buckets), and 1-bit Adam.

Compressed all-reduce, two phases (the shape of ZeRO++'s qgZ, Wang et al. 2023, and of 1-bit Adam's
compressed all-reduce, Tang et al. 2021, sec. 4): the flat tensor (N,) is padded to W equal chunks; every rank
  1. compresses its W chunks and sends chunk r to rank r (all-to-all);
  2. decompresses the W copies of its chunk it received, averages them, compresses the average and
     all-gathers it; everyone decompresses the W averaged chunks.
Per rank that sends 2 (W-1)/W x compressed(N) bytes, as a ring all-reduce sends 2 (W-1)/W x 4 N (fp32).

  int8  per-block absmax scales (block of 256: 1 + 4/256 bytes an element, 3.94x fewer than fp32).
  1bit  signs packed 8 to a byte and one fp32 scale (mean |x|) per block of 256, with error feedback on both
        compressions (the worker's and the "server's", 1-bit Adam sec. 3.2): what a compression lost is
        added to the next tensor compressed at that place; 28x fewer bytes. (1-bit Adam has one scale per
        worker's tensor; on the tiny GPT, whose embedding, norms and projections differ in magnitude, one
        scale per chunk ended 34 % above the fp32 loss, one per 256 elements within 3 %.)

int8 is a DDP communication hook (`int8_hook`): gradients are averaged approximately, the optimizer is
unchanged, so it works under ZeRO 0 and ZeRO 1 (runtime.optim.layouts reads DDP's averaged gradients). 1-bit is not
a gradient hook: signs of gradients fed to Adam do not converge (1-bit Adam sec. 3.1, the variance term is not
linear); `OneBitGradients` (a part of runtime.optim.sharded_adamw.ShardedAdamW) runs exact AdamW for
`warmup_steps` steps, then freezes Adam's variance and all-reduces the momentum through the 1-bit compressed
all-reduce (DDP's hook then sends nothing). Every rank then holds the whole momentum: under ZeRO 0 its state, under
ZeRO 1 (states in rows) a full copy gathered when the warm-up ends.

Bytes on the wire are counted at the collective calls (`WireBytes`) with the per-rank formulas of the ring
and direct algorithms: all-reduce 2 (W-1)/W x size, all-to-all (W-1)/W x size, all-gather (W-1) x size of the
contribution.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zplan.cuda.comm_quant import dequantize_int8_blocks, pack_signs, quantize_int8_blocks, unpack_signs

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
INT8_BLOCK = 256  # elements per int8 scale
ONE_BIT_BLOCK = 256  # elements per 1-bit scale: 1/8 + 4/256 bytes an element, 28x fewer than fp32


@dataclass
class WireBytes:
    """Bytes this rank sent, by collective (module docstring)."""

    sent: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, nbytes: float) -> None:
        self.sent[kind] = self.sent.get(kind, 0.0) + nbytes

    @property
    def total(self) -> float:
        return sum(self.sent.values())


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _all_to_all(tensors: list[torch.Tensor], group, wire: WireBytes) -> list[torch.Tensor]:
    world = dist.get_world_size(group)
    out = [torch.empty_like(t) for t in tensors]
    for received, sent in zip(out, tensors, strict=True):
        dist.all_to_all_single(received, sent, group=group)
    wire.add("all_to_all", (world - 1) / world * _nbytes(*tensors))
    return out


def _all_gather(tensors: list[torch.Tensor], group, wire: WireBytes) -> list[torch.Tensor]:
    world = dist.get_world_size(group)
    out = [torch.empty(world * t.numel(), dtype=t.dtype) for t in tensors]
    for gathered, mine in zip(out, tensors, strict=True):
        _all_gather_single(gathered, mine, group=group)
    wire.add("all_gather", (world - 1) * _nbytes(*tensors))
    return out


def _padded(flat: torch.Tensor, world: int, multiple: int) -> tuple[torch.Tensor, int]:
    """flat (N,) zero-padded to world chunks of a multiple of `multiple` elements; (padded, chunk)."""
    chunk = -(-flat.numel() // (world * multiple)) * multiple
    padded = torch.zeros(world * chunk, dtype=torch.float32)
    padded[:flat.numel()] = flat
    return padded, chunk


def all_reduce_mean(flat: torch.Tensor, group, wire: WireBytes) -> torch.Tensor:
    """The uncompressed baseline: fp32 all-reduce, averaged."""
    world = dist.get_world_size(group)
    out = flat.float().clone()
    dist.all_reduce(out, group=group)
    wire.add("all_reduce", 2 * (world - 1) / world * _nbytes(out))
    return out / world


def int8_all_reduce_mean(flat: torch.Tensor, group, wire: WireBytes, block: int = INT8_BLOCK) -> torch.Tensor:
    """The mean over ranks of flat (N,), through int8 with per-block scales (module docstring)."""
    world = dist.get_world_size(group)
    padded, chunk = _padded(flat, world, block)
    q, scales = _all_to_all(list(quantize_int8_blocks(padded, block)), group, wire)
    mine = dequantize_int8_blocks(q, scales).view(world, chunk).mean(dim=0)  # (chunk,): my chunk's mean
    q, scales = _all_gather(list(quantize_int8_blocks(mine, block)), group, wire)
    return dequantize_int8_blocks(q, scales)[:flat.numel()].to(flat.dtype)


@dataclass
class OneBitErrors:
    """Error feedback of one tensor's 1-bit all-reduce: the worker's (W x chunk,) and the server's (chunk,)."""

    worker: torch.Tensor | None = None
    server: torch.Tensor | None = None


def _one_bit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (n,), n a multiple of ONE_BIT_BLOCK -> (packed signs (n/8,) uint8, scales (n/ONE_BIT_BLOCK,), what was
    lost: x - decoded)."""
    blocks = x.view(-1, ONE_BIT_BLOCK)
    scales = blocks.abs().mean(dim=1)  # the L1 norm over the block's size
    signs = torch.where(blocks >= 0, 1.0, -1.0)
    return pack_signs(x), scales, (blocks - scales[:, None] * signs).view(-1)


def _decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (unpack_signs(packed).view(scales.numel(), -1) * scales[:, None]).view(-1)


def one_bit_all_reduce_mean(flat: torch.Tensor, group, wire: WireBytes, errors: OneBitErrors) -> torch.Tensor:
    """The mean over ranks of flat (N,), through signs and one scale per chunk, with error feedback kept in
    `errors` (module docstring). Every rank gets the same result."""
    world = dist.get_world_size(group)
    padded, chunk = _padded(flat, world, ONE_BIT_BLOCK)
    if errors.worker is None:
        errors.worker, errors.server = torch.zeros_like(padded), torch.zeros(chunk)
    packed, scales, errors.worker = _one_bit(padded + errors.worker)
    packed, scales = _all_to_all([packed, scales], group, wire)
    mine = _decode(packed, scales).view(world, chunk).mean(dim=0) + errors.server  # (chunk,)
    packed, scales, errors.server = _one_bit(mine)
    packed, scales = _all_gather([packed, scales], group, wire)
    return _decode(packed, scales)[:flat.numel()].to(flat.dtype)


# ---- DDP communication hooks -------------------------------------------------------------------------------
# DDP checks a hook's annotations (their objects): this module does not use `from __future__ import annotations`.


@dataclass
class HookState:
    """What a hook needs: the data-parallel group and the byte counter."""

    group: dist.ProcessGroup
    wire: WireBytes = field(default_factory=WireBytes)
    # int8_hook: int8, or (False) the counted fp32 baseline; the 1-bit hook: past the warm-up, DDP sends nothing
    compress: bool = True


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


def int8_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: the bucket's gradients averaged through int8_all_reduce_mean (or, compress=False, the
    counted fp32 all-reduce)."""
    buffer = bucket.buffer()
    reduce = int8_all_reduce_mean if state.compress else all_reduce_mean
    return _done(reduce(buffer, state.group, state.wire).view_as(buffer))


def local_gradients_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook that sends nothing: each rank keeps its own gradients (1-bit Adam after its warm-up)."""
    return _done(bucket.buffer())


# ---- 1-bit Adam ---------------------------------------------------------------------------------------------


def _average_in_one_bit(momenta: list[torch.Tensor], group, wire: WireBytes, errors: OneBitErrors) -> None:
    """`momenta`, in place, averaged over ranks in one 1-bit all-reduce of their concatenation."""
    mean = one_bit_all_reduce_mean(torch.cat([m.reshape(-1) for m in momenta]), group, wire, errors)
    offset = 0
    for m in momenta:
        m.copy_(mean[offset:offset + m.numel()].view_as(m))
        offset += m.numel()


def _adamw_update_(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, group: dict, step: float,
                   variance_steps: int) -> None:
    """p = p (1 - lr wd) - lr (m / (1 - beta1^step)) / (sqrt(v / (1 - beta2^variance_steps)) + eps), in place."""
    beta1, beta2 = group["betas"]
    denom = (exp_avg_sq / (1 - beta2**variance_steps)).sqrt_().add_(group["eps"])
    param.mul_(1 - group["lr"] * group["weight_decay"])
    param.addcdiv_(exp_avg, denom, value=-group["lr"] / (1 - beta1**step))


class OneBitGradients:
    """1-bit Adam (Tang et al. 2021, Algorithm 1) with decoupled weight decay, the gradients part of
    runtime.optim.sharded_adamw.ShardedAdamW for a DDP model (tp = pp = 1); `group`: the data-parallel group.

    Whole parameters on every rank (the WholeShards layout, ZeRO 0): steps 1..warmup_steps are AdamW on DDP's
    averaged gradients (as torch.optim.AdamW, bias-corrected). Then the variance v is frozen, DDP's all-reduce is
    switched off (local_gradients_hook), and each step
        m = beta1 m + (1 - beta1) g_local;  m = one_bit_all_reduce_mean(m)  (error feedback)
        p = p (1 - lr wd) - lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^T_w)) + eps)
    with T_w the last warm-up step. Every rank computes the same m, so the parameters stay equal.

    ZeRO-1's rows (the RowShards layout): the warm-up is the states part's exact step (states sharded by rows).
    Then, as above: DDP sends nothing, each rank keeps its rows of the frozen v, and the momentum is all-reduced in
    1 bit with error feedback. 1-bit Adam needs every rank's whole momentum for that, so from the warm-up's end each
    rank holds a full momentum (4 bytes per parameter more than ZeRO-1's rows; gathered once from the rows when the
    warm-up ends); each rank updates its rows with m's rows and its frozen v, and the layout publishes the rows.
    (Compressing the averaged gradients instead, with the momentum kept in rows, ended 19-21 % above the fp32 loss
    on the tiny GPT, against -0.5 % for this.)"""

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel, group, *, warmup_steps: int = 100):
        self.ddp, self.group, self.warmup_steps = ddp, group, warmup_steps
        self.hook_state = HookState(group, compress=False)
        self.wire = self.hook_state.wire
        self.errors = OneBitErrors()
        self.steps = 0  # whole parameters: step() calls so far
        self.momentum: dict[torch.Tensor, torch.Tensor] = {}  # rows: full local momentum per parameter, after warm-up

    def bind(self, opt) -> None:
        self.ddp.register_comm_hook(self.hook_state, _warmup_or_local_hook)

    def loaded(self, opt) -> None:
        """Whole parameters: the step count (and so the warm-up's end) from the loaded states' steps (rows: read
        from the states at every step)."""
        if not opt.layout.keeps_rows_of_replicas:
            self.steps = int(max((float(s["step"]) for s in opt.state.values() if "step" in s), default=0))
            self.hook_state.compress = self.steps >= self.warmup_steps

    def _steps_done(self, opt) -> int:
        if opt.layout.keeps_rows_of_replicas:
            return int(min((float(s["step"]) for s in opt.state.values()), default=0))
        return self.steps

    def update(self, opt) -> bool:
        if not opt.layout.keeps_rows_of_replicas:
            self._whole_step(opt)
        elif self._steps_done(opt) < self.warmup_steps:
            opt.states.update(opt)
        else:
            self._rows_step(opt)
        self.hook_state.compress = self._steps_done(opt) >= self.warmup_steps  # from the next backward on
        return True

    def _whole_step(self, opt) -> None:
        compressing = self.steps >= self.warmup_steps  # the warm-up is over
        self.steps += 1
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        for p in params:
            opt.state[p]["step"] = torch.tensor(float(self.steps))  # as torch's AdamW keeps it
        for group in opt.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is not None:
                    opt.state[p]["exp_avg"].lerp_(p.grad, 1 - beta1)
                    if not compressing:
                        opt.state[p]["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        if compressing:  # the momenta of all parameters, averaged over ranks in one 1-bit all-reduce
            _average_in_one_bit([opt.state[p]["exp_avg"] for p in params], self.group, self.wire, self.errors)
        variance_steps = min(self.steps, self.warmup_steps)
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = opt.state[p]
                    _adamw_update_(p, state["exp_avg"], state["exp_avg_sq"], group, self.steps, variance_steps)

    def _rows_step(self, opt) -> None:
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if not self.momentum:  # the warm-up's momentum, whole on every rank (one fp32 all-gather)
            self.momentum = {p: opt.state[p]["exp_avg"].full_tensor() for g in opt.param_groups
                             for p in g["params"]}
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.momentum[p].lerp_(p.grad, 1 - group["betas"][0])
        _average_in_one_bit([self.momentum[p] for p in params], self.group, self.wire, self.errors)
        layout = opt.layout
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                rows, state = layout.rows[p], opt.state[p]
                state["step"] += 1
                if rows.stop == rows.start:
                    continue
                m_rows = self.momentum[p][rows.start:rows.stop]
                state["exp_avg"].to_local().copy_(m_rows)  # the rows a checkpoint saves
                _adamw_update_(layout.owned(p), m_rows, state["exp_avg_sq"].to_local(), group,
                               float(state["step"]), self.warmup_steps)
        layout.publish()


def _warmup_or_local_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """OneBitGradients' DDP hook: the counted fp32 all-reduce during the warm-up, nothing after it."""
    if state.compress:
        return local_gradients_hook(state, bucket)
    return _done(all_reduce_mean(bucket.buffer(), state.group, state.wire).view_as(bucket.buffer()))
