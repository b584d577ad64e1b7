"""Write the trained weights as one consolidated file, whatever the plan sharded or wrapped.

For comparing a run with a single process (train.py --save-weights) and for small models: every shard
is gathered to rank 0 (torch.distributed.checkpoint.state_dict with full_state_dict), so the whole
model passes through rank 0's host memory. For large models, save a checkpoint (runtime.checkpoint.save)
and consolidate it with `zplan export`, which streams it in chunks.

The format follows the suffix (runtime.launch.arguments.WEIGHTS_SUFFIXES): FILE.safetensors is safetensors
(model/safetensors_format.py; transformers and safetensors.torch.load_file read it), FILE.pt / FILE.bin a torch.save
dict {name: tensor} (torch.load(weights_only=True) reads it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from zplan.errors import OutputError
from zplan.model.fused_layout import stored_layouts, to_original_state
from zplan.model.safetensors_format import write_safetensors
from zplan.runtime.launch.arguments import WEIGHTS_SUFFIXES
from zplan.runtime.launch.distributed import RunContext
from zplan.runtime.optim.layouts import with_master_weights
from zplan.runtime.parallel.pipeline import PipelineRun, gather_full_state_dict
from zplan.runtime.training.outputs import write_atomically


def _full_on_host(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (collective over its mesh), on the host."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()


def save_full_weights(model: nn.Module, path: str | Path, ctx: RunContext,
                      optimizer: torch.optim.Optimizer | None = None) -> None:
    """{parameter name: full CPU tensor} as safetensors or torch.save (by `path`'s suffix) on rank 0, atomically
    (runtime.training.outputs); names as the model file defines them (no DDP 'module.' prefix), tied weights under
    each name; a 16-bit parameter's fp32 master where `optimizer` keeps one (runtime.optim.layouts). Every rank must
    call it: gathering the shards is a collective. OutputError, before any collective, for another suffix."""
    if not str(path).endswith(WEIGHTS_SUFFIXES):
        raise OutputError(f"cannot write the weights to {path}: name a .safetensors file (or .pt / .bin for a "
                          "torch.save state dict)")
    if isinstance(model, PipelineRun):  # each pipeline rank holds its stages: gather them to rank 0
        state = gather_full_state_dict(model, optimizer)
    else:
        local, _ = with_master_weights(get_model_state_dict(model), optimizer)
        state = {}
        for name, tensor in local.items():  # each gathered by every rank (collective), kept by rank 0
            full = _full_on_host(tensor)
            if ctx.is_main:
                state[name] = full
        state = to_original_state(state, stored_layouts(model))  # fused projections in the model file's order
    if ctx.is_main:  # written beside, then renamed: a full disk or a kill leaves the previous file whole
        size = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
        if str(path).endswith(".safetensors"):
            tensors = {name: tensor for name, tensor in state.items() if isinstance(tensor, torch.Tensor)}
            write_atomically(path, lambda tmp: write_safetensors(tmp, tensors), size_hint_bytes=size)
        else:
            write_atomically(path, lambda tmp: torch.save(state, tmp), size_hint_bytes=size)
