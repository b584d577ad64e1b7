"""ZeRO-Offload for ZeRO-1 (Ren et al., ZeRO-Offload, USENIX ATC'21): runtime.optim.zero1.ZeroOneAdamW with this
rank's optimizer work on the host.

Each dp rank owns the same dim-0 rows of every parameter as under ZeroOneAdamW (of the tp-local tensor under
tensor parallel). For those rows it keeps, in host memory (pinned when CUDA is available, so that the copies
are asynchronous DMA; plain otherwise):
  - the fp32 master copy of the rows,
  - the Adam moments exp_avg, exp_avg_sq (fp32).
A step copies the owned rows of the (already dp-averaged) gradient to the host, runs zplan.cuda.cpu_adam's
adamw_step_ (C++ SIMD kernel, torch.optim.AdamW semantics) on them, and writes the updated rows back into the
parameter: a 16-bit parameter's rows come out of the same kernel pass (param_copy_out), an fp32 parameter's
rows are the updated master rows copied back. The rows then reach the other dp ranks exactly as in
ZeroOneAdamW (in-place broadcasts, padded all-gather buckets).

State dict: the same layout as ZeroOneAdamW, so checkpoints reshard between the two and into every other
layout (runtime.optim.zero1's docstring): state[param] = {"step": fp32 scalar, "exp_avg", "exp_avg_sq": DTensor of
the parameter's global shape, this rank's rows as its local tensor}; here the local tensors are host tensors
(a DTensor on a CUDA mesh may hold a CPU local tensor, as FSDP2's CPUOffloadPolicy does) and the step
scalar lives on the host too. The fp32 master is not a state of an fp32 parameter: it equals the
parameter's rows, and is re-read from them whenever the parameter was written by anything else than this
optimizer (loading a checkpoint, a broadcast at start-up: tracked by the parameter's version counter). A
16-bit parameter's master is kept as a third state, "master" (same layout as the moments).

One-step delayed parameter update (DPU; ZeRO-Offload, Ren et al. ATC'21, Sec. 5.2), with delayed_update=True: the first
`delay_after_steps` steps (default DELAY_AFTER_STEPS) are the exact ones above (the paper turns DPU on only after
the first few tens of iterations, when the gradients change fastest); from then on step() at iteration i
  (a) waits for the update of iteration i-1, which runs in a background thread, and publishes it: its rows into
      the parameter, then the all-gather to the other dp ranks (the collectives stay on the calling thread);
  (b) copies this rank's owned gradient rows into host buffers (the next backward overwrites the gradients),
      starts the CPU Adam update of iteration i in the background thread (one reusable worker; the kernel's
      OpenMP threads do the math, and it releases the GIL) and returns.
The forward and backward of iteration i+1 thus run while the CPU steps with g_i, on weights one update behind:
g_{i+1} is taken at the weights after update i-1, and update i+1 applies it after update i. flush() publishes
the pending update (collective: every dp rank calls it), after which the next gradient is taken at fully
updated weights again. state_dict() flushes first, so a checkpoint holds every update; load_state_dict() drops
the pending one. Whatever reads the parameters for keeps (a weight file, an evaluation, a checkpoint: DCP's
get_state_dict reads the model before the optimizer) calls flush() first, and a run flushes after its last
step. An error in the background update is raised by the next step() or flush(). While an update is pending the
host states (moments, master) are being written: read them after flush().
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from zplan.runtime.optim.zero1 import ZeroOneAdamW, _local, state_layout

_MOMENTS = ("exp_avg", "exp_avg_sq")
# Exact steps before the delayed update starts (module docstring). The paper waits a few tens of iterations; a
# delay from the first steps costs more: the tiny GPT of tests/distributed/test_delayed_update.py at lr 3e-3
# ends 60 steps 9.6% above the exact run's loss when the delay starts at step 10, 1.7% when it starts at 30.
DELAY_AFTER_STEPS = 40

# One kernel call: (masters, grads, exp_avgs, exp_avg_sqs) host tensor lists, then adamw_step_'s keyword arguments.
_Call = tuple[tuple[list[torch.Tensor], ...], dict]


def _pin() -> bool:
    return torch.cuda.is_available()  # pinning needs a CUDA context


def _host_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=_pin())


def host_dtensor_on(local: torch.Tensor, mesh, placements, p: torch.Tensor) -> DTensor:
    """A DTensor of p's global shape on `mesh` with `placements`, whose local tensor is `local`, a host tensor,
    even on a CUDA mesh (DTensor.from_local would move it to the mesh's device)."""
    if mesh.device_type == "cpu":
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(p.shape, p.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _host_dtensor(local: torch.Tensor, p: torch.Tensor, dp_mesh) -> DTensor:
    """A host DTensor of p's global shape laid out as ZeroOneAdamW's moments (runtime.optim.zero1.state_layout)."""
    mesh, placements = state_layout(p, dp_mesh)
    return host_dtensor_on(local, mesh, placements, p)


def states_to_host(state: dict, as_state) -> None:
    """One parameter's states after torch's load_state_dict (which casts them to the parameter's device) back
    into host memory: each moment (and 16-bit master) fp32 on the host (pinned with a GPU), rewrapped by
    `as_state(local)` when it is not already a DTensor of that local tensor; the step a host fp32 scalar."""
    for key in (*_MOMENTS, "master"):
        if key not in state:
            continue
        value = state[key]
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.device.type != "cpu" or local.dtype != torch.float32 or (_pin() and not local.is_pinned()):
            host = _host_empty(local.shape, torch.float32)
            host.copy_(local)
            local = host
        if not isinstance(value, DTensor) or value.to_local() is not local:
            state[key] = as_state(local)
    state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).detach().cpu().reshape(())


def kernel_calls(by_step: dict[int, tuple[list, list, list, list, list]], group: dict, threads: int,
                 grad_divisor=None) -> list[_Call]:
    """adamw_step_ calls for one param group: `by_step` maps a step count to the (masters, grads, exp_avgs,
    exp_avg_sqs, outs) host tensor lists of the parameters at that count (outs: a 16-bit tensor the kernel writes
    the updated parameter into in the same pass, or None); one call per step count and kind of parameter. 16-bit
    gradients are read divided by `grad_divisor` (ZeroOneAdamW's: loss scale times clipping factor), if any."""
    beta1, beta2 = group["betas"]
    hyper = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                 weight_decay=group["weight_decay"], threads=threads or torch.get_num_threads())
    # a fake divisor (the dry run) has no value, and its kernel does not run (run_kernel_calls)
    grad_scale = 1.0 if grad_divisor is None or is_fake(grad_divisor) else 1.0 / float(grad_divisor)
    calls: list[_Call] = []
    for step, (masters, grads, exp_avgs, exp_avg_sqs, outs) in by_step.items():
        has_out = [o for o in outs if o is not None]
        if has_out and len(has_out) != len(outs):  # mixed dtypes in one group: one call per kind
            kinds = [(m, g, a, s, o) for m, g, a, s, o in zip(masters, grads, exp_avgs, exp_avg_sqs, outs,
                                                              strict=True)]
            parts = [[k for k in kinds if k[4] is None], [k for k in kinds if k[4] is not None]]
        else:
            parts = [list(zip(masters, grads, exp_avgs, exp_avg_sqs, outs, strict=True))]
        for part in parts:
            m, g, a, s, o = (list(x) for x in zip(*part, strict=True))
            sixteen_bit = o[0] is not None
            calls.append(((m, g, a, s), dict(hyper, step=step, param_copy_out=o if sixteen_bit else None,
                                             grad_scale=grad_scale if sixteen_bit else 1.0)))
    return calls


