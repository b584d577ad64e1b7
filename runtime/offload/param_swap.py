"""ZeRO-Infinity's parameter offload for ZeRO-3 (Rajbhandari et al. SC'21, sections 5-6): FSDP2's sharded
parameters in files, swapped in before their unit's all-gather, the next unit's read prefetched while this
one computes.

FSDP2 with CPUOffloadPolicy keeps each unit's (fully_shard module's) sharded fp32 parameters in host memory:
one flat padded tensor per parameter (FSDPParam._sharded_param_data; the DTensor parameter the optimizer
sees is a view of it). This swapper frees those tensors' storage (resize to 0 bytes, as FSDP frees its
gathered parameters) while the unit is idle and brings it back from its file when FSDP unshards the unit:

    forward   unit u: swap in u (prefetched), all-gather, compute, reshard -> free u; read of u+1 started
    backward  unit u: the same in reverse order, reads of u-1 and u-2 started (FSDP's own backward prefetch
              all-gathers u-1 before u computes, so u-1 must already be on its way)
    step      per unit (the optimizer's sub-group): swap in, update in place, write back, free
The unit where the direction turns stays in memory: the last one after forward (backward starts with it),
the first one after backward and after the step (the next forward starts with it).

Hooked at FSDPParamGroup.unshard and .reshard of each unit (instance attributes that wrap the methods, so
FSDP's own calls and prefetches pass through them). A unit is "clean" when its file holds its current
values: freeing it then needs no write. Only written values are dropped: the first forward's lazy
initialisation may replace a parameter's storage, so nothing is freed before the first reshard. A state
dict (checkpoint, weight export) brings every unit in first; loading one marks every unit dirty, written
back at its next reshard.

Host memory for parameters: the units in use and read ahead (up to three in backward), the two turning
units, and the root unit (embedding, head: FSDP2 keeps the root gathered from forward to backward), instead
of all of them.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch
from torch import nn

from zplan.runtime.offload.nvme import SwapEngine


class _Unit:
    def __init__(self, index: int, module: nn.Module):
        self.index = index
        self.group = module._get_fsdp_state()._fsdp_param_group  # FSDP2's FSDPParamGroup of this unit
        self.fsdp_params = list(self.group.fsdp_params) if self.group is not None else []
        self.data: list[torch.Tensor] = []  # 1-D padded shards, as FSDP holds them after its lazy initialisation
        self.nbytes = [fp.padded_sharded_param_size.numel() * 4 for fp in self.fsdp_params]  # fp32
        self.resident = True
        self.dirty = True  # no file yet
        self.reads: list[Future] = []
        self.writes: list[Future] = []
        self.free_after_write = False

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [fp.sharded_param for fp in self.fsdp_params]


class ParameterSwapper:
    """Swap the sharded parameters of `modules` (fully_shard units, in forward order) to files of `engine`
    (module docstring). Call after the weights are in place; driven from the training thread."""

    def __init__(self, engine: SwapEngine, model: nn.Module, modules: list[nn.Module]):
        self.engine = engine
        self.units = [u for u in (_Unit(i, m) for i, m in enumerate(modules)) if u.fsdp_params]
        self.unit_of = {id(p): u for u in self.units for p in u.parameters}
        self.bytes_swapped_in = 0  # read from files since the start
        self.read_wait_s = 0.0  # seconds the training thread waited for parameter reads since the start
        self._forward_order = {u.index: k for k, u in enumerate(self.units)}
        self.started = False  # at the first unshard: FSDP's lazy initialisation has placed the shards by then
        for unit in self.units:
            self._wrap(unit)
        model.register_state_dict_pre_hook(lambda *_: self.bring_all_in())
        model.register_load_state_dict_pre_hook(lambda *_: self.bring_all_in())
        model.register_load_state_dict_post_hook(lambda *_: self.mark_all_dirty())

    @property
    def file_bytes(self) -> int:
        return sum(sum(u.nbytes) for u in self.units)

    def resident_bytes(self) -> int:
        """Host bytes of sharded parameters held now."""
        return sum(sum(u.nbytes) for u in self.units if u.resident)

    # ---- per unit -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Every unit written to its file (they stay in memory until their first reshard)."""
        for unit in self.units:
            unit.data = [fp._sharded_param_data for fp in unit.fsdp_params]
            self._write(unit)
        self.started = True

    def ensure_resident(self, unit: _Unit) -> None:
        """Unit's parameters in memory (waiting for a prefetch, or reading now)."""
        self.prefetch(unit)
        if unit.reads:
            started = time.perf_counter()
            self.engine.wait(unit.reads)
            self.read_wait_s += time.perf_counter() - started
            unit.reads = []

    def prefetch(self, unit: _Unit) -> None:
        """Start reading `unit` back if it is not in memory."""
        if unit.free_after_write:  # written but not freed yet: still in memory, keep it
            unit.free_after_write = False
        if unit.resident or not self.started:
            return
        for i, data in enumerate(unit.data):
            data.untyped_storage().resize_(data.numel() * data.element_size())
            unit.reads.append(self.engine.swap_in(self._name(unit, i), out=data))
        self.bytes_swapped_in += sum(unit.nbytes)
        unit.resident = True

    def for_update(self, unit: _Unit) -> None:
        """Unit's parameters in memory and no write of them in flight: they may be changed in place."""
        self.ensure_resident(unit)
        self.engine.wait(unit.writes)
        unit.writes = []

    def release(self, unit: _Unit) -> None:
        """Free `unit`'s parameters (written first when dirty; freed once the write is done)."""
        if not unit.resident or not self.started:
            return
        if unit.dirty:
            self._write(unit)
        unit.free_after_write = True
        self.reap()

    def written_back(self, unit: _Unit) -> None:
        """The optimizer updated `unit` in place: write it, and free it when written, except the first unit in
        forward order, which the next forward starts with."""
        unit.dirty = True
        if self._forward_order[unit.index] == 0:
            self._write(unit)
        else:
            self.release(unit)

    def reap(self, wait: bool = False) -> None:
        """Free the released units whose writes are done (`wait`: wait for them all)."""
        for unit in self.units:
            if not unit.free_after_write:
                continue
            if wait:
                self.engine.wait(unit.writes)
            if all(w.done() for w in unit.writes):
                self.engine.wait(unit.writes)  # raises a write error here
                unit.writes = []
                for data in unit.data:
                    data.untyped_storage().resize_(0)
                unit.resident, unit.free_after_write = False, False

    def bring_all_in(self) -> None:
        for unit in self.units:
            self.ensure_resident(unit)

    def mark_all_dirty(self) -> None:
        for unit in self.units:
            unit.dirty = True

    def neighbour(self, unit: _Unit, forward: bool, distance: int = 1) -> _Unit | None:
        k = self._forward_order[unit.index] + (distance if forward else -distance)
        return self.units[k] if 0 <= k < len(self.units) else None

    # ---- machinery ---------------------------------------------------------------------------------

    def _name(self, unit: _Unit, i: int) -> str:
        return f"param.u{unit.index}.{i}"

    def _write(self, unit: _Unit) -> None:
        self.engine.wait(unit.writes)
        unit.writes = [self.engine.swap_out(self._name(unit, i), data) for i, data in enumerate(unit.data)]
        unit.dirty = False

    def _wrap(self, unit: _Unit) -> None:
        group = unit.group
        unshard, reshard = group.unshard, group.reshard
        last = len(self.units) - 1

        def unshard_from_file(async_op: bool = False):
            if not self.started:
                self.start()
            if not group.is_unsharded and group._all_gather_result is None:
                self.ensure_resident(unit)  # before the all-gather reads the shards
                backward = _in_backward()
                # read ahead while this unit computes: the next unit, and in backward the one after it too (FSDP
                # unshards the previous unit early, before this unit's backward, so one ahead would be too late)
                for distance in (1, 2) if backward else (1,):
                    ahead = self.neighbour(unit, forward=not backward, distance=distance)
                    if ahead is not None:
                        self.prefetch(ahead)
            return unshard(async_op)

        def reshard_to_file():
            reshard()
            k = self._forward_order[unit.index]
            turning = k == (0 if _in_backward() else last)  # the unit the other direction starts with: keep it
            if group.is_sharded and not turning:  # FSDP let the gathered parameters go: the shards may go too
                self.release(unit)

        group.unshard, group.reshard = unshard_from_file, reshard_to_file


def _in_backward() -> bool:
    """Inside autograd's backward pass (as FSDP2 tells its forward from its backward)."""
    return torch._C._current_graph_task_id() != -1
