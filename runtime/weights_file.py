"""Write the trained weights as one consolidated file, whatever the plan sharded or wrapped.

For comparing a run with a single process (train.py --save-weights) and for small models: every shard
is gathered to rank 0 (torch.distributed.checkpoint.state_dict with full_state_dict), so the whole
model passes through rank 0's host memory. For large models, save a checkpoint (runtime.checkpoint)
and consolidate it with `zplan export`, which streams it in chunks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from zplan.runtime.distributed import RunContext
from zplan.runtime.fused_layout import stored_layouts, to_original_state
from zplan.runtime.outputs import write_atomically


def save_full_weights(model: nn.Module, path: str | Path, ctx: RunContext) -> None:
    """torch.save {parameter name: full CPU tensor} on rank 0, atomically (runtime.outputs); names as the model
    file defines them (no DDP 'module.' prefix). Every rank must call it: gathering the shards is a collective."""
    from zplan.runtime.pipeline import PipelineRun, gather_full_state_dict

    if isinstance(model, PipelineRun):  # each pipeline rank holds its stages: gather them to rank 0
        state = gather_full_state_dict(model)
    else:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        state = to_original_state(state, stored_layouts(model))  # fused projections in the model file's order
    if ctx.is_main:  # written beside, then renamed: a full disk or a kill leaves the previous file whole
        size = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
        write_atomically(path, lambda tmp: torch.save(state, tmp), size_hint_bytes=size)
