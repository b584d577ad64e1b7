"""Activation recompute per block (plan.train.recompute): full (torch.utils.checkpoint around each block's forward)
or selective (torch's selective activation checkpoint: the GEMM outputs kept, the rest recomputed)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zplan.model.modules import transformer_blocks
from zplan.schemas.spec import Recompute


def _save_only_matmuls(ctx, op, *args, **kwargs):
    """Selective-checkpoint policy: keep the GEMM outputs (the Linear projections), recompute the rest.

    What is recomputed is the attention core (QK^T and attention x V as bmm, softmax, or the fused SDPA
    op) and the cheap elementwise ops; the FLOP overhead is the attention core's, as in Megatron's
    selective recompute (Korthikanti et al. 2022, section 4.2), and no (B, heads, T, T) tensor is kept.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    # _scaled_mm: an fp8 block's GEMM (runtime.precision.float8 on fp8 tensor cores; emulated, torchao runs aten.mm)
    saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten._scaled_mm.default)
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_only_matmuls)


def _checkpoint_forward(block: nn.Module, selective: bool) -> None:
    # Replace the block's forward on the instance rather than wrapping the block in another module,
    # so parameter names, the plan's layer names and state-dict keys stay what the model file defines.
    original_forward = block.forward
    extra = {"context_fn": _selective_context} if selective else {}

    def forward(*args, **kwargs):
        return checkpoint(original_forward, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = forward


def apply_recompute(model: nn.Module, mode: Recompute, block_prefix: str) -> nn.Module:
    """Activation recompute per block: 'none'; 'full' keeps only each block's input and reruns the
    block's forward in backward (torch.utils.checkpoint); 'selective' keeps the GEMM outputs and
    recomputes the attention core and elementwise ops (torch's selective activation checkpoint API)."""
    if mode == "none":
        return model
    if mode not in ("full", "selective"):
        raise ValueError(f"recompute mode must be none, selective or full, got {mode!r}")
    for block in transformer_blocks(model, block_prefix):
        _checkpoint_forward(block, selective=mode == "selective")
    return model
