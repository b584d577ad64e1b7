"""Published measured serving runs (../shared/reference/serving_runs.csv) as zplan serving requests.

    runs, refused = load_serving_runs(reference_dir)   # ServingRun each, and {row label: reason} for the rest

Each row of TensorRT-LLM's performance overview becomes what planner/inference/throughput.py needs: the model as a
family spec of its published shape, the built-in cluster profile of its GPU, tp, the numerics, the batch condition
and input / output lengths, and the measured metric:
- 'TensorRT-LLM perf-overview (v0.9.0)', "Peak Throughput": gptSessionBenchmark, static batching of B requests
  (condition 'static', metric output tokens/s = the printed per-GPU figure x tp);
- the same source, "Low Latency": first-token latency at batch 1, one output token (condition 'ttft', metric s);
- 'TensorRT-LLM perf-overview (current)': trtllm-bench at an unbounded request rate with in-flight batching
  (condition 'max load', the engine's largest batch as printed, 8192, and the number of requests from the notes,
  all of the same printed lengths (stdev 0); metric total output tokens/s).

Numerics: FP16 rows are what zplan's own engine runs (fp16 weights, KV cache and GEMMs). FP8 rows run on zplan's
own fp8 numerics (throughput.numerics_for("fp8", "bf16"): W8A8 block Linears, fp8 weights at 1 byte plus one fp32
scale per output channel, activations cast per token, the block GEMMs at the GPU's fp8 peak; attention, the lm_head,
activations and the other GEMMs in bf16 -- what runtime/inference/fp8.py runs and planner/inference/cost.py
prices), with what zplan's engine does not do stated as TensorRT-LLM's condition (TRTLLM_FP8_KV): an fp8 KV cache,
1 byte per element, and the fp8 attention kernels that read it (FP8 context FMHA, XQA), attention at the fp8 peak.
The fp8 KV cache is implied by the v0.9.0 rows themselves: Llama 2 7B at batch 896 with
128 + 128 tokens needs 117 GB of 16-bit KV cache on an 80 GB H100, 59 GB at 1 byte; the current rows'
nvidia/*-FP8 checkpoints quantize the KV cache too (kv_cache_quant_algo FP8). (TensorRT-LLM scales its fp8
weights per tensor, zplan per output channel: 4 bytes per row more, under 0.1 % of the weight bytes.) A row whose
GPU has no fp8 peak in its profile, or no built-in profile, is refused.

Each row's engine (the `engine` key: TensorRT-LLM v0.9.0, TensorRT-LLM 1.0 PyTorch backend) and condition are
named so the validation (benchmarks/validate_serving.py) can fit a small set of named efficiencies; nothing per row.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, replace
from pathlib import Path

from zplan.planner.clusters import load_cluster
from zplan.planner.family import family_summary
from zplan.planner.inference.cost import InferenceModel
from zplan.planner.inference.throughput import Numerics, numerics_for

# Published shapes: Touvron et al. 2023 (Llama 2, Table 1 and the released configs), Dubey et al. 2024 (Llama 3,
# Table 3). seq = the context length each was released with.
MODEL_SPECS = [  # (pattern in the model column, family spec)
    (r"^Llama 2 7B", "llama:layers=32,hidden=4096,heads=32,kv_heads=32,ffn=11008,vocab=32000,seq=4096"),
    (r"^Llama 2 13B", "llama:layers=40,hidden=5120,heads=40,kv_heads=40,ffn=13824,vocab=32000,seq=4096"),
    (r"^Llama 2 70B", "llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=32000,seq=4096"),
    (r"^Llama 3(\.\d)? 8B", "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,seq=131072"),
    (r"^Llama 3(\.\d)? 70B", "llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=128256,seq=131072"),
    (r"^Llama 3(\.\d)? 405B", "llama:layers=126,hidden=16384,heads=128,kv_heads=8,ffn=53248,vocab=128256,"
                              "seq=131072"),
]
GPU_CLUSTERS = [  # (pattern in gpu_type, built-in profile)
    (r"^A100", "dgx-a100-80g"),  # "memory not stated": the common 80GB
    (r"^H100", "dgx-h100"),
    (r"^H200", "dgx-h200"),
    (r"^L40S", "l40s-8"),
]
# the part of the FP8 rows zplan's engine does not run: the fp8 KV cache, and the fp8 attention kernels that read it
# (TensorRT-LLM's FP8 context FMHA and XQA generation kernels run on an fp8 KV cache)
TRTLLM_FP8_KV = "TensorRT-LLM's fp8 KV cache and fp8 attention"
MAX_LOAD_BATCH = re.compile(r"batch up to (\d+)")
REQUESTS = re.compile(r"(\d+) requests")


@dataclass(frozen=True)
class ServingRun:
    label: str
    source: str
    engine: str  # 'trtllm-0.9' | 'trtllm-1.0'
    spec: str  # family spec (planner/family.py)
    cluster: str
    tp: int
    precision: str  # 'fp16' | 'fp8' (zplan's fp8 W8A8, with TensorRT-LLM's fp8 KV cache: TRTLLM_FP8_KV)
    condition: str  # 'static' | 'max load' | 'ttft'
    batch: int  # static batch B; max load: the engine's largest batch; ttft: 1
    requests: int  # max load: requests sent (all at once, fixed lengths); else the batch
    input_len: int
    output_len: int
    metric: str  # 'tokens_per_s' (output tokens/s of the tp GPUs) | 'ttft_s'
    measured: float

    def model(self) -> InferenceModel:
        return InferenceModel.from_summary(family_summary(self.spec, None, "bf16"))

    def numerics(self) -> Numerics:
        cluster = load_cluster(self.cluster)
        if self.precision == "fp8":
            return fp8_numerics(self.model(), self.tp, cluster)
        return numerics_for(self.precision, self.precision, self.model(), self.tp, cluster)


def fp8_numerics(model: InferenceModel, tp: int, cluster) -> Numerics:
    """zplan's fp8 W8A8 (bf16 compute) with TensorRT-LLM's fp8 KV cache (module docstring)."""
    own = numerics_for("fp8", "bf16", model, tp, cluster)
    return replace(own, name=f"{own.name}; {TRTLLM_FP8_KV}", kv_bytes=1.0,
                   attention_peak_flops=cluster.gpu.peak_fp8_flops)


def _first(patterns, text: str) -> str | None:
    return next((value for pattern, value in patterns if re.search(pattern, text)), None)


def engine_of(source: str) -> str:
    return "trtllm-0.9" if "v0.9.0" in source else "trtllm-1.0"


def serving_run(row: dict, label: str) -> ServingRun | str:
    """The row as a ServingRun, or the reason zplan cannot express it."""
    spec = _first(MODEL_SPECS, row["model"])
    if spec is None:
        return f"no published shape for {row['model']}"
    cluster = _first(GPU_CLUSTERS, row["gpu_type"])
    if cluster is None:
        return f"no built-in profile for {row['gpu_type']}"
    precision = row["precision"].strip().lower()
    if precision.startswith("fp8"):
        if load_cluster(cluster).gpu.peak_fp8_flops <= 0:
            return f"fp8 on {row['gpu_type']}, whose profile has no fp8 peak"
        precision = "fp8"
    elif precision not in ("fp16", "bf16"):
        return f"precision {row['precision']}"
    tp, gpus = int(row["tp"]), int(row["gpus"])
    if gpus != tp:
        return f"{gpus} GPUs with tp={tp} (replicas or pipeline stages not printed)"
    inp, out = int(row["input_len"]), int(row["output_len"])
    what = row["batch_or_concurrency"].strip()
    if what.startswith("max load"):
        found = MAX_LOAD_BATCH.search(what)
        if found is None:
            return "max load without the engine's largest batch"
        sent = REQUESTS.search(row["notes"])
        if sent is None:
            return "max load without the number of requests"
        condition, batch, requests = "max load", int(found.group(1)), int(sent.group(1))
    elif what.isdigit():
        batch = int(what)
        condition = "ttft" if row["ttft_ms"].strip() and not row["tokens_per_s_total"].strip() else "static"
        requests = batch
    else:
        return f"batch condition {what!r}"
    if condition == "ttft":
        if batch != 1:
            return "first-token latency at a batch above 1"
        metric, measured = "ttft_s", float(row["ttft_ms"]) / 1e3
    elif row["tokens_per_s_total"].strip():
        metric, measured = "tokens_per_s", float(row["tokens_per_s_total"])
    else:
        return "no measured metric"
    return ServingRun(label=label, source=row["source"], engine=engine_of(row["source"]), spec=spec, cluster=cluster,
                      tp=tp, precision=precision, condition=condition, batch=batch, requests=requests,
                      input_len=inp, output_len=out, metric=metric, measured=measured)


def load_serving_runs(reference_dir: Path) -> tuple[list[ServingRun], dict[str, str]]:
    runs, refused = [], {}
    for index, row in enumerate(csv.DictReader((reference_dir / "serving_runs.csv").open())):
        model = row["model"].split(" (")[0]
        label = (f"serving#{index}: {engine_of(row['source'])} {model} {row['gpu_type'].split(' (')[0]} tp={row['tp']} "
                 f"{row['precision'].split(' ')[0]} {row['input_len']}/{row['output_len']}")
        run = serving_run(row, label)
        if isinstance(run, str):
            refused[label] = run
        else:
            runs.append(run)
    return runs, refused
