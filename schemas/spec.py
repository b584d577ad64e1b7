"""What the user asks for: the training spec and the pins that fix parts of the plan."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

Precision = Literal["bf16", "fp16", "fp32", "fp8", "nvfp4"]
Recompute = Literal["none", "selective", "full"]
Tier = Literal["none", "cpu", "nvme"]
GradCompression = Literal["none", "int8", "1bit"]
WeightCompression = Literal["none", "int8"]
ActivationCompression = Literal["none", "int8"]


def compute_dtype(precision: str) -> str:
    """The floating-point dtype of all but the fp8 / fp4 GEMMs: fp8 training (torchao float8, Transformer Engine)
    casts the inputs and weights of the blocks' Linears to fp8 for their GEMMs, nvfp4 training
    (runtime/precision/nvfp4.py)
    quantises them to NVFP4, and both keep everything else (parameters, gradients, activations, attention, the head)
    as in bf16 mixed precision."""
    return "bf16" if precision in ("fp8", "nvfp4") else precision


class TrainSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    global_batch: int = Field(gt=0, description="Sequences per optimizer step, over all data-parallel ranks.")
    seq_len: int = Field(gt=0, description="Tokens per sequence.")
    precision: Precision = Field(description="Compute precision; bf16/fp16 keep fp32 master weights; fp8 runs the "
                                 "blocks' Linear GEMMs in fp8 with dynamic scaling and all else as bf16; nvfp4 runs "
                                 "them in NVFP4 (e2m1, e4m3 scale per 16 elements, fp32 per tensor) and all else as "
                                 "bf16.")


class CompressionConfig(BaseModel):
    """Compressed communication (`--compress grad=int8,weights=int8,act=int8`); planner.compression checks what
    each option needs, planner.cost.compression prices it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    grad: GradCompression = Field(default="none", description="Data-parallel gradients: int8 (a compressed "
                                  "all-reduce of DDP's buckets, ZeRO 0/1 with tp = 1) or 1bit (1-bit Adam, Tang et "
                                  "al. 2021: the momentum all-reduced as signs after an exact warm-up; ZeRO 0, or "
                                  "ZeRO 1 with the gradients compressed; tp = pp = 1, no offload).")
    weights: WeightCompression = Field(default="none", description="ZeRO-3 parameter all-gathers in int8 (ZeRO++ "
                                       "qwZ, Wang et al. 2023); needs ZeRO 3.")
    activations: ActivationCompression = Field(default="none", description="Hidden states and their gradients "
                                               "between pipeline stages in int8; needs pp > 1.")

    @property
    def enabled(self) -> bool:
        """Anything compressed."""
        return (self.grad, self.weights, self.activations) != ("none", "none", "none")

    def as_option(self) -> str:
        """The `--compress` value that gives this config ('none' when nothing is compressed)."""
        parts = [f"{key}={value}" for key, value in
                 (("grad", self.grad), ("weights", self.weights), ("act", self.activations)) if value != "none"]
        return ",".join(parts) or "none"


# Sequences per optimizer step at most (zplan.api checks --global-batch against it): far beyond any run (GPT-3 trained
# on 1536 sequences per step), and small enough that every search over it ends in seconds.
MAX_GLOBAL_BATCH = 1 << 24


class Pins(BaseModel):
    """Choices the user fixed; None leaves the choice to the search."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tp: Optional[int] = Field(default=None, gt=0, description="Tensor-parallel degree.")
    pp: Optional[int] = Field(default=None, gt=0, description="Pipeline-parallel degree.")
    dp: Optional[int] = Field(default=None, gt=0, description="Data-parallel degree.")
    cp: Optional[int] = Field(default=None, gt=0, description="Context-parallel degree (each sequence split over cp "
                                                              "GPUs).")
    ep: Optional[int] = Field(default=None, gt=0, description="Expert-parallel degree: a mixture of experts' routed "
                              "experts split over ep of the data-parallel ranks (E / ep each).")
    zero: Optional[Literal[0, 1, 2, 3]] = Field(default=None, description="ZeRO stage.")
    offload: Optional[Tier] = Field(default=None, description="Where the optimizer states live: none = GPU, cpu, "
                                    "nvme (ZeRO >= 1); parameters and gradients follow where they do not fit.")
    micro_batch: Optional[int] = Field(default=None, gt=0, le=MAX_GLOBAL_BATCH, description="Sequences per "
                                       "micro-batch (at most 2^24, the largest global batch).")
    recompute: Optional[Recompute] = Field(default=None, description="Activation recompute mode.")
    sequence_parallel: Optional[bool] = Field(default=None, description="Megatron sequence parallelism.")
    interleave: Optional[int] = Field(default=None, gt=0, description="Model chunks per pipeline stage.")
    compress: Optional[CompressionConfig] = Field(default=None, description="Compressed communication "
                                                  "(--compress); the search keeps the configurations that support "
                                                  "it. None: nothing compressed.")


# The optimizer the emitted train.py runs unless overridden on its command line (--lr): AdamW with torch's betas
# and eps, decoupled weight decay on matrices only, gradients clipped to this global norm. train.py renders these
# values and runtime.optim.build.build_optimizer passes them on; ds_config.json says the same
# (tests/unit/test_ds_config).
ADAMW_DEFAULTS = {"lr": 3.0e-4, "betas": (0.9, 0.999), "eps": 1.0e-8, "weight_decay": 0.1}
GRAD_CLIP = 1.0
# 1-bit Adam's exact AdamW steps before it compresses: runtime OneBitGradients' default warmup_steps (DeepSpeed's
# freeze_step in ds_config.json).
ONE_BIT_WARMUP_STEPS = 100
