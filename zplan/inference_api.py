"""Public API of inference planning: check a request (`prepare`) and compile it into an InferencePlan and its scored
alternatives (`compile_inference_with_alternatives`; `compile_inference_plan`: the plan alone); zplan.api.write_outputs
writes them. Cluster and model loading, the GPU-count check and
the fingerprint are zplan.api's.

A model the inference engine cannot serve is refused here, at compile, with the engine's own reason (one contract
with the runtime): tracing asks the engine's recogniser (runtime/plan/model_checks.py inference_traits, the function
the engine runs when it starts) and schemas/capability.py's "inference" rules say what its answers rule out."""

from __future__ import annotations

from dataclasses import dataclass

from zplan import __version__
from zplan.api import check_gpus, default_compute_dtype, fingerprint
from zplan.errors import SpecError
from zplan.model_input import summarize_model
from zplan.planner.clusters import load_cluster
from zplan.planner.inference.assumptions import inference_assumptions
from zplan.planner.inference.cost import (
    PREFETCH_LAYERS,
    WEIGHT_PRECISIONS,
    WEIGHT_TIERS,
    InferenceEstimate,
    InferenceModel,
    Workload,
    quant_group_size,
)
from zplan.planner.inference.infeasible import raise_infeasible
from zplan.planner.inference.search import (
    AUTO_QUANTIZED,
    QUANTIZED,
    SearchSpace,
    auto_batches,
    best_per_config,
    choose,
    legal_tps,
    note,
    reason,
    score,
)
from zplan.planner.inference.throughput import (
    KV_BLOCK_TOKENS,
    STEP_TOKENS,
    ContinuousBatching,
    plan_continuous_batching,
)
from zplan.planner.serving_uncertainty import serving_interval
from zplan.schemas.alternatives import InferenceAlternatives
from zplan.schemas.capability import inference_problems
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.inference import (
    ContinuousBatchingPrediction,
    InferenceCandidate,
    InferenceMemory,
    InferenceParallel,
    InferencePins,
    InferencePlan,
    InferencePrediction,
    InferenceSpec,
    InferenceTime,
    ServingPoint,
)
from zplan.schemas.model import ModelSummary
from zplan.schemas.spec import MAX_GLOBAL_BATCH

DEFAULT_PROMPT_LEN = 512
DEFAULT_GEN_LEN = 128


@dataclass(frozen=True)
class InferenceRequest:
    """A validated inference compile request (field names shared with zplan.api.Request: fingerprint reads them)."""

    model_ref: str
    summary: ModelSummary
    cluster: ClusterSpec
    gpus: int
    target: str  # 'latency' | 'throughput'
    batch: int | None  # None: the planner chooses (throughput)
    prompt_len: int
    gen_len: int
    compute_dtype: str
    pins: InferencePins

    @property
    def model(self) -> InferenceModel:
        return InferenceModel.from_summary(self.summary)

    @property
    def workload(self) -> Workload:
        return Workload(prompt_len=self.prompt_len, gen_len=self.gen_len, compute_dtype=self.compute_dtype,
                        gpus=self.gpus)


def compute_dtype_for(precision: str | None, cluster: ClusterSpec) -> str:
    if precision == "fp8" and cluster.gpu.peak_fp8_flops <= 0:
        raise SpecError(f"--precision fp8 needs fp8 tensor cores, and {cluster.gpu.name} ({cluster.name}) has none "
                        "(its profile's peak_fp8_flops is 0; zplan's fp8 engine needs CUDA capability 8.9 or newer: "
                        "L40S, H100, H200, B200): pass --precision int8 for 1-byte weights, or a cluster with fp8.")
    if precision is None or precision in QUANTIZED:
        return default_compute_dtype(cluster)
    if cluster.peak_flops(precision) <= 0:
        raise SpecError(f"{cluster.gpu.name} has no {precision} support: pass --precision "
                        f"{default_compute_dtype(cluster)} (or int8/int4).")
    return precision


