"""Record a model file's initialisation as a program of aten ops, then replay it one tensor at a time.

    program = record_init(build_fn)            # model built on fake tensors: nothing allocated
    replay_init(program, seed, wanted, emit)   # real CPU tensors, same RNG draws as the full build

Recording. build_fn runs under FakeTensorMode (tensors that report the CPU as their device but hold no
data, so a model file that skips its initialisation on meta still initialises) with a TorchDispatchMode
on top that logs every aten op: factory ops (empty, arange, ...), random in-place inits (normal_,
uniform_: nn.init's kaiming and friends end in those), fill_/zero_/copy_, arithmetic (RoPE tables),
views. A tensor is named by its storage and its view of it (offset, size, stride, dtype), so a program
replays views without running view ops and follows `param.data = x` swaps. At the end every parameter,
buffer and plain tensor attribute is an output: its storage's final contents, seen through its view.

Replaying. The ops run in the recorded order on real CPU tensors after torch.manual_seed(seed), so every
random op draws the numbers `torch.manual_seed(seed); build_fn()` draws (the CPU generator cannot skip
ahead, so every random op runs, whatever is wanted). A backward liveness pass over storages decides per op:
  run      its result is needed: by an output this rank wants, or by a later op that is run;
  scratch  a random op whose result nobody reads (nn.Linear's kaiming uniform_ that the model file's
           normal_ overwrites, another pipeline stage's weight): it draws into a scratch tensor of the
           same size, stride and dtype, which is dropped at once (same draws, same RNG state after);
  skip     anything else dead (an empty, the zero_ before an overwrite).
A storage's buffer is allocated when a run op first touches it and dropped after the last op that
needs it; an output is handed to `emit` right after its storage's last write. So the host holds about
one full tensor at a time (plus the values a later op still reads), never the model.

What cannot be recorded raises UnsupportedInit, and the caller builds the model in full instead:
reading tensor values in Python (.item(), `if t.any()`), data-dependent shapes (nonzero), an explicit
torch.Generator, tensors on a device other than the CPU. nn.init.trunc_normal_, whose rejection loop
reads the values it draws, is recorded as one op and replayed for real (same draws).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# In-place ops whose result does not depend on the tensor's old contents (when they cover all of it).
OVERWRITING_OPS = frozenset({"normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "exponential_",
                             "cauchy_", "log_normal_", "geometric_", "bernoulli_"})


class UnsupportedInit(Exception):
    """The model file's initialisation cannot be recorded as a replayable op program."""


@dataclass(frozen=True)
class TensorView:
    """A recorded tensor: which storage, and how it views it (offset in elements of dtype)."""

    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def covers(self, storage_bytes: int) -> bool:
        """True when the view's elements are exactly the storage's bytes (each once)."""
        if self.offset != 0 or _numel(self.size) * _itemsize(self.dtype) != storage_bytes:
            return False
        expected = 1
        for size, stride in sorted(((s, st) for s, st in zip(self.size, self.stride, strict=True) if s != 1),
                                   key=lambda pair: pair[1]):
            if stride != expected:
                return False
            expected *= size
        return True


@dataclass(frozen=True)
class Constant:
    """A real tensor that entered the recording (torch.tensor([...]) in the model file): index into constants."""

    index: int


@dataclass
class RecordedOp:
    func: Callable  # an aten OpOverload, or an nn.init function recorded whole (trunc_normal_)
    args: list  # pytree leaves of (args, kwargs), tensors replaced by TensorView / Constant
    spec: pytree.TreeSpec
    outputs: list[TensorView]  # every tensor output, in pytree order
    fresh: set[int]  # storages this op creates (an out-of-place result)
    reads: set[int]  # storages whose contents it reads
    overwrites: set[int]  # storages it writes whole without reading them
    partial_writes: set[int]  # storages it writes in part (or reads too): the old contents matter
    random: bool  # draws from the RNG (tagged nondeterministic_seeded)


@dataclass
class InitProgram:
    """What record_init saw: the ops, the size of each storage, and the final tensor of each name."""

    ops: list[RecordedOp] = field(default_factory=list)
    storage_bytes: list[int] = field(default_factory=list)
    outputs: dict[str, TensorView] = field(default_factory=dict)  # 'blocks.0.attn.q.weight' -> its tensor
    constants: list[torch.Tensor] = field(default_factory=list)

    @property
    def largest_output_bytes(self) -> int:
        return max((_numel(v.size) * _itemsize(v.dtype) for v in self.outputs.values()), default=0)


