"""Published measured training runs (../shared/reference: published_runs.csv, training_runs.csv) as zplan requests.

    runs, refused = load_reference_runs(reference_dir)   # ReferenceRun each, and {row label: reason} for the rest

A row is expressible when zplan can state its configuration: a built-in profile for its GPU, a precision the cost
model prices (bf16 / fp16 mixed, fp8 in any of its scalings, NVFP4), the parallel layout and global batch printed
(dp = gpus / (tp * pp * cp)), and a measured time: the iteration time, else tokens/s per GPU, else TFLOP/s per GPU
with the FLOPs formula the source names
(Narayanan et al. SC'21 Eq. 3 for Megatron 2021 and DeepSpeed: counts the recomputed forward; Megatron-LM's README
counts model FLOPs, 72 B s l h^2 (1 + s/(6h) + V/(12 h l)), Korthikanti et al. 2023; NeMo's Llama rows count
B s L h^2 (12 + 12 G/A + 18 F/h + 12 s/h + 6 V/(L h)), its nemo/utils/flops_formulas.py). Each row's software stack (the
`stack` key) is named from its source and data-parallel column; the validation fits a few constants per stack
(benchmarks/validate_cost_model.py), nothing per row. NeMo's virtual pipeline size (VP=N in the notes) is pinned as
the interleave; where it does not split the blocks evenly (Llama 3.1 405B's 126 blocks), zplan counts the embedding
and the head as a block each, as Megatron-Core's recipes do (planner.search.interleaved_partition).
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from zplan.schemas.spec import Pins

GPU_CLUSTERS = [  # (pattern in gpu_type, built-in profile)
    (r"^A100 40GB", "dgx-a100-40g"),
    (r"^A100", "dgx-a100-80g"),  # 80GB, Azure NDm v4 (80GB), Selene; "memory not stated": the common 80GB
    (r"^H100", "dgx-h100"),
    (r"^H200", "dgx-h200"),
    (r"^B200", "dgx-b200"),
    (r"^GB200", "gb200-nvl72"),
    (r"^GB300", "gb300-nvl72"),
    (r"^V100", "dgx2-v100"),
]
PRICED_PRECISIONS = ("bf16", "fp16", "not printed (fp16/bf16 mixed)", "")


@dataclass(frozen=True)
class ReferenceRun:
    label: str  # source: model, GPUs
    source: str
    stack: str  # megatron-2021, megatron-core, deepspeed, fsdp1, fsdp2
    spec: str  # family spec (planner/family.py)
    cluster: str
    gpus: int
    global_batch: int
    precision: str
    pins: Pins
    measured_s: float  # iteration time


def stack_of(source: str, data_parallel: str) -> str:
    if "FSDP2" in source or "FSDP2" in data_parallel:
        return "fsdp2"
    if "FSDP1" in data_parallel or "fms-fsdp" in source or "llm-foundry" in source:
        return "fsdp1"
    if source == "DeepSpeed":
        return "deepspeed"
    if "Korthikanti" in source or "Narayanan" in source:
        return "megatron-2021"
    return "megatron-core"


def zero_stage(data_parallel: str) -> tuple[int, str]:
    """(ZeRO stage, offload) of a row's data-parallel column."""
    text = data_parallel.lower()
    offload = "cpu" if "offload" in text and "capability" not in text else "none"
    if "shard_grad_op" in text:
        return 2, offload
    if any(word in text for word in ("full_shard", "fsdp", "zero-3", "hsdp", "zero-powered")):
        return 3, offload
    if "distributed optimizer" in text and "not stated" not in text:
        return 1, offload
    return 0, offload


def _int(value: str) -> int | None:
    return int(float(value)) if value.strip() else None


def family_spec(row: dict) -> str:
    heads, kv = int(row["heads"]), _int(row.get("kv_heads", "")) or int(row["heads"])
    hidden = int(row["hidden"])
    ffn = _int(row.get("ffn", "")) or 4 * hidden
    vocab = _int(row.get("vocab", "")) or 51200  # GPT-3 / Nemotron rows print none: GPT-3's (padded) vocabulary
    llama = kv != heads or "llama" in row["model"].lower() or ffn != 4 * hidden
    family = "llama" if llama else "gpt"
    spec = f"{family}:layers={row['layers']},hidden={hidden},heads={heads},seq={row['seq_len']},vocab={vocab},ffn={ffn}"
    return spec + (f",kv_heads={kv}" if family == "llama" else "")


def measured_seconds(row: dict, gpus: int, batch: int) -> float | None:
    """Iteration time from what the row prints (module docstring); None when it prints no time basis."""
    s, L, h = int(row["seq_len"]), int(row["layers"]), int(row["hidden"])
    V = _int(row.get("vocab", "")) or 51200
    if row.get("iter_time_s", "").strip():
        return float(row["iter_time_s"])
    if row.get("tokens_per_s_per_gpu", "").strip():
        return batch * s / (float(row["tokens_per_s_per_gpu"]) * gpus)
    if not row.get("tflops_per_gpu", "").strip():
        return None
    if row["source"] == "DeepSpeed" or "Narayanan" in row.get("citation", row["source"]):
        flops = 96 * batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))  # Narayanan SC'21 Eq. 3
    elif row["source"] == "NVIDIA/Megatron-LM":
        flops = 72 * batch * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))  # model FLOPs
    elif "NeMo" in row["source"] and row.get("kv_heads", "").strip():  # NeMo's Llama model FLOPs
        # nemo/utils/flops_formulas.py llama2 / llama3: B s L h^2 (12 + 12 G/A + 18 F/h + 12 s/h + 6 V/(L h))
        groups, heads, ffn = int(row["kv_heads"]), int(row["heads"]), int(row["ffn"])
        flops = batch * s * L * h * h * (12 + 12 * groups / heads + 18 * ffn / h + 12 * s / h + 6 * V / (L * h))
    else:
        return None
    return flops / (float(row["tflops_per_gpu"]) * 1e12 * gpus)


