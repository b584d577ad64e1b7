"""Create the model's weights so that every run of a plan starts from the same numbers.

Contract: the weights equal a single process's `torch.manual_seed(seed); build_fn()`, whatever the
plan, so a run under any plan can be compared with a single-process run.

How, for now: every rank builds the whole model on the CPU under the same seed and moves it to its
device; the parallel steps that follow (fully_shard, ...) keep only each rank's shard. Why not build
on the meta device, then `to_empty()` and each module's `reset_parameters()`: model files initialise
in their own way (nanoGPT's `_init_weights` with a scaled init of the residual projections), which
reset_parameters does not reproduce, and the CPU generator (Mersenne Twister) cannot skip ahead to a
shard's part of the random stream, so a rank cannot make only its shard of the same numbers. The cost
is that the full model must fit in host memory once per process; shard-by-shard materialisation
(each parameter generated in turn and cut to the rank's shard at once) lands with the runtime issue (#3).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zplan.errors import ModelLoadError


def build_model(build_fn: Callable[[], nn.Module], seed: int, device: torch.device | str) -> nn.Module:
    """The model of `build_fn` with the weights of `torch.manual_seed(seed); build_fn()`, on `device`."""
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = build_fn()
    if not isinstance(model, nn.Module):
        raise ModelLoadError(f"build_model() returned {type(model).__name__}, not a torch.nn.Module")
    return model.to(device)
