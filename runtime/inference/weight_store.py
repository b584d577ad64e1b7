"""Where the engine finds each block's weights: the interface between the engine and the weight tiers.

A forward pass (prefill, each decode step, an uncached forward) asks for layer 0, 1, ..., L-1 in order with
layer(i) and says done(i) when it has finished computing with it, so a streaming store (runtime.inference.
zero_inference.StreamedWeights: host memory or NVMe, ZeRO-Inference) can fetch layer i+1.. while i computes and
free i afterwards. A layer is a flat dict of tensors ("qkv.weight", "o.bias", "up.qweight", "up.scales", ...; the
names are runtime.inference.decoder's).
"""

from __future__ import annotations

from typing import Protocol

import torch


class WeightStore(Protocol):
    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's packed tensors on the compute device (blocks until they are there)."""

    def done(self, i: int) -> None:
        """The engine finished layer i's compute for this pass."""

    def nbytes(self) -> int:
        """Bytes of all layers as stored."""

    def close(self) -> None: ...


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (also for oneDNN-packed tensors, whose storage cannot be asked)."""
    return t.numel() * t.element_size()


class ResidentWeights:
    """Every layer already on the compute device."""

    def __init__(self, layers: list[dict[str, torch.Tensor]]):
        self.layers = layers

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        return self.layers[i]

    def done(self, i: int) -> None:
        pass

    def nbytes(self) -> int:
        return sum(tensor_bytes(t) for layer in self.layers for t in layer.values())

    def close(self) -> None:
        self.layers = []
