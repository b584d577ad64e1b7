"""ZeRO-Inference weight streaming (Aminabadi et al. 2022, "DeepSpeed-Inference", section 6): the weights of all
layers live in host memory ("cpu") or in files on an NVMe drive ("nvme"), and only `prefetch_layers + 1` layers
are on the device at any time, each copied in just before the engine needs it, while the previous layer computes.

    weights = StreamedWeights(layers, device, tier="nvme", nvme_dir="/nvme/zplan", prefetch_layers=1)
    for i in range(len(layers)):            # once per forward pass (prefill, then each decode step)
        w = weights.layer(i)                # dict name -> tensor on `device`, ready to use
        ...                                 # the layer's compute, on the current stream
        weights.done(i)                     # its slot may now be overwritten by a later layer
    weights.close()

This is the weight store protocol of runtime/inference/weight_store.py (layer / done / nbytes / close).

Slots. The device holds min(prefetch_layers + 1, L) slots, each one flat byte buffer the size of the largest layer;
a layer's tensors are views into its slot (each tensor starts at a multiple of SLOT_ALIGN_BYTES). The engine
must not keep a layer's tensors past done(i): the slot is then refilled with a later layer. Layers are visited
in the order 0, 1, ..., L-1, 0, 1, ... (wrapping to the next pass); done(i) frees layer i's slot and starts
loading the layer `prefetch_layers + 1` places after i into it, so when layer(i) is called, layers i .. i +
prefetch_layers are resident or on their way. On CUDA the copies run on a side stream: each slot has a `ready`
event (recorded after its copy; layer(i) makes the current stream wait on it) and a `free` event (recorded on
the current stream at done(i); the copy stream waits on it before overwriting the slot). Without CUDA the device
is the CPU and the copies are plain memcpy into the same slots, so the path is the same. A pass that stops between
layer(i) and done(i) (an error in the engine) is forgotten at the next layer(0), which restarts streaming there.

Tiers.
- "cpu": each layer packed once into one host buffer (pinned when the device is a GPU, so copies are asynchronous
  DMA); loading a layer is one host-to-device copy.
- "nvme": each layer packed and written once, as one tensor, through runtime.offload.nvme.SwapEngine (its own
  run folder under nvme_dir, removed at close(); aligned buffers and O_DIRECT where the file system allows it;
  XXH3 checksums, so a corrupted or truncated file raises SwapError). Loading a layer runs in a background
  thread: read the file into the slot's reusable host staging buffer (aligned, pinned with CUDA), then copy it
  to the slot on the copy stream. An error of the reader is raised by layer(i) of the layer it was reading.
  SwapEngine's public API fits as is: swap_out once per layer, swap_in(name, out=staging) for every load.

After the constructor returns, the caller may drop its own copies of the layers.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from zplan.errors import SpecError, SwapError
from zplan.runtime.inference.weight_store import tensor_bytes
from zplan.runtime.offload import nvme
from zplan.schemas.inference import WeightTier

TIERS = ("cpu", "nvme")
SLOT_ALIGN_BYTES = 256  # every tensor of a slot starts at a multiple of this (any dtype's alignment; coalescing)


@dataclass(frozen=True)
class _TensorSpec:
    """Where one tensor of a layer sits in the layer's packed bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the packed layer
    nbytes: int


@dataclass
class _Slot:
    """One device buffer holding one layer (plus, for the nvme tier, its host staging buffer)."""

    device_bytes: torch.Tensor  # uint8 (max_layer_bytes,) on the device
    staging: torch.Tensor | None  # uint8 (max_layer_bytes,) aligned host buffer (nvme tier), else None
    layer: int | None = None  # the layer loaded or being loaded here
    loading: Future | None = None  # done when `layer` is on the device (or, with CUDA, its copy is enqueued)
    ready: torch.cuda.Event | None = None  # recorded on the copy stream after the copy (CUDA)
    free: torch.cuda.Event | None = None  # recorded on the compute stream at done() (CUDA)
    in_use: bool = False  # handed out by layer(), not yet done()
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def _layout(layer: dict[str, torch.Tensor]) -> tuple[list[_TensorSpec], int]:
    """Each tensor's place in the packed layer, and the packed size in bytes."""
    specs, offset = [], 0
    for name, t in layer.items():
        nbytes = tensor_bytes(t)
        specs.append(_TensorSpec(name, t.dtype, tuple(t.shape), offset, nbytes))
        offset = nvme.round_up(offset + nbytes, SLOT_ALIGN_BYTES)
    return specs, offset


def _pack_into(out: torch.Tensor, layer: dict[str, torch.Tensor], specs: list[_TensorSpec]) -> None:
    """Copy the layer's tensors into the uint8 buffer `out` at their offsets (padding bytes zeroed)."""
    out.zero_()
    for spec in specs:
        t = layer[spec.name].detach()
        if spec.nbytes:
            out[spec.offset : spec.offset + spec.nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))


