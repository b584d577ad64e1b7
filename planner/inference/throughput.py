"""Serving throughput under a batching policy, from the cost model's per-step times.

planner/inference/cost.py prices one configuration at one batch: a prefill of B prompts and a decode step at the
mean context. A server's tokens/s also depends on how it batches requests. This module prices one engine *step*
(a forward pass over some decode tokens and some prefill tokens) with the same formulas and assumptions as
cost.py, and composes steps into the two policies serving benchmarks measure:

  step    a forward pass over D decode tokens (one per running sequence, at context c) and Q prefill tokens
          (n_p prompts of P tokens): GEMM FLOPs 2 * W * L * (D + Q) / t (at the numerics' GEMM peak: fp8's for
          fp8 weights), attention FLOPs 2 * L * n_p * P^2 * h / t
          (causal, Pope et al. 2022 Sec. 2) + 4 * L * D * c * h / t, logits 2 * h * V per sequence (both at the
          compute dtype's peak); bytes: every
          resident weight once and the KV cache of the D decoding sequences, 2 * L * D * c * ceil(a_kv / t) * d
          * kv_bytes (Kwon et al. 2023 Sec. 2). The step takes the longer of FLOPs / (peaks * GEMM efficiency at
          the MLP GEMM of D + Q tokens) and bytes / (HBM bandwidth * memory_bound) -- the roofline, as cost.py's
          decode (compute bound where the FLOPs take longer) and prefill (at least one read of the weights) --
          plus two tensor-parallel all-reduces of (D + Q) * h activations per block (Shoeybi et al. 2019 Sec. 3).
  static  a batch of B requests with input I and output O run together to completion, no in-flight batching
          (TensorRT-LLM's gptSessionBenchmark): the prefill of B * I tokens yields the first token, then O - 1
          decode steps at contexts I + 1 .. I + O - 1 (summed step by step, not at the mean context):
            tokens/s = B * O / (prefill(B, I) + sum_k decode(B, I + k)).
          Time to first token of a lone request: prefill(1, I).
  max load  in-flight (continuous) batching at an unbounded request rate (Yu et al. 2022, "Orca", OSDI, Sec. 3;
          Kwon et al. 2023 Sec. 4): the engine keeps N requests running, N = min(max_batch, KV-cache capacity /
          tokens reserved per request), where the KV cache gets kv_fraction of the memory left after weights and
          the framework reserve, and a request reserves its whole I + O tokens on admission (a scheduler that
          never evicts a started request: TensorRT-LLM's GUARANTEED_NO_EVICT). In steady state every step decodes
          the N running sequences (mean context I + O / 2) and prefills the prompts of the N / O requests that
          replace the ones finishing (each request lives O steps), so
            output tokens/s = N / step(D = N, c = I + O / 2, n_p = N / O, P = I).
          That steady state needs requests of varied lengths. When every request has the same I and O and all
          arrive at once (a benchmark at an infinite request rate with fixed lengths), the N admitted requests
          prefill together, decode in lockstep and finish on the same step, and nothing is admitted until they
          do: the engine runs consecutive static batches ("waves") of N, and R requests take
            time = floor(R / N) * static(N) + static(R mod N),  output tokens/s = R * O / time.

Numerics says what the step's numbers are stored and computed in: weight bytes per block Linear weight and per head
weight, KV-cache bytes per element, activation bytes (the all-reduce payload), the block GEMMs' peak and the peak
of the rest (attention, logits). numerics_for() gives zplan's own engine's (the precisions planner/inference/cost.py
prices, fp8 W8A8 included); a benchmark may state where another engine differs (e.g. an fp8 KV cache) explicitly,
as that engine's condition. EngineEfficiency
scales a step's FLOPs and bytes times for an engine faster or slower than the profile assumes (1, 1: zplan's).
benchmarks/validate_serving.py checks these formulas against published TensorRT-LLM runs; `zplan compile --mode
inference` does not call this module yet (its plan reports cost.py's static-batch tokens/s).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zplan.planner.cost.comm import all_reduce_s
from zplan.planner.cost.compute import gemm_efficiency
from zplan.planner.inference.cost import (
    FLOAT_BYTES,
    WEIGHT_PRECISIONS,
    InferenceModel,
    fp8_scales_per_weight,
    is_fp8,
    is_quantized,
    quant_group_size,
    weight_bytes_per_param,
)
from zplan.schemas.cluster import ClusterSpec

DEFAULT_KV_FRACTION = 0.95  # share of the memory left after weights given to the KV cache (TensorRT-LLM's default
# kv_cache_free_gpu_mem_fraction is 0.9; its perf overview runs 0.95 "in many cases")


@dataclass(frozen=True)
class Numerics:
    """How one engine stores and computes a model (bytes per element; FLOP/s)."""

    name: str
    block_weight_bytes: float  # per block Linear weight, scales included
    head_weight_bytes: float  # per weight of the head's V x h matrix
    other_bytes: float  # embeddings rows read, norms: per parameter
    kv_bytes: float  # per KV-cache element
    activation_bytes: float  # per activation element (the tensor-parallel all-reduce payload)
    gemm_peak_flops: float  # the peak the block GEMMs run against
    other_peak_flops: float = 0.0  # the peak attention and the logits run against; 0: gemm_peak_flops
    attention_peak_flops: float = 0.0  # attention's own peak where it differs from the logits'; 0: other_peak_flops


def numerics_for(precision: str, compute_dtype: str, model: InferenceModel, tp: int, cluster: ClusterSpec
                 ) -> Numerics:
    """zplan's own engine (runtime.inference), as planner/inference/cost.py prices it: weights at `precision`
    (int8/int4 weight-only with fp32 group scales, the head quantized too; fp8 W8A8 with fp32 per-channel scales,
    its block GEMMs at the fp8 peak, the head at the compute dtype), KV cache, activations and the other GEMMs at
    the compute dtype."""
    index = np.array([WEIGHT_PRECISIONS.index(precision)])
    tps = np.array([tp])
    group, scales = quant_group_size(model, tps), fp8_scales_per_weight(model, tps)
    per_weight = float(weight_bytes_per_param(index, group, scales)[0])
    cbytes = FLOAT_BYTES[compute_dtype]
    peak = cluster.peak_flops(compute_dtype)
    fp8 = bool(is_fp8(index)[0])
    name = (f"zplan fp8 W8A8 (per-channel weight, per-token activation scales), {compute_dtype} compute" if fp8
            else f"zplan {precision} weights, {compute_dtype} compute")
    return Numerics(name=name, block_weight_bytes=per_weight,
                    head_weight_bytes=per_weight if bool(is_quantized(index)[0]) else cbytes, other_bytes=cbytes,
                    kv_bytes=cbytes, activation_bytes=cbytes,
                    gemm_peak_flops=cluster.gpu.peak_fp8_flops if fp8 else peak, other_peak_flops=peak)


def weight_bytes_per_gpu(model: InferenceModel, tp: int, num: Numerics) -> float:
    """Resident weight bytes on one GPU: block Linears split over tp; the head and the rest replicated (as cost.py)."""
    V, h = model.vocab, model.hidden
    return (model.layers * model.block_linear_params / tp * num.block_weight_bytes + V * h * num.head_weight_bytes
            + (model.replicated_params - V * h) * num.other_bytes)


def kv_bytes_per_token(model: InferenceModel, tp: int, num: Numerics) -> float:
    """KV-cache bytes one token of one sequence holds on one GPU: 2 * L * ceil(a_kv / t) * d * bytes."""
    return 2.0 * model.layers * float(np.ceil(model.kv_heads / tp)) * model.head_dim * num.kv_bytes


@dataclass(frozen=True)
class EngineEfficiency:
    """A serving engine's achieved fraction of the profile's compute and memory rooflines, relative to what the
    profile already assumes (its GEMM efficiency curve and memory_bound fraction): (1, 1) prices zplan's engine
    on the profile as is; another engine's (a benchmark's fit) scales the FLOPs time by 1 / compute and the bytes
    time by 1 / memory, and adds a fixed pass_overhead_s to every forward pass."""

    compute: float = 1.0
    memory: float = 1.0
    pass_overhead_s: float = 0.0  # fixed seconds per forward pass (launches, scheduling, sampling) beyond the roofline


ZPLAN_ENGINE = EngineEfficiency()


@dataclass(frozen=True)
class Steps:
    """Forward passes, each priced by its parts (seconds on the profile as is): `count` passes of each row."""

    count: np.ndarray
    compute_s: np.ndarray  # FLOPs / (peak * GEMM efficiency)
    memory_s: np.ndarray  # bytes / (HBM bandwidth * memory_bound)
    comm_s: np.ndarray  # tensor-parallel all-reduces

    def seconds(self, eff: EngineEfficiency = ZPLAN_ENGINE) -> float:
        """The roofline of each pass -- the longer of its FLOPs and its bytes -- plus its all-reduces and the engine's
        fixed cost per pass, summed."""
        roofline = np.maximum(self.compute_s / eff.compute, self.memory_s / eff.memory)
        per_pass = roofline + self.comm_s + eff.pass_overhead_s
        return float(np.sum(self.count * per_pass))


def steps(model: InferenceModel, cluster: ClusterSpec, tp: int, num: Numerics, decode_seqs, decode_context,
          prefill_seqs=0.0, prefill_len=0.0, count=1.0) -> Steps:
    """Forward passes over `decode_seqs` sequences decoding one token at `decode_context` and `prefill_seqs`
    prompts of `prefill_len` tokens (module docstring, `step`); numpy-broadcast over its arguments."""
    D = np.atleast_1d(np.asarray(decode_seqs, dtype=float))
    c = np.asarray(decode_context, dtype=float)
    n_p = np.asarray(prefill_seqs, dtype=float)
    P = np.asarray(prefill_len, dtype=float)
    D, c, n_p, P, count = np.broadcast_arrays(D, c, n_p, P, np.asarray(count, dtype=float))
    L, h, f, V = model.layers, model.hidden, model.ffn, model.vocab
    tokens = D + n_p * P
    gemm_flops = 2.0 * model.block_linear_params * L * tokens / tp
    attention_flops = (2.0 * L * n_p * P * P * h + 4.0 * L * D * c * h) / tp
    logits_flops = 2.0 * h * V * (D + n_p)
    eff = gemm_efficiency(2.0 * tokens * h * f / tp, cluster)
    other_peak = num.other_peak_flops or num.gemm_peak_flops
    attention_peak = num.attention_peak_flops or other_peak
    compute = (gemm_flops / num.gemm_peak_flops + attention_flops / attention_peak
               + logits_flops / other_peak) / np.maximum(eff, 1e-12)
    hbm = cluster.gpu.hbm_bandwidth_Bps * cluster.efficiency.memory_bound
    not_read = (model.replicated_params - model.decode_read_params) * num.other_bytes  # the token table's unread rows
    read = weight_bytes_per_gpu(model, tp, num) - not_read + kv_bytes_per_token(model, tp, num) * D * c
    size = np.full(tokens.shape, tp, dtype=np.int64)
    comm = 2.0 * L * all_reduce_s(tokens * h * num.activation_bytes, size, np.ones_like(size), cluster)
    return Steps(count=count.astype(float), compute_s=compute, memory_s=read / hbm, comm_s=comm)


def static_batch_steps(model: InferenceModel, cluster: ClusterSpec, tp: int, num: Numerics, batch: int,
                       input_len: int, output_len: int) -> tuple[Steps, Steps]:
    """(prefill, decode) passes of a static batch: the prefill of B * I tokens, then O - 1 decode steps at
    contexts I + 1 .. I + O - 1."""
    prefill = steps(model, cluster, tp, num, 0.0, 0.0, batch, input_len)
    contexts = input_len + np.arange(1, max(output_len, 2), dtype=float)
    decode = steps(model, cluster, tp, num, float(batch), contexts, count=1.0 if output_len > 1 else 0.0)
    return prefill, decode


@dataclass(frozen=True)
class StaticBatch:
    prefill_s: float
    decode_s: float  # all O - 1 decode steps
    tokens_per_s: float  # output tokens / s of one replica
    tpot_s: float  # mean decode step


def static_batch(model: InferenceModel, cluster: ClusterSpec, tp: int, num: Numerics, batch: int, input_len: int,
                 output_len: int, eff: EngineEfficiency = ZPLAN_ENGINE) -> StaticBatch:
    """B requests of I prompt tokens generating O tokens together (module docstring, `static`)."""
    prefill_steps, decode_steps = static_batch_steps(model, cluster, tp, num, batch, input_len, output_len)
    prefill, decode = prefill_steps.seconds(eff), decode_steps.seconds(eff)
    return StaticBatch(prefill_s=prefill, decode_s=decode, tokens_per_s=batch * output_len / (prefill + decode),
                       tpot_s=decode / max(output_len - 1, 1))


def ttft_steps(model: InferenceModel, cluster: ClusterSpec, tp: int, num: Numerics, input_len: int) -> Steps:
    return steps(model, cluster, tp, num, 0.0, 0.0, 1.0, input_len)


def ttft_s(model: InferenceModel, cluster: ClusterSpec, tp: int, num: Numerics, input_len: int,
           eff: EngineEfficiency = ZPLAN_ENGINE) -> float:
    """Time to first token of a lone request: the prefill of its prompt."""
    return ttft_steps(model, cluster, tp, num, input_len).seconds(eff)


@dataclass(frozen=True)
class Concurrency:
    requests: int  # N, requests running together
    limited_by: str  # 'kv cache' | 'max batch'
    kv_capacity_tokens: float


def max_load_concurrency(model: InferenceModel, cluster: ClusterSpec, tp: int, num: Numerics, input_len: int,
                         output_len: int, max_batch: int, kv_fraction: float = DEFAULT_KV_FRACTION) -> Concurrency:
    """N = min(max_batch, KV tokens / (I + O)); KV tokens = kv_fraction * (HBM - weights - framework reserve) /
    KV bytes per token (module docstring, `max load`)."""
    free = cluster.gpu.hbm_bytes - weight_bytes_per_gpu(model, tp, num) - cluster.framework_reserve_bytes
    capacity = max(0.0, kv_fraction * free) / kv_bytes_per_token(model, tp, num)
    by_memory = int(capacity // (input_len + output_len))
    return Concurrency(requests=min(max_batch, by_memory),
                       limited_by="max batch" if max_batch <= by_memory else "kv cache", kv_capacity_tokens=capacity)


def max_load_steps(model: InferenceModel, cluster: ClusterSpec, tp: int, num: Numerics, input_len: int,
                   output_len: int, requests: int) -> Steps:
    """The steady-state pass: N decode tokens at the mean context I + O / 2 and the N / O arriving prompts."""
    return steps(model, cluster, tp, num, float(requests), input_len + output_len / 2.0, requests / output_len,
                 input_len)


@dataclass(frozen=True)
class MaxLoad:
    concurrency: Concurrency
    step_s: float
    tokens_per_s: float  # output tokens / s of one replica (0 when not even one request fits)
    tpot_s: float  # a running request's time per output token: one step


def max_load(model: InferenceModel, cluster: ClusterSpec, tp: int, num: Numerics, input_len: int, output_len: int,
             max_batch: int, kv_fraction: float = DEFAULT_KV_FRACTION, eff: EngineEfficiency = ZPLAN_ENGINE
             ) -> MaxLoad:
    """In-flight batching at an unbounded request rate, requests of varied lengths (module docstring, `max load`):
    N / step; 0 tokens/s when not one request fits."""
    conc = max_load_concurrency(model, cluster, tp, num, input_len, output_len, max_batch, kv_fraction)
    if conc.requests < 1:
        return MaxLoad(conc, float("inf"), 0.0, float("inf"))
    step = max_load_steps(model, cluster, tp, num, input_len, output_len, conc.requests).seconds(eff)
    return MaxLoad(concurrency=conc, step_s=step, tokens_per_s=conc.requests / step, tpot_s=step)


def max_load_waves_steps(model: InferenceModel, cluster: ClusterSpec, tp: int, num: Numerics, input_len: int,
                         output_len: int, requests: int, concurrency: int) -> Steps:
    """Every pass of R fixed-length requests run as waves of N (module docstring, `max load`): floor(R / N) static
    batches of N, then one of R mod N."""
    full, rest = divmod(requests, concurrency)
    parts = []
    for batch, times in ((concurrency, full), (rest, 1)):
        if batch and times:
            for s in static_batch_steps(model, cluster, tp, num, batch, input_len, output_len):
                parts.append(Steps(s.count * times, s.compute_s, s.memory_s, s.comm_s))
    return Steps(*(np.concatenate([getattr(s, k) for s in parts]) for k in ("count", "compute_s", "memory_s",
                                                                             "comm_s")))


def max_load_waves(model: InferenceModel, cluster: ClusterSpec, tp: int, num: Numerics, input_len: int,
                   output_len: int, max_batch: int, requests: int, kv_fraction: float = DEFAULT_KV_FRACTION,
                   eff: EngineEfficiency = ZPLAN_ENGINE) -> tuple[Concurrency, float]:
    """(concurrency, output tokens/s) of R requests of fixed lengths all arriving at once: R * O / time of the
    waves (module docstring, `max load`); 0 tokens/s when not one request fits."""
    conc = max_load_concurrency(model, cluster, tp, num, input_len, output_len, max_batch, kv_fraction)
    if conc.requests < 1:
        return conc, 0.0
    waves = max_load_waves_steps(model, cluster, tp, num, input_len, output_len, requests, conc.requests)
    return conc, requests * output_len / waves.seconds(eff)
