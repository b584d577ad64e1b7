"""AdamW states in host memory, stepped by zplan's CPU AdamW kernel: ZeRO-Offload (Ren et al., ZeRO-Offload, USENIX
ATC'21), the states part of runtime.optim.sharded_adamw.ShardedAdamW for offload='cpu' with the parameters on the
device (ZeRO 1's rows, or ZeRO 2/3's FSDP2 shards: Sec. 4, the optimizer alone on the host).

For the elements this rank updates (the layout part's `owned`) it keeps, in host memory (pinned when CUDA is
available, so that the copies are asynchronous DMA; plain otherwise):
  - an fp32 master copy                                       4 bytes a parameter of the shard,
  - Adam's moments exp_avg, exp_avg_sq (fp32)                 8 bytes,
  - with a GPU, the buffer the gradient is copied into.
A step copies the owned gradient elements to the host, runs zplan.cuda.cpu_adam's adamw_step_ (C++ SIMD kernel,
torch.optim.AdamW semantics; runtime.optim.cpu_adam_kernel) on them, and writes the updated elements back into the
parameter: a 16-bit parameter's come out of the same kernel pass (param_copy_out), an fp32 parameter's are the
updated master copied back. The layout then publishes them (ZeRO 1: the rows to the other dp ranks; ZeRO 2/3:
nothing, FSDP2 gathers at the next forward). On a machine without a GPU the device is the host and the same path
runs, so tests on CPU exercise it.

State dict: the layout's (runtime.optim.layouts), so checkpoints reshard between this and every other plan:
state[param] = {"step": fp32 host scalar, "exp_avg", "exp_avg_sq": DTensor laid out by the layout, the host
moment as its local tensor (a DTensor on a CUDA mesh may hold a CPU local tensor, as FSDP2's CPUOffloadPolicy
does)}. The fp32 master is not a state of an fp32 parameter: it equals the parameter's elements, and is re-read
from them at the next step whenever they were written by anything but this optimizer (made after the optimizer,
loaded from a checkpoint, a broadcast at start-up: tracked by address and version counter). A 16-bit parameter's
master (ZeRO 1 with mixed precision) is kept as a third state, "master" (same layout as the moments).

One-step delayed parameter update (DPU; ZeRO-Offload Sec. 5.2), with delayed_update=True: the first
`delay_after_steps` steps (default DELAY_AFTER_STEPS) are the exact ones above (the paper turns DPU on only after
the first few tens of iterations, when the gradients change fastest); from then on step() at iteration i
  (a) waits for the update of iteration i-1, which runs in a background thread, and publishes it: its elements
      into the parameter, then the layout's publish (the collectives stay on the calling thread);
  (b) copies this rank's owned gradient elements into host buffers (the next backward overwrites the gradients),
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

from zplan.runtime.optim.cpu_adam_kernel import (
    MOMENTS,
    _Call,
    host_empty,
    kernel_calls,
    pin,
    run_kernel_calls,
    states_to_host,
    step_count,
)
from zplan.runtime.optim.layouts import _local, is_16bit

# Exact steps before the delayed update starts (module docstring). The paper waits a few tens of iterations; a
# delay from the first steps costs more: the tiny GPT of tests/distributed/test_delayed_update.py at lr 3e-3
# ends 60 steps 9.6% above the exact run's loss when the delay starts at step 10, 1.7% when it starts at 30.
DELAY_AFTER_STEPS = 40


def _stamp(local: torch.Tensor) -> tuple[int, int]:
    """What changes when a tensor is written or replaced: (address, version counter); on a fake tensor (the dry run),
    which has no address, its storage's identity."""
    return (id(local.untyped_storage()) if is_fake(local) else local.data_ptr()), local._version


