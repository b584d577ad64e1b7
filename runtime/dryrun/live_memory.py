"""Bytes a training step holds, counted storage by storage, and what they were at the peak (the dry run's meter).

LiveMemory is a TorchDispatchMode: every storage an aten op returns is counted at its nbytes from the op until it
is freed (a weakref finalizer on the storage), and UntypedStorage.resize_ (FSDP2 frees and re-allocates its
gathered parameters that way) changes the count in place. On fake tensors (FakeTensorMode) this counts what the
same program allocates on real ones, without a caching allocator's rounding: it is *allocated* memory, the figure
torch.cuda.max_memory_allocated reports, not reserved memory. DTensor ops are counted once, as their local ops
(the mode returns NotImplemented for a DTensor, as torch's MemTracker does), and only the tensors of the fake
mode that was active when the meter was entered (not those of a nested one, such as the initialisation's
recording), and not the full-shape tensors DTensor's sharding propagation makes under the ambient fake mode to
derive output shapes (torch 2.13: ShardingPropagator._propagate_tensor_meta_non_cached): neither holds memory in a
real run. Tensors that existed before the
mode was entered are counted through `track`; meta tensors hold no memory and are not counted.

Host memory: the dry run runs on the CPU, where the device and the host are one memory, so the states an offload
keeps on the host are told apart by what holds them: `mark_host(ids)` moves those storages (the offload
optimizer's master weights, moments and buffers, CPUOffloadPolicy's shards) from the device count to the host
count, from that moment on; it is called once the optimizer has made its states (after the first step).

By category: whenever the live bytes pass the last recorded peak by more than RECORD_STEP (1 %), the live
storages are sorted into categories by what holds them (`classify`: the model's parameters, their gradients,
the optimizer's states, named by identity), and the rest by when they were made: `activations` (made in a forward,
outside the backward and the optimizer step, still alive: saved tensors, logits, the loss) and `temporaries` (made
while the model was built: DDP's gradient buckets, communication buffers; or inside the backward or the optimizer
step: activation gradients, the step's workspace). The
breakdown reported is the last one recorded, from a moment within RECORD_STEP of the peak; the peak itself is
exact.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._guards import active_fake_mode
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

RECORD_STEP = 0.01  # record the breakdown again when the live bytes exceed the last record by this fraction
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (its attribute: to_local() would be a traced op), else the tensor."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


@dataclass
class _Storage:
    nbytes: int
    made_in: str  # "build", "forward" (outside backward and the optimizer step), "backward" or "optimizer"
    host: bool = False  # counted as host memory (an offloaded state, mark_host), not device memory


@dataclass
class PeakRecord:
    """Live bytes by category at a moment near the peak (module docstring)."""

    total_bytes: int = 0
    by_category: dict = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))


def _free_from(meter: weakref.ref, key: int) -> None:
    """A storage's finalizer: it is freed from `meter` if the meter still lives. The finalizer registry holds its
    arguments strongly until the storage dies, so it holds the meter weakly: a meter held there would keep its
    classify() (the model and optimizer) and so every storage alive after the run."""
    live = meter()
    if live is not None:
        live._free(key)


class LiveMemory(TorchDispatchMode):
    """Count live storages (module docstring). `classify()` returns {category: set of storage ids} for the
    parameters, gradients and optimizer states at that moment; it is called only when a breakdown is recorded."""

    def __init__(self, classify: Callable[[], dict[str, set[int]]] = dict) -> None:
        super().__init__()
        self.classify = classify  # may be set later, once the model and optimizer exist
        self._live: dict[int, _Storage] = {}  # id(storage) -> what it holds; torch keeps one object per live storage
        self.current_bytes = 0  # device bytes live now
        self.peak_bytes = 0  # most device bytes live at once
        self.host_bytes = 0  # host bytes live now (mark_host)
        self.host_peak_bytes = 0
        self.record = PeakRecord()
        self.phase = "build"  # the caller sets "forward" once the model is built; "optimizer" inside a step
        self._orig_resize = None
        self._fake_mode_on_entry = None  # the fake mode whose tensors are counted (None: real tensors)
        self._not_counting = 0  # > 0 inside DTensor's sharding propagation

    # ---- counting ----------------------------------------------------------------------------------------
    def track(self, tensor: torch.Tensor | None) -> None:
        """Count `tensor`'s storage (a DTensor's local one) if it is not counted yet."""
        if tensor is None or tensor.is_meta:  # a meta tensor holds no memory
            return
        storage = local_tensor(tensor).untyped_storage()
        key = id(storage)
        if key in self._live:
            return
        made_in = "backward" if torch._C._current_graph_task_id() != -1 else self.phase
        self._live[key] = _Storage(storage.nbytes(), made_in)
        weakref.finalize(storage, _free_from, weakref.ref(self), key)
        self._grow(storage.nbytes())

    def reset_peak(self) -> None:
        """Start the peak and its breakdown again from the bytes live now (e.g. after the model is built)."""
        self.peak_bytes = self.current_bytes
        self.host_peak_bytes = self.host_bytes
        self._record()

    def mark_host(self, ids: set[int]) -> None:
        """Count the live storages with these ids as host memory from now on (module docstring)."""
        for key in ids:
            entry = self._live.get(key)
            if entry is not None and not entry.host:
                entry.host = True
                self.current_bytes -= entry.nbytes
                self.host_bytes += entry.nbytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is None:
            return
        if entry.host:
            self.host_bytes -= entry.nbytes
        else:
            self.current_bytes -= entry.nbytes

    def _grow(self, nbytes: int) -> None:
        self.current_bytes += nbytes
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            if self.current_bytes > self.record.total_bytes * (1.0 + RECORD_STEP):
                self._record()

    def _resized(self, storage: torch.UntypedStorage) -> None:
        entry = self._live.get(id(storage))
        if entry is None or entry.host:
            return
        new = storage.nbytes()
        old, entry.nbytes = entry.nbytes, new
        if new >= old:
            self._grow(new - old)
        else:
            self.current_bytes -= old - new

    def _record(self) -> None:
        owners = self.classify()
        by_category = dict.fromkeys(CATEGORIES, 0)
        for key, entry in self._live.items():
            if entry.host:
                continue
            owner = next((name for name, ids in owners.items() if key in ids), None)
            owner = owner or ("activations" if entry.made_in == "forward" else "temporaries")
            by_category[owner] += entry.nbytes
        self.record = PeakRecord(sum(by_category.values()), by_category)

    # ---- the mode ----------------------------------------------------------------------------------------
    def __enter__(self):
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        meter = self
        self._orig_resize, resize = torch.UntypedStorage.resize_, torch.UntypedStorage.resize_
        self._orig_propagate = propagate = ShardingPropagator._propagate_tensor_meta_non_cached

        def resize_(storage, size):
            result = resize(storage, size)
            meter._resized(storage)
            return result

        def propagate_without_counting(*args, **kwargs):
            meter._not_counting += 1
            try:
                return propagate(*args, **kwargs)
            finally:
                meter._not_counting -= 1

        def step_starts(optimizer, args, kwargs):
            if meter.phase != "build":
                meter.phase = "optimizer"

        def step_ends(optimizer, args, kwargs):
            if meter.phase == "optimizer":
                meter.phase = "forward"

        self._step_hooks = (register_optimizer_step_pre_hook(step_starts),
                            register_optimizer_step_post_hook(step_ends))
        torch.UntypedStorage.resize_ = resize_
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate_without_counting
        self._fake_mode_on_entry = active_fake_mode()
        return super().__enter__()

    def __exit__(self, *exc):
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        torch.UntypedStorage.resize_ = self._orig_resize
        ShardingPropagator._propagate_tensor_meta_non_cached = self._orig_propagate
        for hook in self._step_hooks:
            hook.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented  # counted as the local ops DTensor runs
        out = func(*args, **(kwargs or {}))
        if self._not_counting or active_fake_mode() is not self._fake_mode_on_entry:
            return out  # another fake mode's tensors (DTensor's shape propagation, the init's recording): no memory
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.track(value)
        return out