def _numel(size: Iterable[int]) -> int:
    total = 1
    for s in size:
        total *= s
    return total


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---- recording -----------------------------------------------------------------------------------


class _Recorder(TorchDispatchMode):
    """Logs each aten op that reaches it into `program`; runs it on the fake tensors below."""

    def __init__(self, program: InitProgram):
        super().__init__()
        self.program = program
        self._storage_index: dict[int, int] = {}  # fake storage's _cdata -> index
        self._keep_alive: list[torch.Tensor] = []  # so that no _cdata is reused while recording

    def view_of(self, tensor: torch.Tensor, create: bool) -> TensorView | None:
        if tensor.device.type != "cpu":
            raise UnsupportedInit(f"a tensor on {tensor.device} (replay makes CPU tensors only)")
        storage = tensor.untyped_storage()
        index = self._storage_index.get(storage._cdata)
        if index is None:
            if not create:
                return None
            index = self._storage_index[storage._cdata] = len(self.program.storage_bytes)
            self.program.storage_bytes.append(storage.nbytes())
            self._keep_alive.append(tensor)
        return TensorView(index, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("generator") is not None:
            raise UnsupportedInit(f"{func} with an explicit torch.Generator")
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            raise UnsupportedInit(f"{func} on device {device}")
        written = _written_arguments(func, args, kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        recorded, views_in = [], []
        for leaf in leaves:
            if isinstance(leaf, FakeTensor):
                view = self.view_of(leaf, create=False)
                if view is None:
                    raise UnsupportedInit(f"{func} read a fake tensor made outside the recording")
                recorded.append(view)
                views_in.append((leaf, view))
            elif isinstance(leaf, torch.Tensor):  # a real tensor: a constant of the model file
                if any(leaf is w for w in written):
                    raise UnsupportedInit(f"{func} writes a tensor made outside build_model()")
                recorded.append(Constant(len(self.program.constants)))
                with unset_fake_temporarily():  # a real copy, not a fake one
                    self.program.constants.append(leaf.detach().clone())
            else:
                recorded.append(leaf)
        known = set(self._storage_index)
        out = func(*args, **kwargs)
        outputs, fresh = [], set()
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                is_new = tensor.untyped_storage()._cdata not in known
                view = self.view_of(tensor, create=True)
                outputs.append(view)
                if is_new:
                    fresh.add(view.storage)
        written_views = [view for leaf, view in views_in if any(leaf is w for w in written)]
        overwrites, partial = set(), set()
        for view in written_views:
            whole = func.overloadpacket.__name__ in OVERWRITING_OPS and view.covers(
                self.program.storage_bytes[view.storage])
            (overwrites if whole else partial).add(view.storage)
        overwrites -= partial
        is_view_op = not written_views and not fresh  # only new views of existing storages
        reads = set() if is_view_op else {view.storage for leaf, view in views_in} - overwrites - partial
        self.program.ops.append(RecordedOp(
            func=func, args=recorded, spec=spec, outputs=outputs, fresh=fresh, reads=reads, overwrites=overwrites,
            partial_writes=partial, random=torch.Tag.nondeterministic_seeded in func.tags,
        ))
        return out


    def record_call(self, fn: Callable, tensor: torch.Tensor, *scalars: Any) -> None:
        """Log fn(tensor, *scalars), an in-place random init that cannot be recorded op by op (its ops
        depend on the values it draws), as one op that replay runs for real."""
        if not isinstance(tensor, FakeTensor) or (view := self.view_of(tensor, create=False)) is None:
            raise UnsupportedInit(f"{fn.__name__} on a tensor made outside the recording")
        whole = view.covers(self.program.storage_bytes[view.storage])
        leaves, spec = pytree.tree_flatten(((view, *scalars), {}))
        self.program.ops.append(RecordedOp(
            func=fn, args=leaves, spec=spec, outputs=[view], fresh=set(), reads=set(),
            overwrites={view.storage} if whole else set(), partial_writes=set() if whole else {view.storage},
            random=True,
        ))


@contextlib.contextmanager
def _whole_init_functions(recorder: _Recorder):
    """Record nn.init.trunc_normal_ as one op: it draws until every value lies in [a, b], a loop on the
    values that fake tensors cannot run (torch 2.13). Refuse torch.manual_seed: a build that seeds the
    generator itself would make other numbers than the replay, which seeds it once, before the build."""
    original = nn.init.trunc_normal_
    original_manual_seed = torch.manual_seed

    def manual_seed(seed):
        raise UnsupportedInit(f"build_model() calls torch.manual_seed({seed}) itself")

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        if generator is not None:
            raise UnsupportedInit("trunc_normal_ with an explicit torch.Generator")
        recorder.record_call(original, tensor, mean, std, a, b)
        return tensor

    nn.init.trunc_normal_, torch.manual_seed = trunc_normal_, manual_seed
    try:
        yield
    finally:
        nn.init.trunc_normal_, torch.manual_seed = original, original_manual_seed


def _written_arguments(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors `func` writes to, from its schema's alias annotations (Tensor(a!))."""
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and plain tensor attribute under every name (tied ones under each)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                named[f"{prefix}.{name}" if prefix else name] = value
    return named


def record_init(build_fn: Callable[[], nn.Module]) -> tuple[nn.Module, InitProgram]:
    """build_fn() on fake tensors, its ops recorded; returns the model (on meta, same structure, ties
    kept) and the program. Raises UnsupportedInit (or the model file's own error) when it cannot."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    program = InitProgram()
    recorder = _Recorder(program)
    try:
        with torch.device("cpu"), FakeTensorMode(allow_non_fake_inputs=True), recorder, _whole_init_functions(recorder):
            model = build_fn()
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise UnsupportedInit(f"it reads tensor values ({type(error).__name__})") from error
    if not isinstance(model, nn.Module):
        return model, program  # the caller reports it
    for name, tensor in named_tensors(model).items():
        if isinstance(tensor, FakeTensor):
            view = recorder.view_of(tensor, create=False)
            if view is None:
                raise UnsupportedInit(f"{name} was not made by a recorded op")
            program.outputs[name] = view
    _to_meta(model)
    return model, program


def _to_meta(model: nn.Module) -> None:
    """Replace every fake parameter, buffer and tensor attribute by a meta tensor of the same size,
    stride and dtype; a tensor under several names stays one object."""
    made: dict[int, torch.Tensor] = {}

    def meta(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in made:
            with unset_fake_temporarily():  # a meta tensor even inside another fake mode (the dry run's)
                empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
            made[id(tensor)] = (nn.Parameter(empty, requires_grad=tensor.requires_grad)
                                if isinstance(tensor, nn.Parameter) else empty)
        return made[id(tensor)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if isinstance(tensor, FakeTensor):
                    table[name] = meta(tensor)
        for name, value in list(vars(module).items()):
            if isinstance(value, FakeTensor):
                setattr(module, name, meta(value))


# ---- replaying -----------------------------------------------------------------------------------


@dataclass
class ReplayStats:
    peak_live_bytes: int = 0  # most bytes of replay buffers and scratch tensors alive at once
    ops_run: int = 0
    ops_scratch: int = 0
    ops_skipped: int = 0


@dataclass
class _Schedule:
    """When each op runs and when each storage's buffer comes and goes (indices into program.ops)."""

    modes: list[str]  # per op: "run", "scratch" or "skip"
    release_after: dict[int, set[int]]  # op index (-1: before the first op) -> storages to drop after it
    emit_after: dict[int, list[int]]  # op index (-1: before the first op) -> output storages final then


def _schedule(program: InitProgram, wanted: set[int]) -> _Schedule:
    """Backward liveness over storages (module docstring), then each wanted storage's last write (when
    it is handed out) and last touch (when its buffer goes)."""
    needed = set(wanted)
    modes = ["skip"] * len(program.ops)
    release_after: dict[int, set[int]] = {}
    for index in range(len(program.ops) - 1, -1, -1):
        op = program.ops[index]
        writes = op.fresh | op.overwrites | op.partial_writes
        if writes & needed:
            modes[index] = "run"
            release_after[index] = (writes | op.reads) - needed  # contents nobody reads after this op
            needed -= op.fresh | op.overwrites
            needed |= op.reads | op.partial_writes
        elif op.random:
            modes[index] = "scratch"
            release_after[index] = op.reads - needed
            needed |= op.reads
    last_write: dict[int, int] = {}
    last_touch: dict[int, int] = {}
    for index, op in enumerate(program.ops):
        writes = op.fresh | op.overwrites | op.partial_writes if modes[index] == "run" else set()
        for storage in writes:
            last_write[storage] = index
        for storage in writes | (op.reads if modes[index] != "skip" else set()):
            last_touch[storage] = index
    emit_after: dict[int, list[int]] = {}
    for storage in sorted(wanted):  # wanted storages stay in `needed` to the end: released here
        emit_after.setdefault(last_write.get(storage, -1), []).append(storage)
        release_after.setdefault(last_touch.get(storage, -1), set()).add(storage)
    return _Schedule(modes, release_after, emit_after)


class _Replay:
    """The real CPU buffers of the recorded storages while the program runs, and their byte count."""

    def __init__(self, program: InitProgram):
        self.program = program
        self.buffers: dict[int, torch.UntypedStorage] = {}

    def tensor(self, view: TensorView) -> torch.Tensor:
        """The real tensor of `view`, its storage's buffer allocated (uninitialised, as torch.empty) if
        no op made it yet."""
        if view.storage not in self.buffers:
            nbytes = self.program.storage_bytes[view.storage]
            self.buffers[view.storage] = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
        return torch.empty(0, dtype=view.dtype).set_(self.buffers[view.storage], view.offset, view.size, view.stride)

    def live_bytes(self) -> int:
        return sum(buffer.nbytes() for buffer in self.buffers.values())

    def arguments(self, op: RecordedOp, scratch: bool) -> tuple[tuple, dict, int]:
        """(args, kwargs) of `op` on real tensors; with `scratch`, the tensors it writes are fresh ones of
        the same size, stride and dtype (same RNG draws). Also the bytes of those scratch tensors."""
        leaves, scratch_bytes = [], 0
        for leaf in op.args:
            if isinstance(leaf, Constant):
                leaves.append(self.program.constants[leaf.index].clone())
            elif isinstance(leaf, TensorView) and scratch and leaf.storage in op.overwrites | op.partial_writes:
                leaves.append(torch.empty_strided(leaf.size, leaf.stride, dtype=leaf.dtype))
                scratch_bytes += leaves[-1].untyped_storage().nbytes()
            elif isinstance(leaf, TensorView):
                leaves.append(self.tensor(leaf))
            else:
                leaves.append(leaf)
        args, kwargs = pytree.tree_unflatten(leaves, op.spec)
        return args, kwargs, scratch_bytes

    def adopt(self, view: TensorView, real: torch.Tensor) -> None:
        """Make `real` (a fresh result of a replayed op) the buffer of its recorded storage, copied into the
        recorded layout when the CPU kernel chose another one than the fake one did."""
        nbytes = self.program.storage_bytes[view.storage]
        if (real.dtype == view.dtype and tuple(real.shape) == view.size and tuple(real.stride()) == view.stride
                and real.storage_offset() == view.offset and real.untyped_storage().nbytes() == nbytes):
            self.buffers[view.storage] = real.untyped_storage()
            return
        self.buffers.pop(view.storage, None)
        self.tensor(view).copy_(real)


def replay_init(program: InitProgram, seed: int, wanted: Iterable[str],
                emit: Callable[[str, torch.Tensor], None]) -> ReplayStats:
    """Run `program` on CPU tensors after torch.manual_seed(seed); call emit(name, tensor) once for each
    name in `wanted` with its final value (valid only during the call: copy what you keep). The global
    RNG is left where `torch.manual_seed(seed); build_fn()` leaves it."""
    names_of: dict[int, list[str]] = {}  # storage -> the wanted names that view it
    for name in wanted:
        if name in program.outputs:
            names_of.setdefault(program.outputs[name].storage, []).append(name)
    schedule = _schedule(program, set(names_of))
    replay = _Replay(program)
    stats = ReplayStats()

    def after(index: int) -> None:
        for storage in schedule.emit_after.get(index, ()):
            for name in names_of[storage]:
                emit(name, replay.tensor(program.outputs[name]))
        for storage in schedule.release_after.get(index, ()):
            replay.buffers.pop(storage, None)

    torch.manual_seed(seed)
    with torch.no_grad():
        after(-1)
        for index, op in enumerate(program.ops):
            mode = schedule.modes[index]
            if mode == "skip":
                stats.ops_skipped += 1
                continue
            args, kwargs, scratch_bytes = replay.arguments(op, scratch=mode == "scratch")
            result = op.func(*args, **kwargs)
            real_outputs = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
            for view, real in zip(op.outputs, real_outputs, strict=True):
                if view.storage in op.fresh and mode == "scratch":
                    scratch_bytes += real.untyped_storage().nbytes()  # dropped below
                elif view.storage in op.fresh:
                    replay.adopt(view, real)
            stats.peak_live_bytes = max(stats.peak_live_bytes, replay.live_bytes() + scratch_bytes)
            stats.ops_run += mode == "run"
            stats.ops_scratch += mode == "scratch"
            del args, kwargs, result, real_outputs
            after(index)
    return stats