class HostStates:
    """States on the host, zplan's CPU Adam kernel (module docstring). `threads`: OpenMP threads of the kernel (0:
    torch.get_num_threads() of the thread calling step()). delayed_update: ZeRO-Offload's one-step delayed
    parameter update after `delay_after_steps` exact steps (counted by step() calls, and restored from the step
    counts of a loaded state dict, so a resumed run delays when the uninterrupted one would).

    Measured, for benchmarks: last_cpu_step_s, seconds the CPU Adam kernel calls of the last published update
    took; last_wait_s, seconds the calling thread waited for them in the last step() or flush() (all of
    last_cpu_step_s on an exact step, the part not hidden behind forward and backward on a delayed one);
    last_backend, what adamw_step_ ran last ('cpp-avx2', 'reference', ...)."""

    def __init__(self, *, threads: int = 0, delayed_update: bool = False, delay_after_steps: int = DELAY_AFTER_STEPS):
        if delay_after_steps < 0:
            raise ValueError(f"delay_after_steps must be >= 0, got {delay_after_steps}")
        self._threads = threads
        self.delayed_update = delayed_update
        self.delay_after_steps = delay_after_steps
        self._steps_done = 0  # step() calls so far (the warm-up count)
        self._worker: ThreadPoolExecutor | None = None  # the one background thread, made at the first delay
        self._pending: Future | None = None  # the background update not yet published; its result: seconds
        self._pending_write_back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter elements, host ones)
        self._pending_step = 0  # its step number (the step count it brings the states to), for error messages
        self.last_cpu_step_s = 0.0
        self.last_wait_s = 0.0
        self.last_backend: str | None = None
        self._master: dict[torch.Tensor, torch.Tensor] = {}  # fp32 parameters: host master of the owned elements
        self._synced: dict[torch.Tensor, tuple[int, int] | None] = {}  # _stamp of the elements the master equals
        self._grad_host: dict[torch.Tensor, torch.Tensor] = {}  # host copy of gradient elements (CUDA, or delayed)
        self._out_host: dict[torch.Tensor, torch.Tensor] = {}  # host 16-bit updated elements (CUDA, or delayed)

    # ---- states ------------------------------------------------------------------------------------

    def fresh(self, opt, p: torch.Tensor) -> dict:
        owned = opt.layout.owned(p)
        if is_16bit(p) and not opt.layout.keeps_rows_of_replicas:
            raise ValueError(f"host states step fp32 shards (FSDP2's), got {p.dtype} {tuple(owned.shape)}")
        state = {"step": torch.zeros((), dtype=torch.float32)}
        for key in MOMENTS:
            state[key] = opt.layout.as_state(host_empty(owned.shape, torch.float32), p)
        if is_16bit(p):  # the master carries information the parameter does not, so it is a state
            master = host_empty(owned.shape, torch.float32)
            master.copy_(owned)
            state["master"] = opt.layout.as_state(master, p)
        else:  # read from the parameter at the first step (the weights may come later)
            self._master[p] = host_empty(owned.shape, torch.float32)
            self._synced[p] = None
        return state

    def bind(self, opt) -> None:
        pass

    def master(self, opt, p: torch.Tensor):
        return opt.state[p].get("master")

    def master_rows(self, opt, p: torch.Tensor) -> torch.Tensor:
        """The host fp32 master of this rank's elements of `p`."""
        return self._master[p] if p in self._master else _local(opt.state[p]["master"])

    def host_buffers(self) -> list[torch.Tensor]:
        """Host memory besides the states: fp32 parameters' masters, the gradient and 16-bit buffers
        (runtime.training.memory_tiers, the dry run's host count)."""
        return [*self._master.values(), *self._grad_host.values(), *self._out_host.values()]

    def before_state_dict(self, opt) -> None:
        """The states and parameters of a checkpoint hold every update: flush() (collective while an update is
        pending: every dp rank calls it, as torch.distributed.checkpoint does)."""
        self.flush(opt)

    def drop_pending(self) -> None:
        """Wait for a pending update and discard its result and error (loaded states replace what it computed)."""
        if self._pending is not None:
            wait_for([self._pending])
            self._pending, self._pending_write_back = None, []

    def loaded(self, opt) -> None:
        """After a load: the states back into host memory (torch's loader casts them to the parameter's device),
        every fp32 master re-read from its parameter at the next step, the warm-up count from the step counts."""
        for p, state in opt.state.items():
            states_to_host(state, lambda local, p=p: opt.layout.as_state(local, p))
        self._synced = dict.fromkeys(self._synced)
        self._steps_done = int(max((float(state["step"]) for state in opt.state.values()), default=0))

    def close(self) -> None:
        pass

    # ---- the step ------------------------------------------------------------------------------------

    def update(self, opt) -> None:
        """The exact step, or, with delayed_update after the warm-up steps, publish the pending update and start
        this one in the background (module docstring)."""
        if not (self.delayed_update and self._steps_done >= self.delay_after_steps):
            self.flush(opt)  # no-op unless the delay was switched off with an update pending
            calls, write_back, staged = self._stage(opt, delayed=False)
            if staged or any(rows.device.type != "cpu" for rows, _ in write_back):
                torch.cuda.synchronize()  # the gradient copies have landed, the last step's copies out too
            self.last_cpu_step_s = self._run_calls(calls)
            self.last_wait_s = self.last_cpu_step_s
            for device_rows, host_rows in write_back:
                device_rows.copy_(host_rows, non_blocking=device_rows.device.type != "cpu")
            opt.layout.publish()
            self._mark_synced(opt)
        else:
            self._publish(opt)
            self._start_update(opt)
        self._steps_done += 1

    def flush(self, opt) -> None:
        """Wait for the pending delayed update and publish it (module docstring); nothing to do (no collective)
        when no update is pending. Raises what the background update raised."""
        self._publish(opt)

    def _stage(self, opt, *, delayed: bool) -> tuple[list[_Call], list[tuple[torch.Tensor, torch.Tensor]], bool]:
        """A step's share on the calling thread: advance the step counts, re-read stale masters, bring the owned
        gradient elements to the host, and list the kernel calls and the (parameter elements, host elements)
        copies that follow them; the bool: gradients are being copied from a device (synchronize first).
        delayed: the calls will run while the next backward writes the gradients and the model reads the
        parameters, so the gradients are always copied into our host buffers, and a 16-bit parameter's updated
        elements go to a host buffer, never straight into the parameter."""
        layout, calls, staged = opt.layout, [], False
        write_back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device elements, host elements) to copy after
        for group in opt.param_groups:
            by_step: dict[int, tuple[list, list, list, list, list]] = {}
            for p in group["params"]:
                if p.grad is None:  # as torch's AdamW: no gradient, no step
                    continue
                state = opt.state[p]
                state["step"] += 1
                if layout.is_empty(p):
                    continue
                owned = layout.owned(p)
                if p in self._master and self._synced[p] != _stamp(owned):
                    self._master[p].copy_(owned)  # written by someone else (a load), or never read
                grad = layout.grad(p)
                if grad.device.type != "cpu" or delayed:
                    host = self._grad_host.get(p)
                    if host is None:
                        host = self._grad_host[p] = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=pin())
                    host.copy_(grad, non_blocking=True)
                    staged = staged or grad.device.type != "cpu"
                    grad = host
                elif not grad.is_contiguous():
                    grad = grad.contiguous()
                out = None
                if p not in self._master:  # 16-bit parameter: the kernel writes its elements in the same pass
                    if owned.device.type == "cpu" and not delayed:
                        out = owned
                    else:
                        out = self._out_host.get(p)
                        if out is None:
                            out = self._out_host[p] = torch.empty(owned.shape, dtype=owned.dtype, pin_memory=pin())
                        write_back.append((owned, out))
                else:
                    write_back.append((owned, self._master[p]))
                lists = by_step.setdefault(step_count(state["step"]), ([], [], [], [], []))
                for target, value in zip(lists, (self.master_rows(opt, p), grad, _local(state["exp_avg"]),
                                                 _local(state["exp_avg_sq"]), out), strict=True):
                    target.append(value)
            calls += kernel_calls(by_step, group, self._threads, opt.grad_divisor)
        return calls, write_back, staged

    def _run_calls(self, calls: list[_Call], ready: torch.cuda.Event | None = None) -> float:
        """The kernel calls (on the calling thread, or the background one), after `ready` (the host copies
        they read or overwrite) when given; returns their seconds."""
        if ready is not None:
            ready.synchronize()
        seconds, backend = run_kernel_calls(calls)
        self.last_backend = backend or self.last_backend
        return seconds

    def _mark_synced(self, opt) -> None:
        for p in self._master:  # our own writes (and the rows the others sent) do not make the master stale
            self._synced[p] = _stamp(opt.layout.owned(p))

    def _start_update(self, opt) -> None:
        """Stage the step on this thread and run its kernel calls in the background thread."""
        calls, write_back, staged = self._stage(opt, delayed=True)
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

    def _publish(self, opt) -> None:
        """Wait for the pending update, then its elements into the parameters and the layout's publish."""
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
        opt.layout.publish()
        self._mark_synced(opt)