def _views(flat: torch.Tensor, specs: list[_TensorSpec]) -> dict[str, torch.Tensor]:
    """The layer's tensors as views of the uint8 buffer `flat`."""
    return {s.name: flat[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in specs}


def _host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """Uninitialised uint8 host buffer of `nbytes`, aligned for O_DIRECT (nvme.ALIGN_BYTES) and whose storage runs
    to the next aligned boundary; pinned (page-locked) when `pin`."""
    if not pin:
        return nvme.aligned_empty(nbytes)
    raw = torch.empty(nvme.round_up(max(nbytes, 0)) + nvme.ALIGN_BYTES, dtype=torch.uint8, pin_memory=True)
    offset = (-raw.data_ptr()) % nvme.ALIGN_BYTES
    return raw[offset : offset + nbytes]


class StreamedWeights:
    """Layer weights streamed to `device` from host memory or NVMe, `prefetch_layers` ahead (module docstring)."""

    def __init__(self, layers: list[dict[str, torch.Tensor]], device: torch.device | str, tier: WeightTier = "cpu",
                 nvme_dir: str | None = None, prefetch_layers: int = 1):
        if tier not in TIERS:
            raise SpecError(f"weight tier {tier!r} is not one of {TIERS}: pass tier='cpu' or tier='nvme'")
        if tier == "nvme" and not nvme_dir:
            raise SpecError("weight tier 'nvme' needs nvme_dir: a folder on the NVMe drive to stream weights from")
        if prefetch_layers < 0:
            raise SpecError(f"prefetch_layers must be 0 or more, got {prefetch_layers}")
        if not layers:
            raise SpecError("StreamedWeights needs at least one layer")
        self.device = torch.device(device)
        self.tier = tier
        self.prefetch_layers = prefetch_layers
        self.num_layers = len(layers)
        self._cuda = self.device.type == "cuda"
        pin = self._cuda
        self._specs: list[list[_TensorSpec]] = []
        self._packed_bytes: list[int] = []
        for layer in layers:
            specs, packed = _layout(layer)
            self._specs.append(specs)
            self._packed_bytes.append(packed)
        self._nbytes = sum(s.nbytes for specs in self._specs for s in specs)
        max_bytes = max(self._packed_bytes)

        self._host_layers: list[torch.Tensor] = []  # cpu tier: one packed buffer a layer
        self._swap: nvme.SwapEngine | None = None
        self._reader: ThreadPoolExecutor | None = None
        self._closed = False
        if tier == "cpu":
            for layer, specs, packed in zip(layers, self._specs, self._packed_bytes, strict=True):
                buf = _host_buffer(packed, pin)
                _pack_into(buf, layer, specs)
                self._host_layers.append(buf)
        else:
            self._write_to_nvme(layers, nvme_dir, max_bytes)
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zplan-zero-inference")

        # at most prefetch_layers + 1 layers on the device; never more slots than layers, so that the layer a
        # freed slot receives (i + num_slots) is never resident in another slot
        self.num_slots = min(prefetch_layers + 1, self.num_layers)
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._slots = [
            _Slot(torch.empty(max_bytes, dtype=torch.uint8, device=self.device),
                  _host_buffer(max_bytes, pin) if tier == "nvme" else None,
                  ready=torch.cuda.Event() if self._cuda else None, free=torch.cuda.Event() if self._cuda else None)
            for _ in range(self.num_slots)
        ]
        self._next_to_load = 0  # the layer the next free slot will receive
        self.peak_resident = 0  # most slots holding (or loading) a layer at once, for tests and reports

    # -- the weight store protocol ------------------------------------------------------------------------------

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's tensors on the device (views into a slot), ready for use on the current stream."""
        self._check_open()
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range: there are {self.num_layers} layers")
        if i == 0 and any(s.in_use for s in self._slots):
            self._release_abandoned()  # a pass stopped between layer() and done() (an error in the engine)
            slot = self._restart_at(0)
        else:
            slot = self._slot_of(i)
            if slot is None:
                slot = self._restart_at(i)
        slot.loading.result()  # raises the reader's error (SwapError) for this layer
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(slot.ready)
        slot.in_use = True
        return slot.tensors

    def done(self, i: int) -> None:
        """The engine's compute on layer i is enqueued: free its slot and start loading a later layer into it."""
        self._check_open()
        slot = self._slot_of(i)
        if slot is None or not slot.in_use:
            raise RuntimeError(f"done({i}) without layer({i}): call layer(i) before done(i)")
        slot.in_use = False
        if self._cuda:
            slot.free.record(torch.cuda.current_stream(self.device))
        self._load(self._next_to_load, slot)

    def nbytes(self) -> int:
        """Bytes of all layers' tensors as stored (without padding)."""
        return self._nbytes

    def close(self) -> None:
        """Wait for loads in flight, stop the reader, delete the NVMe files, release the buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            _wait_ignoring_errors(slot)  # closing: the error was or will never be asked for
        if self._cuda and self._copy_stream is not None:
            self._copy_stream.synchronize()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
        if self._swap is not None:
            self._swap.close()
        self._slots = []
        self._host_layers = []

    def __enter__(self) -> StreamedWeights:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- inspection (tests, reports) ------------------------------------------------------------------------------

    def resident_layers(self) -> list[int]:
        """Layers held by a device slot now (loaded or loading)."""
        return [s.layer for s in self._slots if s.layer is not None]

    def device_buffers(self) -> list[torch.Tensor]:
        """The slots' device buffers: every tensor layer() returns is a view of one of them."""
        return [s.device_bytes for s in self._slots]

    @property
    def run_folder(self):
        """The NVMe tier's folder of layer files (removed at close()), else None."""
        return None if self._swap is None else self._swap.run_folder

    def file_of(self, i: int):
        """The NVMe tier's file of layer i, else None."""
        return None if self._swap is None else self._swap.path_of(_file_name(i))

    # -- machinery ------------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("StreamedWeights is closed")

    def _slot_of(self, i: int) -> _Slot | None:
        for slot in self._slots:
            if slot.layer == i:
                return slot
        return None

    def _release_abandoned(self) -> None:
        """Free the slots of a pass that ended without done(): their compute is enqueued (CUDA: on the current
        stream, which `free` now marks), and streaming restarts at layer 0."""
        for slot in self._slots:
            if slot.in_use:
                slot.in_use = False
                if self._cuda:
                    slot.free.record(torch.cuda.current_stream(self.device))

    def _restart_at(self, i: int) -> _Slot:
        """Start of streaming (or a jump in the visiting order): load i .. i + prefetch_layers into the free slots."""
        if any(s.in_use for s in self._slots):
            held = [s.layer for s in self._slots if s.in_use]
            raise RuntimeError(f"layer({i}) while layers {held} are not done: call done() on them first "
                               f"(layers are visited in order 0..{self.num_layers - 1})")
        for slot in self._slots:
            _wait_ignoring_errors(slot)  # this load is being discarded
            slot.layer = None
        self._next_to_load = i
        for slot in self._slots:
            self._load(self._next_to_load, slot)
        return self._slots[0]

    def _load(self, i: int, slot: _Slot) -> None:
        """Start loading layer i into `slot` (which the engine no longer uses)."""
        self._next_to_load = (i + 1) % self.num_layers
        if slot.layer == i and not (slot.loading.done() and slot.loading.exception() is not None):
            return  # as many slots as layers: layer i is still here from this pass
        specs, packed = self._specs[i], self._packed_bytes[i]
        slot.layer = i
        slot.tensors = _views(slot.device_bytes, specs)
        self.peak_resident = max(self.peak_resident, len(self.resident_layers()))
        if self.tier == "cpu":
            future: Future = Future()
            try:
                self._copy_to_device(slot, self._host_layers[i][:packed], packed)
                future.set_result(i)
            except BaseException as e:  # noqa: BLE001 - surfaces at layer(i)
                future.set_exception(e)
            slot.loading = future
        else:
            slot.loading = self._reader.submit(self._read_from_nvme, i, slot, packed)

    def _copy_to_device(self, slot: _Slot, host: torch.Tensor, packed: int) -> None:
        """host (packed bytes) -> the slot's device buffer; on CUDA asynchronously on the copy stream, after the
        compute that last used the slot, then record `ready`."""
        if not self._cuda:
            slot.device_bytes[:packed].copy_(host)
            return
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(slot.free)
            slot.device_bytes[:packed].copy_(host, non_blocking=True)
            slot.ready.record(self._copy_stream)

    def _read_from_nvme(self, i: int, slot: _Slot, packed: int) -> int:
        """Background thread: layer i's file -> the slot's staging buffer -> the slot's device buffer."""
        if self._cuda:
            slot.ready.synchronize()  # the staging buffer's previous copy to the device has finished
        staging = slot.staging[:packed]
        self._swap.swap_in(_file_name(i), out=staging).result()  # SwapError on a corrupted / missing file
        self._copy_to_device(slot, staging, packed)
        return i

    def _write_to_nvme(self, layers: list[dict[str, torch.Tensor]], nvme_dir: str, max_bytes: int) -> None:
        """Write every layer once, packed, through a SwapEngine (its run folder under nvme_dir)."""
        needed = sum(nvme.round_up(p) + 2 * nvme.ALIGN_BYTES for p in self._packed_bytes)  # data + header
        try:
            nvme.check_space(nvme_dir, needed)
        except SwapError as e:
            raise SwapError(f"ZeRO-Inference cannot stream the weights from NVMe: {e} (nvme_dir={nvme_dir}; "
                            "pass an nvme_dir with more free space or use weight_tier='cpu')") from e
        self._swap = nvme.SwapEngine(nvme_dir)
        try:
            buf = nvme.aligned_empty(max_bytes)
            for i, (layer, specs, packed) in enumerate(zip(layers, self._specs, self._packed_bytes, strict=True)):
                _pack_into(buf[:packed], layer, specs)
                self._swap.swap_out(_file_name(i), buf[:packed]).result()
        except BaseException:
            self._swap.close()
            raise


def _wait_ignoring_errors(slot: _Slot) -> None:
    """Wait for the slot's load in flight, if any; its error is dropped (the caller discards the load)."""
    if slot.loading is not None:
        try:
            slot.loading.result()
        except Exception:  # noqa: BLE001, S110 - see the docstring
            pass


def _file_name(i: int) -> str:
    return f"layer{i:05d}"