def lengths(prompt_len: int | None, gen_len: int | None, model: InferenceModel, seq_len: int) -> tuple[int, int]:
    """Prompt and generated tokens: defaults 512 and 128 cut so that prompt + gen <= the model's sequence length (and
    its learned positions, where it has a table); given values beyond a learned position table are an error naming
    the largest allowed."""
    for name, value in (("--prompt-len", prompt_len), ("--gen-len", gen_len)):
        if value is not None and value < 1:
            raise SpecError(f"{name} must be at least 1 (got {value}).")
    rows = model.position_rows
    seq_len = min(seq_len, rows) if rows else seq_len
    gen = gen_len if gen_len is not None else max(1, min(DEFAULT_GEN_LEN, seq_len // 4, seq_len - (prompt_len or 0)))
    prompt = prompt_len if prompt_len is not None else max(1, min(DEFAULT_PROMPT_LEN, seq_len - gen))
    if rows is not None and prompt + gen > rows:
        if prompt >= rows:
            raise SpecError(f"--prompt-len {prompt} leaves no room to generate: the model has {rows} learned "
                            f"positions, so prompt + gen <= {rows}: pass --prompt-len {rows - 1} or less.")
        raise SpecError(f"prompt {prompt} + gen {gen} = {prompt + gen} tokens exceed the model's {rows} learned "
                        f"positions: pass --gen-len {rows - prompt} or less (or a shorter --prompt-len).")
    return prompt, gen


def check_tp(tp: int | None, model: InferenceModel, gpus: int, cluster: ClusterSpec) -> None:
    legal = legal_tps(model, gpus, cluster)
    if tp is not None and tp not in legal:
        raise SpecError(f"--tp {tp} must divide --gpus {gpus}, be at most {cluster.gpus_per_node} (GPUs per node) "
                        f"and divide the {model.heads} heads and {model.kv_heads} KV heads: use one of "
                        f"{', '.join(map(str, legal))}.")


def prepare(model_ref: str, gpus: int, cluster: str, target: str = "latency", batch: int | None = None,
            prompt_len: int | None = None, gen_len: int | None = None, precision: str | None = None,
            tp: int | None = None, offload: str | None = None) -> InferenceRequest:
    """Load the cluster and the model and check the request; raises ZplanError subclasses."""
    if target not in ("latency", "throughput"):
        raise SpecError(f"--target must be latency or throughput (got {target!r}).")
    if precision is not None and precision not in WEIGHT_PRECISIONS:
        raise SpecError(f"--precision must be one of {', '.join(WEIGHT_PRECISIONS)} (got {precision!r}).")
    if batch is not None and not 1 <= batch <= MAX_GLOBAL_BATCH:
        raise SpecError(f"--batch must be at least 1 and at most {MAX_GLOBAL_BATCH:,} (got {batch:,}).")
    spec = load_cluster(cluster)
    check_gpus(gpus, spec)
    dtype = compute_dtype_for(precision, spec)
    _, summary = summarize_model(model_ref, None, dtype, serving=True)
    check_servable(summary)
    model = InferenceModel.from_summary(summary)
    check_tp(tp, model, gpus, spec)
    prompt, gen = lengths(prompt_len, gen_len, model, summary.seq_len)
    tier = {"none": "gpu", None: None}.get(offload, offload)
    if tier is not None and tier not in WEIGHT_TIERS:
        raise SpecError(f"--offload must be none, cpu or nvme (got {offload!r}).")
    if batch is None and target == "latency":
        batch = 1
    pins = InferencePins(tp=tp, precision=precision, offload=tier)
    return InferenceRequest(model_ref=model_ref, summary=summary, cluster=spec, gpus=gpus, target=target,
                            batch=batch, prompt_len=prompt, gen_len=gen, compute_dtype=dtype, pins=pins)


def check_servable(summary: ModelSummary) -> None:
    """SpecError (exit 2, nothing written) when the engine cannot serve the model: a mixture of experts, or a block it
    does not recognise (the traits tracing recorded, schemas/capability.py's "inference" rules)."""
    problems = inference_problems(summary.traits)
    if problems:
        raise SpecError("; ".join(problems) + ".")


def search_space(req: InferenceRequest) -> SearchSpace:
    pins = req.pins
    tps = (pins.tp,) if pins.tp else tuple(legal_tps(req.model, req.gpus, req.cluster))
    # fp8 only when pinned (planner/inference/search.py's docstring says why)
    precisions = (pins.precision,) if pins.precision else (req.compute_dtype, *AUTO_QUANTIZED)
    tiers = (pins.offload,) if pins.offload else WEIGHT_TIERS
    batches = (req.batch,) if req.batch is not None else auto_batches()
    return SearchSpace(tps=tps, precisions=precisions, tiers=tiers, batches=batches)


def compile_inference_with_alternatives(req: InferenceRequest) -> tuple[InferencePlan, InferenceAlternatives]:
    """Search, choose and assemble the InferencePlan and every scored configuration (alternatives.json; no files
    written)."""
    model, work, cluster = req.model, req.workload, req.cluster
    space = search_space(req)
    scored = score(model, cluster, work, space)
    chosen = choose(scored, req.target)
    if chosen is None:
        raise_infeasible(model, cluster, work, space, req.summary.name, req.pins.tp)
    cand, est = scored.cand, scored.est
    order = best_per_config(scored, req.target)
    capacity = float(cluster.gpu.hbm_bytes)
    tp, tier, batch = int(cand.tp[chosen]), WEIGHT_TIERS[cand.tier[chosen]], int(cand.batch[chosen])
    precision = WEIGHT_PRECISIONS[cand.precision[chosen]]
    # the serving runtime's continuous batching on the chosen configuration: its paged KV cache and the curve
    serving = plan_continuous_batching(model, cluster, work, tp, precision, tier, float(est.weights[chosen]), batch)
    parallel = InferenceParallel(
        tp=tp, replicas=req.gpus // tp, weight_precision=precision,
        quant_group_size=int(quant_group_size(model, cand.tp[[chosen]])[0]), compute_dtype=req.compute_dtype,
        weight_tier=tier, prefetch_layers=0 if tier == "gpu" else PREFETCH_LAYERS, max_batch=batch,
        max_seq_len=work.max_seq_len, kv_block_tokens=KV_BLOCK_TOKENS, kv_blocks=serving.kv_blocks)
    alternatives = [
        InferenceCandidate(
            tp=int(cand.tp[i]), weight_precision=WEIGHT_PRECISIONS[cand.precision[i]],
            weight_tier=WEIGHT_TIERS[cand.tier[i]], ttft_s=float(est.ttft_s[i]), tpot_s=float(est.tpot_s[i]),
            tokens_per_s=float(est.tokens_per_s[i]), memory_per_gpu_bytes=float(est.total[i]),
            feasible=bool(est.fits[i]),
            interval=serving_interval(float(est.ttft_s[i]), float(est.tpot_s[i]), float(est.request_latency_s[i]),
                                      float(est.tokens_per_s[i])),
            note=(note(scored, int(i), chosen, req.target, capacity)
                  + (f" At batch {cand.batch[i]}." if req.batch is None and i != chosen else "")).strip())
        for i in order
    ]
    plan = InferencePlan(
        zplan_version=__version__, fingerprint=fingerprint(req), model=req.summary, cluster=cluster,
        spec=InferenceSpec(target=req.target, batch=batch, prompt_len=work.prompt_len, gen_len=work.gen_len),
        pins=req.pins, parallel=parallel,
        prediction=prediction(est, chosen, capacity, continuous_batching(serving, parallel.replicas)),
        reason=reason(scored, chosen, req.target, order, req.pins, req.batch is None, req.gpus, capacity),
    )
    return plan, InferenceAlternatives(
        fingerprint=plan.fingerprint, candidates_evaluated=len(cand), alternatives=alternatives,
        assumptions=inference_assumptions(cluster, req.summary, model, work, fp8="fp8" in space.precisions))


def compile_inference_plan(req: InferenceRequest) -> InferencePlan:
    """The InferencePlan alone (plan.json): compile_inference_with_alternatives's first half."""
    return compile_inference_with_alternatives(req)[0]


def continuous_batching(serving: ContinuousBatching, replicas: int) -> ContinuousBatchingPrediction:
    """The planner's curve (one replica) as the plan records it: tokens/s over all replicas."""
    return ContinuousBatchingPrediction(
        kv_budget_bytes=serving.kv_budget_bytes, kv_block_bytes=serving.kv_block_bytes,
        blocks_per_request=serving.blocks_per_request, step_tokens=STEP_TOKENS,
        max_concurrency=serving.max_concurrency,
        points=[ServingPoint(concurrency=p.concurrency, prefill_steps=p.prefill_steps,
                             tokens_per_s=replicas * p.tokens_per_s, tpot_s=p.step_s, ttft_s=p.ttft_s)
                for p in serving.points])


def prediction(est: InferenceEstimate, i: int, capacity: float,
               serving: ContinuousBatchingPrediction | None = None) -> InferencePrediction:
    """The chosen candidate i's numbers as the plan's prediction (`serving`: its continuous-batching curve), with
    their 80 % interval (planner/serving_uncertainty.py)."""

    def f(name: str) -> float:
        return float(getattr(est, name)[i])

    pred = InferencePrediction(
        ttft_s=f("ttft_s"), tpot_s=f("tpot_s"), request_latency_s=f("request_latency_s"),
        tokens_per_s=f("tokens_per_s"), feasible=bool(est.fits[i]),
        memory=InferenceMemory(weights=f("weights"), kv_cache=f("kv_cache"), activations=f("activations"),
                               reserve=f("reserve"), total=f("total"), capacity=capacity,
                               cpu_bytes_per_node=f("cpu_bytes_per_node"),
                               nvme_bytes_per_node=f("nvme_bytes_per_node")),
        time=InferenceTime(**{name: f(name) for name in InferenceTime.model_fields}),
        continuous_batching=serving,
    )
    return pred.model_copy(update={"interval": serving_interval(pred.ttft_s, pred.tpot_s, pred.request_latency_s,
                                                                 pred.tokens_per_s)})


__all__ = ["InferenceRequest", "compile_inference_plan", "compile_inference_with_alternatives", "prepare"]
