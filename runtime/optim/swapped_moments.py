"""Adam's two moments kept in files and swapped in one sub-group at a time (ZeRO-Infinity, Rajbhandari et al.
SC'21, section 6.2: "optimizer states ... swapped in and out per sub-group during the step").

The tensors an optimizer rank updates ("segments": flat fp32 views, e.g. ZeRO-1's owned rows of each
parameter, or FSDP2's local shards) are read as one sequence of elements and cut into sub-groups of at most
`sub_group_numel` elements; a segment may span sub-groups (each part is a Piece). Sub-group k is one file
holding, back to back, exp_avg of its pieces then exp_avg_sq of its pieces: 2 x 4 x n_k bytes, one
sequential read and one sequential write per step.

    moments = SwappedMoments(engine, [numel_0, numel_1, ...], sub_group_numel)
    moments.sweep(update)     # update(pieces, exp_avg, exp_avg_sq) for each sub-group, in order

A sweep pipelines the sub-groups through three aligned host buffers (slots): while sub-group k is updated,
k+1 is being read and k-1 written, so the disk works while the CPU computes. Host memory for the moments
is those slots only: 3 x 2 x 4 x sub_group_numel bytes (`resident_bytes`), however many parameters there
are. Writes left in flight at the end of a sweep go on behind the next forward and backward; the next
sweep waits for a slot's write before reusing the slot. Before its first write a sub-group's moments are
zero (as torch's AdamW initialises them) and no file exists.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from zplan.runtime.offload.nvme import SwapEngine, aligned_tensor

SLOTS = 3  # sub-groups in host memory at once: being read, being updated, being written


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of segment `segment`, at `offset` in its sub-group's exp_avg (and exp_avg_sq)."""

    segment: int
    start: int
    stop: int
    offset: int


def cut_into_sub_groups(numels: list[int], sub_group_numel: int) -> list[list[Piece]]:
    """The segments' elements in order, cut every `sub_group_numel` elements (the last sub-group may be shorter)."""
    if sub_group_numel < 1:
        raise ValueError(f"sub_group_numel must be >= 1, got {sub_group_numel}")
    groups: list[list[Piece]] = [[]]
    filled = 0
    for segment, numel in enumerate(numels):
        start = 0
        while start < numel:
            if filled == sub_group_numel:
                groups.append([])
                filled = 0
            stop = min(numel, start + sub_group_numel - filled)
            groups[-1].append(Piece(segment, start, stop, filled))
            filled += stop - start
            start = stop
    return [g for g in groups if g]


def sub_groups_of_segments(numels: list[int], segment_groups: list[list[int]]) -> list[list[Piece]]:
    """One sub-group per list of consecutive segment indices, whole segments (e.g. one per FSDP unit)."""
    groups = []
    for segments in segment_groups:
        offsets = [0]
        for s in segments:
            offsets.append(offsets[-1] + numels[s])
        pieces = [Piece(s, 0, numels[s], offset) for s, offset in zip(segments, offsets, strict=False) if numels[s]]
        if pieces:
            groups.append(pieces)
    return groups


def _numel(pieces: list[Piece]) -> int:
    return sum(p.stop - p.start for p in pieces)


