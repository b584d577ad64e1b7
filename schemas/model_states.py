"""How the runtime holds the model states, by ZeRO stage and precision: read by the planner's memory model
(planner.cost.memory) and by the runtime (runtime.parallel.data_parallel), so that what is priced is what runs."""

from __future__ import annotations

from zplan.schemas.spec import compute_dtype


def parameters_in_compute_dtype(zero_stage: int, precision: str, grad_compression: str = "none") -> bool:
    """True where mixed precision keeps the parameters (and so their gradients) in the 16-bit compute dtype and the
    fp32 master weights in the optimizer: ZeRO 0/1 (runtime.optim.layouts.RowShards, the ZeRO paper's layout, 2 + 2 +
    12 bytes per parameter before sharding). False in fp32 and under ZeRO 2/3, where FSDP2 keeps fp32 shards (the
    masters) and casts 16-bit copies for compute (MixedPrecisionPolicy), and with 1-bit Adam, which steps fp32
    parameters under autocast (runtime.compression.grad_compression)."""
    return zero_stage <= 1 and compute_dtype(precision) in ("bf16", "fp16") and grad_compression != "1bit"
