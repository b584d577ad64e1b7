"""The inference plan (`zplan compile --mode inference`): the contract between the inference planner
(planner.inference) and the emitted generate.py / serve.py (runtime.inference).

Serving splits the GPUs into `replicas` independent copies of the model, each tensor parallel over
`tp` GPUs; requests go to one replica. Weights are quantized weight-only (int8/int4, group-wise), to fp8
(W8A8: e4m3 weights with per-channel scales, activations cast per token, fp8 GEMMs) or kept at the compute
precision, and live on the GPU or, when they do not fit, in host memory or NVMe
files streamed to the GPU layer by layer (ZeRO-Inference, Aminabadi et al. 2022, Sec. 6).
The scored alternatives and the prediction's assumptions are alternatives.json beside plan.json
(schemas.alternatives.InferenceAlternatives).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.frozen import Frozen
from zplan.schemas.model import ModelSummary
from zplan.schemas.plan import Fingerprint

INFERENCE_PLAN_SCHEMA_VERSION = 2  # 2: the alternatives moved out to alternatives.json (schemas.alternatives)
Target = Literal["latency", "throughput"]
WeightPrecision = Literal["fp32", "bf16", "fp16", "int8", "int4", "fp8"]
ComputeDtype = Literal["fp32", "bf16", "fp16"]
WeightTier = Literal["gpu", "cpu", "nvme"]



class InferenceSpec(Frozen):
    """What the user asks for."""

    target: Target = Field(description="latency: the smallest time per output token (then time to first token); "
                           "throughput: the most generated tokens/s over all replicas.")
    batch: int = Field(gt=0, description="Sequences generated together on one replica (the server's largest batch).")
    prompt_len: int = Field(gt=0, description="Prompt tokens per sequence the prediction assumes (and the most a "
                            "request may send, with gen_len, within max_seq_len).")
    gen_len: int = Field(gt=0, description="Generated tokens per sequence the prediction assumes.")


class InferencePins(Frozen):
    """Choices the user fixed; None leaves the choice to the planner."""

    tp: Optional[int] = Field(default=None, gt=0, description="Tensor-parallel degree.")
    precision: Optional[WeightPrecision] = Field(default=None, description="Weight precision (--precision).")
    offload: Optional[WeightTier] = Field(default=None, description="Where weights live (--offload none|cpu|nvme; "
                                          "none is stored as gpu).")


class InferenceParallel(Frozen):
    """The chosen configuration: everything generate.py and serve.py need to build the engine."""

    tp: int = Field(gt=0, description="Tensor-parallel degree of one replica (GPUs per replica).")
    replicas: int = Field(gt=0, description="Independent model replicas: gpus / tp.")
    weight_precision: WeightPrecision = Field(description="Storage of the block Linears' weights; int8/int4 are "
                                              "weight-only, group-wise symmetric (fp32 scales), dequantized inside "
                                              "the matmul, and quantize the head's vocabulary x hidden matrix too "
                                              "(the token table when tied to it). fp8 is W8A8: e4m3 weights with one "
                                              "fp32 scale per output channel, each Linear's input cast to e4m3 per "
                                              "token, the GEMM on fp8 tensor cores (torch._scaled_mm); its head stays "
                                              "at compute_dtype. Other embeddings and the norms stay at "
                                              "compute_dtype.")
    quant_group_size: int = Field(default=128, gt=0, description="Input features per quantization scale "
                                  "(int8/int4): the largest power of two up to 128 that divides every quantized "
                                  "Linear's input width on one GPU.")
    compute_dtype: ComputeDtype = Field(description="Activations, KV cache and matmul precision.")
    weight_tier: WeightTier = Field(description="Where the block weights live between uses: gpu (resident), cpu "
                                    "(pinned host memory) or nvme (files), the last two streamed layer by layer.")
    prefetch_layers: int = Field(default=1, ge=0, description="Layers streamed ahead of the one computing (weight "
                                 "tiers cpu/nvme; 0 when resident).")
    max_batch: int = Field(gt=0, description="Sequences one replica runs together; the KV cache is preallocated "
                           "for this many.")
    max_seq_len: int = Field(gt=0, description="Prompt plus generated tokens per sequence the KV cache holds.")
    kv_block_tokens: int = Field(default=16, gt=0, description="Positions per block of the paged KV cache the "
                                 "serving runtime keeps (runtime/inference/paged_cache.py).")
    kv_blocks: Optional[int] = Field(default=None, ge=0, description="Blocks of the paged KV cache on each GPU: the "
                                     "KV budget (95 % of the memory the resident weights and the framework reserve "
                                     "leave) // the bytes of a block, 2 * layers * kv_heads/tp * kv_block_tokens * "
                                     "head_dim * bytes; the runtime admits requests while free blocks remain. None in "
                                     "plans written before the paged cache.")


class InferenceMemory(Frozen):
    """Bytes per GPU."""

    weights: float = Field(ge=0, description="Resident weight bytes (streamed tiers: the layers in flight, plus "
                           "embeddings and head).")
    kv_cache: float = Field(ge=0, description="Preallocated KV cache: 2 * layers * max_batch * max_seq_len * "
                            "kv_heads/tp * head_dim * bytes.")
    activations: float = Field(ge=0, description="Largest transient activations (prefill of a full batch), "
                               "including the logits.")
    reserve: float = Field(ge=0, description="Framework reserve (context, allocator).")
    total: float = Field(ge=0, description="Sum of the above.")
    capacity: float = Field(gt=0, description="Device memory.")
    cpu_bytes_per_node: float = Field(ge=0, description="Host bytes of streamed weights per node.")
    nvme_bytes_per_node: float = Field(ge=0, description="NVMe bytes of streamed weights per node.")


class InferenceTime(Frozen):
    """Where the time goes, seconds. Prefill: the whole batch's prompts in one pass; decode: one token for
    every sequence of the batch."""

    prefill_compute_s: float = Field(ge=0, description="Prefill matmul and attention FLOPs / achieved FLOP/s "
                                     "(compute bound).")
    prefill_tp_s: float = Field(ge=0, description="Prefill tensor-parallel all-reduces (two per layer).")
    prefill_stream_s: float = Field(ge=0, description="Prefill time waiting for streamed weights, not hidden.")
    decode_weights_s: float = Field(ge=0, description="Per decode step: weight bytes read / HBM bandwidth.")
    decode_kv_s: float = Field(ge=0, description="Per decode step: KV-cache bytes read / HBM bandwidth.")
    decode_compute_s: float = Field(ge=0, description="Per decode step: FLOPs / achieved FLOP/s, counted "
                                    "instead of the bytes where the batch makes the step compute bound, plus the "
                                    "host's time dispatching the step's ops (CPU profiles; 0 on GPUs).")
    decode_tp_s: float = Field(ge=0, description="Per decode step: tensor-parallel all-reduces (two per layer, "
                               "latency bound).")
    decode_stream_s: float = Field(ge=0, description="Per decode step: waiting for streamed weights, not hidden.")


class ServingPoint(Frozen):
    """Continuous batching at one concurrency (planner/inference/throughput.py, `continuous`)."""

    concurrency: int = Field(gt=0, description="Requests in flight on one replica (each replaced when it finishes).")
    prefill_steps: int = Field(gt=0, description="Engine steps a request reads its prompt in (chunked prefill within "
                               "the step token budget).")
    tokens_per_s: float = Field(ge=0, description="Generated tokens per second over all replicas.")
    tpot_s: float = Field(ge=0, description="Time per output token: one engine step (every running sequence decodes "
                          "one token and prompt chunks are read), s.")
    ttft_s: float = Field(ge=0, description="Time to first token: prefill_steps steps, s.")


class ContinuousBatchingPrediction(Frozen):
    """What the serving runtime's continuous batching over the paged KV cache gives on the chosen configuration, at
    concurrencies 1, 2, 4, ... up to the most the KV blocks hold (planner/inference/throughput.py, `continuous`)."""

    kv_budget_bytes: float = Field(ge=0, description="Bytes per GPU the paged KV cache gets.")
    kv_block_bytes: float = Field(gt=0, description="Bytes of one block on one GPU.")
    blocks_per_request: int = Field(gt=0, description="Blocks a request of prompt_len + gen_len tokens holds.")
    step_tokens: int = Field(gt=0, description="Tokens one engine step carries at most (decodes, then prompt "
                             "chunks).")
    max_concurrency: int = Field(ge=0, description="Requests one replica holds at once without preemption: kv_blocks "
                                 "// blocks_per_request.")
    points: list[ServingPoint] = Field(default_factory=list, description="The curve, by concurrency.")


class ServingInterval(Frozen):
    """How sure a serving prediction is (planner/serving_uncertainty.py): an 80 % interval from the errors of another
    engine, TensorRT-LLM, priced by the same cost model with fitted engine constants, on published runs of a source
    the constants were not fitted on (benchmarks/validate_serving.py, left one source out)."""

    level: float = Field(description="The share of runs the interval is meant to hold, e.g. 0.8.")
    basis: Literal["validation", "thin", "unseen"] = Field(
        description="validation: each metric's own errors; thin: too few runs of a metric, the pooled errors' wider "
                    "range; unseen: no run of a metric, wider still (the weaker of the two metrics' bases).")
    runs: int = Field(ge=0, description="Published runs the interval is built from (throughput and first token).")
    tokens_per_s: tuple[float, float] = Field(description="[low, high] generated tokens per second, all replicas.")
    ttft_s: tuple[float, float] = Field(description="[low, high] seconds to the first token.")
    tpot_s: tuple[float, float] = Field(description="[low, high] seconds per output token.")
    request_latency_s: tuple[float, float] = Field(description="[low, high] seconds per request.")
    note: str = Field(description="One line on what the interval rests on.")


class InferencePrediction(Frozen):
    ttft_s: float = Field(ge=0, description="Time to first token: prefill of the batch, s.")
    tpot_s: float = Field(ge=0, description="Time per output token: one decode step, s.")
    request_latency_s: float = Field(ge=0, description="ttft_s + (gen_len - 1) * tpot_s.")
    tokens_per_s: float = Field(ge=0, description="Generated tokens per second over all replicas: replicas * batch * "
                                "gen_len / request_latency_s.")
    memory: InferenceMemory = Field(description="Per-GPU memory.")
    time: InferenceTime = Field(description="Where the time goes.")
    feasible: bool = Field(description="Fits device, host and NVMe capacity.")
    continuous_batching: Optional[ContinuousBatchingPrediction] = Field(
        default=None, description="Throughput against latency under the serving runtime's continuous batching (None "
        "in plans written before it).")
    interval: Optional[ServingInterval] = Field(default=None, description="How sure the figures above are (None in "
                                                "plans written before it).")


class InferenceCandidate(Frozen):
    """One evaluated configuration, for the report and the choice's explanation."""

    tp: int = Field(gt=0, description="Tensor-parallel degree.")
    weight_precision: WeightPrecision = Field(description="Weight precision.")
    weight_tier: WeightTier = Field(description="Where weights live.")
    ttft_s: float = Field(ge=0, description="Predicted time to first token, s.")
    tpot_s: float = Field(ge=0, description="Predicted time per output token, s.")
    tokens_per_s: float = Field(ge=0, description="Predicted tokens/s over all replicas.")
    memory_per_gpu_bytes: float = Field(ge=0, description="Predicted bytes per GPU.")
    feasible: bool = Field(description="Fits memory.")
    note: str = Field(default="", description="Why it lost or was refused, one sentence ('' for the chosen one).")
    interval: Optional[ServingInterval] = Field(default=None, description="How sure the figures above are, as the "
                                                "plan's prediction (None in files written before it).")


class InferencePlan(Frozen):
    schema_version: int = Field(default=INFERENCE_PLAN_SCHEMA_VERSION, description="Inference plan format version.")
    mode: Literal["inference"] = Field(default="inference", description="Tells an inference plan.json from a "
                                       "training one.")
    zplan_version: str = Field(description="zplan version that wrote the plan.")
    fingerprint: Fingerprint = Field(description="Inputs the plan was made for (world_size: GPUs of all replicas).")
    model: ModelSummary = Field(description="The traced or closed-form model.")
    cluster: ClusterSpec = Field(description="The hardware profile, copied in full.")
    spec: InferenceSpec = Field(description="Target, batch and lengths.")
    pins: InferencePins = Field(description="What the user fixed.")
    parallel: InferenceParallel = Field(description="The chosen configuration.")
    prediction: InferencePrediction = Field(description="Predicted latency, throughput and memory.")
    reason: str = Field(description="Why this configuration: the target, what it beat and by how much, and why "
                        "weights are quantized or streamed, in one to three sentences with the numbers.")