class SwappedMoments:
    """exp_avg and exp_avg_sq (fp32) of flat segments of `numels` elements, in files of `engine` named
    `<tag>.sub<k>` (module docstring); `segment_groups`: the sub-groups as lists of whole segments instead of
    cuts every `sub_group_numel` elements. Driven from one thread."""

    def __init__(self, engine: SwapEngine, numels: list[int], sub_group_numel: int, tag: str = "adam",
                 segment_groups: list[list[int]] | None = None):
        self.engine = engine
        self.numels = list(numels)
        self.tag = tag
        self.sub_groups = (sub_groups_of_segments(self.numels, segment_groups) if segment_groups is not None
                           else cut_into_sub_groups(self.numels, sub_group_numel))
        capacity = max((_numel(g) for g in self.sub_groups), default=0)
        self._slots = [aligned_tensor((2 * capacity,), torch.float32) for _ in range(min(SLOTS, len(self.sub_groups)))]
        self._writes: list[Future | None] = [None] * len(self._slots)  # the write in flight from each slot
        self._on_disk = [False] * len(self.sub_groups)

    # ---- what is where ------------------------------------------------------------------------------

    @property
    def resident_bytes(self) -> int:
        """Host bytes the moments take: the slots, whatever the number of parameters."""
        return sum(s.numel() * s.element_size() for s in self._slots)

    @property
    def state_bytes(self) -> int:
        """Bytes of both moments of every segment: what lives in the files."""
        return 2 * 4 * sum(self.numels)

    def file_bytes(self) -> int:
        """Bytes of the moments in files now (written sub-groups; each file also has a 4 KiB header)."""
        self.engine.wait([w for w in self._writes if w is not None])
        records = self.engine.records()
        return sum(records[self._name(k)].nbytes for k, on in enumerate(self._on_disk) if on)

    # ---- the sweep ---------------------------------------------------------------------------------

    def sweep(self, update: Callable[[list[Piece], torch.Tensor, torch.Tensor], bool]) -> None:
        """For each sub-group in order: its moments in host memory, update(pieces, exp_avg, exp_avg_sq) (flat
        fp32 views, n_k elements each, piece i at pieces[i].offset), and, when it returns True, the moments
        written back. Reads run one sub-group ahead; writes go on after the call returns."""
        reads = {0: self._start_read(0)} if self.sub_groups else {}
        for k, pieces in enumerate(self.sub_groups):
            if k + 1 < len(self.sub_groups):
                reads[k + 1] = self._start_read(k + 1)
            self.engine.wait(reads.pop(k))
            exp_avg, exp_avg_sq = self._views(k)
            if update(pieces, exp_avg, exp_avg_sq):
                self._writes[k % len(self._slots)] = self.engine.swap_out(self._name(k), self._buffer(k))
                self._on_disk[k] = True

    def read_all(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(exp_avg, exp_avg_sq) of every segment as new flat host tensors (for a state dict)."""
        out = [(torch.zeros(n), torch.zeros(n)) for n in self.numels]

        def copy_out(pieces, exp_avg, exp_avg_sq) -> bool:
            for p in pieces:
                n = p.stop - p.start
                out[p.segment][0][p.start:p.stop].copy_(exp_avg[p.offset:p.offset + n])
                out[p.segment][1][p.start:p.stop].copy_(exp_avg_sq[p.offset:p.offset + n])
            return False

        self.sweep(copy_out)
        return out

    def write_all(self, values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Replace every segment's moments by `values` (flat, as read_all returns them) and write them out."""
        if [tuple(int(t.numel()) for t in v) for v in values] != [(n, n) for n in self.numels]:
            raise ValueError("write_all: the moments do not match the segments' sizes")

        def copy_in(pieces, exp_avg, exp_avg_sq) -> bool:
            for p in pieces:
                n = p.stop - p.start
                exp_avg[p.offset:p.offset + n].copy_(values[p.segment][0].reshape(-1)[p.start:p.stop])
                exp_avg_sq[p.offset:p.offset + n].copy_(values[p.segment][1].reshape(-1)[p.start:p.stop])
            return True

        self.sweep(copy_in)
        self.engine.wait([w for w in self._writes if w is not None])

    # ---- machinery ---------------------------------------------------------------------------------

    def _name(self, k: int) -> str:
        return f"{self.tag}.sub{k}"

    def _buffer(self, k: int) -> torch.Tensor:
        return self._slots[k % len(self._slots)][:2 * _numel(self.sub_groups[k])]

    def _views(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = _numel(self.sub_groups[k])
        buffer = self._buffer(k)
        return buffer[:n], buffer[n:]

    def _start_read(self, k: int) -> Future:
        pending = self._writes[k % len(self._slots)]
        if pending is not None:  # the slot's previous sub-group is still being written from it
            self.engine.wait(pending)
            self._writes[k % len(self._slots)] = None
        if self._on_disk[k]:
            return self.engine.swap_in(self._name(k), out=self._buffer(k))
        self._buffer(k).zero_()  # never written: Adam's moments start at zero
        done: Future = Future()
        done.set_result(None)
        return done