def step_count(step: torch.Tensor) -> int:
    """A parameter's AdamW step count, which the kernel's bias correction reads; on fake tensors (the dry run:
    zplan dryrun) there are no values, and no kernel to read one (run_kernel_calls), so 1."""
    return 1 if is_fake(step) else int(step.item())


def run_kernel_calls(calls: list[_Call]) -> tuple[float, str | None]:
    """Run the adamw_step_ calls on the calling thread: (their seconds, the backend of the last one). On fake tensors
    (the dry run) nothing runs: the step updates its tensors in place and allocates nothing."""
    from zplan.cuda.cpu_adam import adamw_step_

    if calls and is_fake(calls[0][0][0][0]):
        return 0.0, "fake"
    backend = None
    start = time.perf_counter()
    for tensors, kwargs in calls:
        backend = adamw_step_(*tensors, **kwargs)
    return time.perf_counter() - start, backend


class CpuOffloadZeroOneAdamW(ZeroOneAdamW):
    """ZeroOneAdamW whose owned rows' fp32 master and moments live on the host and step with the CPU Adam
    kernel (module docstring). Hyper-parameters as torch.optim.AdamW; `threads`: OpenMP threads of the kernel
    (0: torch.get_num_threads() of the thread calling step()). delayed_update: ZeRO-Offload's one-step
    delayed parameter update after `delay_after_steps` exact steps (counted by step() calls, and restored from
    the step counts of a loaded state dict, so a resumed run delays when the uninterrupted one would).

    Measured, for benchmarks: last_cpu_step_s, seconds the CPU Adam kernel calls of the last published
    update took; last_wait_s, seconds the calling thread waited for them in the last step() or flush() (all of
    last_cpu_step_s on an exact step, the part not hidden behind forward and backward on a delayed one)."""

    def __init__(self, params, dp_mesh, *, threads: int = 0, delayed_update: bool = False,
                 delay_after_steps: int = DELAY_AFTER_STEPS, **kwargs):
        kwargs.pop("fused", None)  # the host kernel is used whatever the device kernel choice
        if delay_after_steps < 0:
            raise ValueError(f"delay_after_steps must be >= 0, got {delay_after_steps}")
        self._threads = threads
        self.delayed_update = delayed_update
        self.delay_after_steps = delay_after_steps
        self._steps_done = 0  # step() calls so far (the warm-up count)
        self._worker: ThreadPoolExecutor | None = None  # the one background thread, made at the first delay
        self._pending: Future | None = None  # the background update not yet published; its result: seconds
        self._pending_write_back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter rows, host rows)
        self._pending_step = 0  # its step number (the step count it brings the states to), for error messages
        self.last_cpu_step_s = 0.0
        self.last_wait_s = 0.0
        self._master: dict[torch.Tensor, torch.Tensor] = {}  # fp32 parameters: host master rows
        self._synced_version: dict[torch.Tensor, int] = {}  # parameter version the master was read from
        self._grad_host: dict[torch.Tensor, torch.Tensor] = {}  # host copy of grad rows (CUDA, or delayed)
        self._out_host: dict[torch.Tensor, torch.Tensor] = {}  # host 16-bit updated rows (CUDA, or delayed)
        self.last_backend: str | None = None  # what adamw_step_ ran last: 'cpp-avx2', 'reference', ...
        super().__init__(params, dp_mesh, fused=True, **kwargs)

    # ---- states ------------------------------------------------------------------------------------

    def _owned_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        rows = self._rows[p]
        return (rows.stop - rows.start, *_local(p).shape[1:])

    def _fresh_state(self, p: torch.Tensor) -> dict:
        shape = self._owned_shape(p)
        state = {"step": torch.zeros((), dtype=torch.float32)}
        for key in _MOMENTS:
            state[key] = _host_dtensor(_host_empty(shape, torch.float32), p, self.dp_mesh)
        owned = _local(p.detach())[self._rows[p].start:self._rows[p].stop]
        if p.dtype == torch.float32:
            self._master[p] = _host_empty(shape, torch.float32)
            self._master[p].copy_(owned)
            self._synced_version[p] = _local(p.detach())._version
        else:  # 16-bit parameter: the master carries information the parameter does not, so it is a state
            master = _host_empty(shape, torch.float32)
            master.copy_(owned)
            state["master"] = _host_dtensor(master, p, self.dp_mesh)
        return state

    def host_buffers(self) -> list[torch.Tensor]:
        """Host memory besides the states: fp32 parameters' masters, the gradient and 16-bit row buffers
        (runtime.training.memory_tiers, the dry run's host count)."""
        return [*self._master.values(), *self._grad_host.values(), *self._out_host.values()]

    def master_rows(self, p: torch.Tensor) -> torch.Tensor:
        """The host fp32 master of this rank's rows of `p`."""
        return self._master[p] if p in self._master else self.state[p]["master"].to_local()

    def state_dict(self) -> dict:
        """As torch's, after flush(): the states and parameters of a checkpoint hold every update. Collective
        while an update is pending: every dp rank calls it (as torch.distributed.checkpoint does)."""
        self.flush()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, after dropping any pending update (waited for, its result and error discarded: the
        loaded states replace what it computed); then the states back into host memory (torch's loader casts
        them to the parameter's device), and every fp32 master re-read from its parameter at the next step."""
        if self._pending is not None:
            wait_for([self._pending])
            self._pending, self._pending_write_back = None, []
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            states_to_host(state, lambda local, p=p: _host_dtensor(local, p, self.dp_mesh))
        self._synced_version.clear()
        self._steps_done = int(max((float(state["step"]) for state in self.state.values()), default=0))

    # ---- the step ------------------------------------------------------------------------------------

    def _adamw_on_owned_rows(self, group: dict) -> None:
        """The exact step of one group, on the calling thread: stage, run the kernel, write the rows back."""
        calls, write_back, staged = self._stage(group, delayed=False)
        if staged:
            torch.cuda.synchronize()  # the gradient rows are on the host
        self.last_cpu_step_s += self._run_calls(calls)
        for device_rows, host_rows in write_back:
            device_rows.copy_(host_rows, non_blocking=device_rows.device.type != "cpu")

    def _stage(self, group: dict, *, delayed: bool) -> tuple[list[_Call], list[tuple[torch.Tensor, torch.Tensor]],
                                                              bool]:
        """One group's share of a step on the calling thread: advance the step counts, re-read stale masters,
        bring the owned gradient rows to the host, and list the kernel calls and the (parameter rows, host rows)
        copies that follow them; the bool: gradient rows are being copied from a device (synchronize first).
        delayed: the calls will run while the next backward writes the gradients and the model reads the
        parameters, so the gradient rows are always copied into our host buffers, and a 16-bit parameter's
        updated rows go to a host buffer, never straight into the parameter."""
        by_step: dict[int, tuple[list, list, list, list, list]] = {}
        write_back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device rows, host rows) to copy after
        staged = False
        for p in group["params"]:
            if p.grad is None:  # as torch's AdamW: no gradient, no step
                continue
            rows, state = self._rows[p], self.state[p]
            state["step"] += 1
            if rows.stop == rows.start:
                continue
            owned = _local(p.detach())[rows.start:rows.stop]
            if p in self._master and self._synced_version.get(p) != owned._version:
                self._master[p].copy_(owned)  # the parameter was written by someone else (e.g. a load)
            grad = _local(p.grad)[rows.start:rows.stop]
            if grad.device.type != "cpu" or delayed:
                host = self._grad_host.get(p)
                if host is None:
                    host = self._grad_host[p] = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=_pin())
                host.copy_(grad, non_blocking=True)
                staged = staged or grad.device.type != "cpu"
                grad = host
            elif not grad.is_contiguous():
                grad = grad.contiguous()
            out = None
            if p not in self._master:  # 16-bit parameter: the kernel writes its rows in the same pass
                if owned.device.type == "cpu" and not delayed:
                    out = owned
                else:
                    out = self._out_host.get(p)
                    if out is None:
                        out = self._out_host[p] = torch.empty(owned.shape, dtype=owned.dtype, pin_memory=_pin())
                    write_back.append((owned, out))
            else:
                write_back.append((owned, self._master[p]))
            lists = by_step.setdefault(step_count(state["step"]), ([], [], [], [], []))
            for target, value in zip(lists, (self.master_rows(p), grad, state["exp_avg"].to_local(),
                                             state["exp_avg_sq"].to_local(), out), strict=True):
                target.append(value)
        return kernel_calls(by_step, group, self._threads, self.grad_divisor), write_back, staged

    def _run_calls(self, calls: list[_Call], ready: torch.cuda.Event | None = None) -> float:
        """The kernel calls (on the calling thread, or the background one), after `ready` (the host copies
        they read or overwrite) when given; returns their seconds."""
        if ready is not None:
            ready.synchronize()
        seconds, backend = run_kernel_calls(calls)
        self.last_backend = backend or self.last_backend
        return seconds

    @torch.no_grad()
    def step(self, closure=None):
        """The exact step (module docstring), or, with delayed_update after the warm-up steps, publish the
        pending update and start this one in the background."""
        if not (self.delayed_update and self._steps_done >= self.delay_after_steps):
            self.flush()  # no-op unless the delay was switched off with an update pending
            self.last_cpu_step_s = 0.0  # summed over the groups by _adamw_on_owned_rows
            loss = super().step(closure)
            self.last_wait_s = self.last_cpu_step_s
            self._mark_synced()
            self._steps_done += 1
            return loss
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._publish()
        self._start_update()
        self._steps_done += 1
        return loss

    @torch.no_grad()
    def flush(self) -> None:
        """Wait for the pending delayed update and publish it (rows into the parameters, all-gather over dp):
        collective, every dp rank calls it; nothing to do (no collective) when no update is pending. Raises
        what the background update raised."""
        self._publish()

    def _mark_synced(self) -> None:
        for p in self._master:  # our own writes (and the rows the others sent) do not make the master stale
            self._synced_version[p] = _local(p.detach())._version

    def _start_update(self) -> None:
        """Stage every group's step on this thread and run its kernel calls in the background thread."""
        calls, write_back, staged = [], [], False
        for group in self.param_groups:
            group_calls, group_write_back, group_staged = self._stage(group, delayed=True)
            calls += group_calls
            write_back += group_write_back
            staged = staged or group_staged
        ready = None
        if staged or any(rows.device.type != "cpu" for rows, _ in write_back):
            # after the gradient copies, and after the last publish's copies out of the host rows it rewrites
            ready = torch.cuda.Event()
            ready.record()
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zplan-cpu-adam")
        self._pending = self._worker.submit(self._run_calls, calls, ready)
        self._pending_write_back = write_back
        self._pending_step = self._steps_done + 1

    def _publish(self) -> None:
        """Wait for the pending update, then its rows into the parameters and the all-gather over dp."""
        if self._pending is None:
            return
        job, write_back = self._pending, self._pending_write_back
        self._pending, self._pending_write_back = None, []
        start = time.perf_counter()
        try:
            self.last_cpu_step_s = job.result()
        except Exception as exc:
            raise RuntimeError(f"the delayed CPU Adam update of step {self._pending_step} failed in its "
                               f"background thread: {exc}") from exc
        finally:
            self.last_wait_s = time.perf_counter() - start
        for device_rows, host_rows in write_back:
            device_rows.copy_(host_rows, non_blocking=device_rows.device.type != "cpu")
        if self._world > 1:
            self._all_gather_parameters()
        self._mark_synced()
