"""What the user asks for: the training spec and the pins that fix parts of the plan."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

Precision = Literal["bf16", "fp16", "fp32"]
Recompute = Literal["none", "selective", "full"]
Tier = Literal["none", "cpu", "nvme"]


class TrainSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    global_batch: int = Field(gt=0, description="Sequences per optimizer step, over all data-parallel ranks.")
    seq_len: int = Field(gt=0, description="Tokens per sequence.")
    precision: Precision = Field(description="Compute precision; bf16/fp16 keep fp32 master weights.")


class Pins(BaseModel):
    """Choices the user fixed; None leaves the choice to the search."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tp: Optional[int] = Field(default=None, gt=0, description="Tensor-parallel degree.")
    pp: Optional[int] = Field(default=None, gt=0, description="Pipeline-parallel degree.")
    dp: Optional[int] = Field(default=None, gt=0, description="Data-parallel degree.")
    zero: Optional[Literal[0, 1, 2, 3]] = Field(default=None, description="ZeRO stage.")
    offload: Optional[Tier] = Field(default=None, description="Where optimizer states (and with ZeRO-3 "
                                    "parameters) live: none = GPU, cpu, nvme.")
    micro_batch: Optional[int] = Field(default=None, gt=0, description="Sequences per micro-batch.")
    recompute: Optional[Recompute] = Field(default=None, description="Activation recompute mode.")
    sequence_parallel: Optional[bool] = Field(default=None, description="Megatron sequence parallelism.")
    interleave: Optional[int] = Field(default=None, gt=0, description="Model chunks per pipeline stage.")
