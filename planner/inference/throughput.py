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
  continuous  what zplan's own serving runtime runs (runtime/inference/scheduler.py over paged_cache.py): iteration-
          level scheduling (Orca) over a paged KV cache (Kwon et al. 2023, "PagedAttention", SOSP). The cache is cut
          into blocks of KV_BLOCK_TOKENS = 16 positions; the KV budget of one GPU is kv_fraction of the memory left
          after the resident weights and the framework reserve (the rest covers a step's activations), and holds
            kv_blocks = budget // (2 * L * ceil(a_kv / t) * 16 * d * kv_bytes)   blocks (the same on every tp rank).
          Every step decodes every running sequence (one token each) and then reads prompt chunks, at most
          STEP_TOKENS = 512 tokens in all (chunked prefill, Agrawal et al. 2024, "Sarathi-Serve", OSDI); a request
          is admitted while free blocks remain and fewer than max_batch sequences run. The cache takes no more
          blocks than max_batch sequences of max_seq_len fill. Priced at concurrency N (N requests in flight, each
          replaced by a new one when it finishes: a closed loop of N clients), N up to the most the blocks hold
          without preemption, min(max_batch, kv_blocks // ceil((I + O) / 16)). A request lives k + O - 1 steps:
          k steps reading its prompt (its first token comes with the last chunk), then O - 1 decode steps. With N
          in flight a step holds on average D = N (O - 1) / (k + O - 1) decode tokens and the prompts of
          n_p = N / (k + O - 1) requests, N (I + O - 1) / (k + O - 1) tokens, which the step budget caps, so k is the
          fewest steps that keep it within 512 (and each chunk within 512):
            k = max(1, ceil(I / 512), ceil(N (I + O - 1) / 512 - (O - 1)))
            step = step(D, c = I + O / 2, n_p, P = I)  (+ streamed weights not hidden, + the host's dispatch)
            output tokens/s = N * O / ((k + O - 1) * step),  TPOT = step.
          A request's first token takes the k steps that read its prompt, each with a 1 / k chunk of it beside the
          other N - 1 requests' share of the average step:
            TTFT = k * step(D = (N - 1) (O - 1) / (k + O - 1), c, n_p = 1 / k + (N - 1) / (k + O - 1), P = I).
          At N = 1 with a prompt of at most 512 tokens TTFT is a lone prefill (ttft_s) and TPOT max load's step at
          N = 1; as N grows the step budget stretches k, throughput saturates near 512 * O / (I + O - 1) tokens
          per step, and TTFT grows. Queueing beyond N and preemption (never needed at these N) are not priced.

Numerics says what the step's numbers are stored and computed in: weight bytes per block Linear weight and per head
weight, KV-cache bytes per element, activation bytes (the all-reduce payload), the block GEMMs' peak and the peak
of the rest (attention, logits). numerics_for() gives zplan's own engine's (the precisions planner/inference/cost.py
prices, fp8 W8A8 included); a benchmark may state where another engine differs (e.g. an fp8 KV cache) explicitly,
as that engine's condition. EngineEfficiency
scales a step's FLOPs and bytes times for an engine faster or slower than the profile assumes (1, 1: zplan's).
benchmarks/validate_serving.py checks the static and max-load formulas against published TensorRT-LLM runs. `zplan
compile --mode inference` chooses by cost.py's static batch and records the continuous-batching curve of the chosen
configuration beside it (plan_continuous_batching: plan.json's parallel.kv_blocks and prediction.continuous_batching).
KV_BLOCK_TOKENS and STEP_TOKENS are the runtime's own numbers (paged_cache.BLOCK_TOKENS and
scheduler.DEFAULT_STEP_TOKENS; tests/unit/test_inference_cost.py holds them equal), so what is priced is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

import numpy as np

from zplan.planner.cost.comm import all_reduce_s
from zplan.planner.cost.compute import gemm_efficiency
from zplan.planner.inference.cost import (
    FLOAT_BYTES,
    WEIGHT_PRECISIONS,
    WEIGHT_TIERS,
    InferenceCandidates,
    InferenceModel,
    Workload,
    block_weight_bytes,
    fp8_scales_per_weight,
    is_fp8,
    is_quantized,
    not_hidden_stream_s,
    pass_host_s,
    quant_group_size,
    stream_link_Bps,
    weight_bytes_per_param,
)
from zplan.schemas.cluster import ClusterSpec

DEFAULT_KV_FRACTION = 0.95  # share of the memory left after weights given to the KV cache (TensorRT-LLM's default
# kv_cache_free_gpu_mem_fraction is 0.9; its perf overview runs 0.95 "in many cases")
KV_BLOCK_TOKENS = 16  # positions per paged KV-cache block: runtime/inference/paged_cache.py's BLOCK_TOKENS (vLLM's)
STEP_TOKENS = 512  # tokens one engine pass carries at most: runtime/inference/scheduler.py's DEFAULT_STEP_TOKENS


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
    other_peak = num.other_peak_flops or num.gemm_peak_flops
    eff = gemm_efficiency(2.0 * tokens * h * f / tp, cluster, num.gemm_peak_flops / other_peak)
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


# ---- continuous batching over the paged KV cache (module docstring, `continuous`) ------------------------------


def kv_block_bytes(model: InferenceModel, tp: int, num: Numerics) -> float:
    """Bytes of one KV-cache block on one GPU: 2 * L * ceil(a_kv / t) * KV_BLOCK_TOKENS * d * kv_bytes."""
    return KV_BLOCK_TOKENS * kv_bytes_per_token(model, tp, num)


def kv_budget_bytes(capacity: float, weights: float, reserve: float, kv_fraction: float = DEFAULT_KV_FRACTION
                    ) -> float:
    """The KV cache's share of one GPU: kv_fraction of what the resident weights and the framework reserve leave."""
    return max(0.0, kv_fraction * (capacity - weights - reserve))


def blocks_per_request(input_len: int, output_len: int) -> int:
    """Blocks one request of I + O tokens holds at its end: ceil((I + O) / KV_BLOCK_TOKENS)."""
    return ceil((input_len + output_len) / KV_BLOCK_TOKENS)


def concurrencies(max_concurrency: int) -> list[int]:
    """1, 2, 4, ... below max_concurrency, then max_concurrency itself ([] when not one request fits)."""
    points, n = [], 1
    while n < max_concurrency:
        points.append(n)
        n *= 2
    return points + [max_concurrency] if max_concurrency >= 1 else []


def prefill_steps(concurrency: int, input_len: int, output_len: int, step_tokens: int = STEP_TOKENS) -> int:
    """k: the steps a request reads its prompt in, at `concurrency` requests in flight (module docstring,
    `continuous`): k = max(1, ceil(I / S), ceil(N (I + O - 1) / S - (O - 1)))."""
    return max(1, ceil(input_len / step_tokens),
               ceil(concurrency * (input_len + output_len - 1) / step_tokens - (output_len - 1)))


@dataclass(frozen=True)
class ServingPoint:
    """One concurrency of the continuous-batching curve (one replica)."""

    concurrency: int  # N requests in flight
    prefill_steps: int  # k: steps a request reads its prompt in
    step_s: float  # one engine pass: a running request's time per output token
    tokens_per_s: float  # output tokens / s of one replica
    ttft_s: float  # the k steps that read its prompt


@dataclass(frozen=True)
class ContinuousBatching:
    """The paged KV cache of one GPU and the curve priced on it (module docstring, `continuous`)."""

    kv_budget_bytes: float
    kv_block_bytes: float
    kv_blocks: int
    blocks_per_request: int
    max_concurrency: int  # kv_blocks // blocks_per_request
    points: tuple[ServingPoint, ...]  # at concurrencies(max_concurrency)


def continuous_batching_point(model: InferenceModel, cluster: ClusterSpec, tp: int, num: Numerics, input_len: int,
                              output_len: int, concurrency: int, eff: EngineEfficiency = ZPLAN_ENGINE,
                              layer_transfer_s: float = 0.0, step_tokens: int = STEP_TOKENS) -> ServingPoint:
    """One point of the curve (module docstring, `continuous`): N requests in flight, each living k + O - 1 steps.
    `layer_transfer_s`: seconds to move one layer's block weights to the GPU (streamed tiers; 0 when resident), the
    part the step's compute does not hide added to each step (cost.py's not_hidden_stream_s; all of it where the
    cluster cannot overlap copies with compute)."""
    n, out = float(concurrency), float(output_len)
    k = prefill_steps(concurrency, input_len, output_len, step_tokens)
    life = k + out - 1.0
    context = input_len + out / 2.0

    def seconds(decodes: float, prompts: float) -> float:
        one = steps(model, cluster, tp, num, decodes, context, prompts, input_len).seconds(eff)
        if layer_transfer_s <= 0:
            return one
        return one + (not_hidden_stream_s(np.array(layer_transfer_s), np.array(one), model.layers).item()
                      if cluster.overlaps_comm_with_compute else model.layers * layer_transfer_s)

    step = seconds(n * (out - 1.0) / life, n / life)  # the average step: every request in flight
    reading = seconds((n - 1.0) * (out - 1.0) / life, 1.0 / k + (n - 1.0) / life)  # one reading this prompt's chunk
    return ServingPoint(concurrency=concurrency, prefill_steps=k, step_s=step,
                        tokens_per_s=n * out / (life * step), ttft_s=k * reading)


def continuous_batching(model: InferenceModel, cluster: ClusterSpec, tp: int, num: Numerics, input_len: int,
                        output_len: int, kv_budget: float, max_running: int, max_seq_len: int,
                        eff: EngineEfficiency = ZPLAN_ENGINE, layer_transfer_s: float = 0.0,
                        step_tokens: int = STEP_TOKENS) -> ContinuousBatching:
    """The paged cache on one GPU and the curve at concurrencies 1, 2, 4, ... up to the most requests of I + O
    tokens it holds (module docstring, `continuous`). The runtime runs at most `max_running` sequences at a time (the
    plan's max_batch, as vLLM's max_num_seqs), so the cache takes the blocks `kv_budget` bytes hold but no more than
    max_running sequences of max_seq_len fill."""
    block = kv_block_bytes(model, tp, num)
    blocks = min(int(kv_budget // block), max_running * ceil(max_seq_len / KV_BLOCK_TOKENS))
    per_request = blocks_per_request(input_len, output_len)
    most = min(max_running, blocks // per_request)
    points = tuple(continuous_batching_point(model, cluster, tp, num, input_len, output_len, n, eff,
                                             layer_transfer_s, step_tokens) for n in concurrencies(most))
    return ContinuousBatching(kv_budget_bytes=kv_budget, kv_block_bytes=block, kv_blocks=blocks,
                              blocks_per_request=per_request, max_concurrency=most, points=points)


def plan_continuous_batching(model: InferenceModel, cluster: ClusterSpec, work: Workload, tp: int, precision: str,
                             tier: str, weights_bytes: float, max_running: int) -> ContinuousBatching:
    """The curve of one configuration of a plan: zplan's engine numerics (numerics_for), the host's dispatch per
    pass where the profile prices one (cost.py's pass_host_s, as cost.py's prefill and decode),
    `weights_bytes` the weights the configuration keeps on a GPU (cost.py's estimate: the layers in flight for a
    streamed tier), whose blocks then cross the tier's link every pass."""
    num = numerics_for(precision, work.compute_dtype, model, tp, cluster)
    host_s = pass_host_s(model.layers, cluster)
    tier_index = WEIGHT_TIERS.index(tier)
    layer_transfer = 0.0
    if tier != "gpu":
        one = InferenceCandidates(tp=np.array([tp]), precision=np.array([WEIGHT_PRECISIONS.index(precision)]),
                                  tier=np.array([tier_index]), batch=np.array([1]))
        link = stream_link_Bps(np.array([tier_index]), cluster, work.gpus)
        layer_transfer = float((block_weight_bytes(model, one) / model.layers / link)[0])
    budget = kv_budget_bytes(float(cluster.gpu.hbm_bytes), weights_bytes, float(cluster.framework_reserve_bytes))
    return continuous_batching(model, cluster, tp, num, work.prompt_len, work.gen_len, budget, max_running,
                               work.max_seq_len, EngineEfficiency(pass_overhead_s=host_s), layer_transfer)