def cluster_of(gpu_type: str) -> str | None:
    return next((name for pattern, name in GPU_CLUSTERS if re.search(pattern, gpu_type)), None)


def training_run(row: dict, label: str) -> ReferenceRun | str:
    """The row as a ReferenceRun, or the reason zplan cannot express it."""
    cluster = cluster_of(row["gpu_type"])
    precision = row["precision"].lower()
    if cluster is None:
        return f"no built-in profile for {row['gpu_type']}"
    nvfp4 = precision == "nvfp4"  # NVIDIA's NVFP4 recipe (Transformer Engine): the block GEMMs in NVFP4
    if "fp4" in precision and not nvfp4:
        return f"precision {row['precision']} (of the fp4 formats only NVFP4 is priced)"
    fp8 = "fp8" in precision  # FP8 delayed/current scaling (Transformer Engine), MXFP8 (Blackwell): fp8 GEMMs
    mixed = any(p and p in precision for p in PRICED_PRECISIONS[:3]) or precision in PRICED_PRECISIONS
    if not (fp8 or nvfp4 or mixed):
        return f"precision {row['precision']}"
    if "lora" in row["model"].lower():
        return "LoRA fine-tuning (not pre-training)"
    if not all(row[key].strip() for key in ("layers", "hidden", "heads", "seq_len")):
        return "model shape not printed"
    gpus = int(row["gpus"])
    tp, pp, batch = _int(row["tp"]), _int(row["pp"]), _int(row["global_batch"])
    cp = _int(row.get("cp", "")) or 1
    if tp is None or pp is None or batch is None:
        return "layout or global batch not printed"
    if gpus % (tp * pp * cp) or batch % (gpus // (tp * pp * cp)):
        return "layout inconsistent with the GPU count or batch"
    measured = measured_seconds(row, gpus, batch)
    if measured is None:
        return "no measured time basis"
    zero, offload = zero_stage(row["zero_or_fsdp"])
    recompute = row["recompute"].lower()
    mode = "full" if recompute.startswith("full") else "selective" if "selective" in recompute else "none"
    micro = _int(row["micro_batch"])
    dp = gpus // (tp * pp * cp)
    virtual = re.search(r"\bVP=([1-9]\d*)", row["notes"])  # NeMo's virtual pipeline size: model chunks per stage
    pins = Pins(tp=tp, pp=pp, dp=dp, cp=cp, zero=zero if dp > 1 else 0, offload=offload, micro_batch=micro,
                recompute=mode, sequence_parallel=False if tp == 1 else None,
                interleave=int(virtual.group(1)) if virtual and pp > 1 else None)
    dtype = "fp16" if cluster == "dgx2-v100" else "fp8" if fp8 else "nvfp4" if nvfp4 else "bf16"
    return ReferenceRun(label, row["source"], stack_of(row["source"], row["zero_or_fsdp"]), family_spec(row), cluster,
                        gpus, batch, dtype, pins, measured)


def published_run(row: dict, label: str) -> ReferenceRun:
    """published_runs.csv (Megatron 2021-22 on Selene): Eq. 3 or the measured time; blank recompute is full."""
    recompute = row["recompute"] or "full"
    gpus, batch = int(row["gpus"]), int(row["global_batch"])
    pins = Pins(tp=int(row["tp"]), pp=int(row["pp"]), dp=int(row["dp"]), zero=0,
                micro_batch=_int(row["micro_batch"]), recompute="full" if recompute == "full" else "selective",
                sequence_parallel="sequence" in recompute, interleave=_int(row["interleave_v"]) or 1, offload="none")
    measured = float(row["iter_time_s"]) if row["iter_time_s"] else measured_seconds(
        {**row, "source": "DeepSpeed"}, gpus, batch)  # Eq. 3, as the paper counts
    # Megatron-LM in 2021-22 ran attention unfused (a fused softmax over materialised (s, s) scores) and dropout.
    spec = "gpt:layers={layers},hidden={hidden},heads={heads},seq={seq_len},vocab={vocab},unfused_attention=1".format(
        **row)
    return ReferenceRun(label, row["source"], "megatron-2021", spec, "dgx-a100-80g", gpus, batch, "bf16", pins,
                        measured)


def load_reference_runs(reference_dir: Path) -> tuple[list[ReferenceRun], dict[str, str]]:
    runs, refused = [], {}
    for index, row in enumerate(csv.DictReader((reference_dir / "published_runs.csv").open())):
        runs.append(published_run(row, f"published#{index}: {row['model']}, {row['gpus']} GPUs"))
    for index, row in enumerate(csv.DictReader((reference_dir / "training_runs.csv").open())):
        label = f"training#{index}: {row['source']}: {row['model']}, {row['gpus']} GPUs"
        run = training_run(row, label)
        if isinstance(run, str):
            refused[label] = run
        else:
            runs.append(run)
    return runs, refused
