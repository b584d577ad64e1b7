"""Public API: compile a plan, write the outputs atomically (one layout estimated as pinned: zplan.estimate_api)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from zplan import __version__
from zplan.codegen.render import render_inference_outputs, render_outputs
from zplan.errors import ClusterError, SpecError
from zplan.model.hf_folder import is_hf_folder, source_sha256, weights_in_folder
from zplan.model_input import summarize_model
from zplan.out_dir import write_out_dir
from zplan.planner.assumptions import assumptions
from zplan.planner.clusters import load_cluster
from zplan.planner.compression import check_compression, check_model_for_compression, compression_decision
from zplan.planner.cost.step import StepEstimate
from zplan.planner.enumerate import pin_words
from zplan.planner.explain import alternatives, parallel_config, rejected_families
from zplan.planner.placement_choice import PlacedStates, decide_delayed_update, place
from zplan.planner.search import choose, score
from zplan.planner.uncertainty import step_interval, with_interval
from zplan.schemas import legality
from zplan.schemas.alternatives import Alternatives, InferenceAlternatives
from zplan.schemas.capability import PIN_OF, capability_problems
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.inference import InferencePlan
from zplan.schemas.model import ModelSummary
from zplan.schemas.plan import (
    Fingerprint,
    MemoryBreakdown,
    Placement,
    Plan,
    Prediction,
    Stage,
    TimeBreakdown,
)
from zplan.schemas.spec import MAX_GLOBAL_BATCH, CompressionConfig, Pins, TrainSpec, compute_dtype


@dataclass(frozen=True)
class Request:
    """A validated compile/estimate request."""

    model_ref: str
    summary: ModelSummary
    cluster: ClusterSpec
    gpus: int
    train: TrainSpec
    pins: Pins
    delayed_update: str = "auto"  # 'auto' | 'on' | 'off': ZeRO-Offload's delayed parameter update


def default_compute_dtype(cluster: ClusterSpec) -> str:
    """The fastest of bf16, fp16 and fp32 on this device, bf16 on ties: bf16 on data-centre GPUs, fp32 on CPU
    profiles (cpu-local's bf16 and fp16 GEMMs run a slow path)."""
    return max(("bf16", "fp16", "fp32"), key=lambda dtype: cluster.peak_flops(dtype))


def prepare(model_ref: str, gpus: int, cluster: str, global_batch: int | None, seq_len: int | None,
            precision: str | None, pins: Pins, delayed_update: str = "auto",
            moe_imbalance: float | None = None) -> Request:
    """Load the cluster and the model and check the request; raises ZplanError subclasses. precision None: the
    device's fastest (default_compute_dtype); moe_imbalance None: balanced routing (with_routing_imbalance)."""
    check_train_sizes(global_batch, seq_len)
    spec = load_cluster(cluster)
    check_gpus(gpus, spec)
    precision = precision or default_compute_dtype(spec)
    if spec.gemm_peak_flops(precision) <= 0 and precision == "fp8":
        raise SpecError(f"{spec.gpu.name} has no fp8 tensor cores (H100, L40S and newer do; the profile's "
                        "gpu.peak_fp8_flops is 0): pass --precision bf16.")
    if spec.gemm_peak_flops(precision) <= 0 and precision == "nvfp4":
        raise SpecError(f"{spec.gpu.name} has no fp4 tensor cores (Blackwell does: dgx-b200, gb200-nvl72, "
                        "gb300-nvl72; the profile's gpu.peak_fp4_flops is 0): pass --precision fp8 or bf16.")
    if spec.peak_flops(precision) <= 0:
        raise SpecError(f"{spec.gpu.name} has no {precision} support: pass --precision fp16 (or fp32).")
    check_pins(gpus, pins)
    check_delayed_update(delayed_update, pins)
    check_compression(pins.compress, pins, gpus, delayed_update)
    _, summary = summarize_model(model_ref, seq_len, compute_dtype(precision))
    summary = with_routing_imbalance(summary, moe_imbalance)
    check_pins_against_model(pins, summary, precision)
    check_model_for_compression(pins.compress, summary)
    batch = global_batch if global_batch is not None else default_global_batch(gpus)
    dp = pins.dp or (gpus // (pins.tp * pins.pp * (pins.cp or 1)) if pins.tp and pins.pp else None)
    if dp is not None and batch % dp:
        raise SpecError(f"global batch {batch} does not divide by the data-parallel degree {dp}: pass "
                        f"--global-batch {(batch // dp + 1) * dp} (a multiple of {dp}).")
    train = TrainSpec(global_batch=batch, seq_len=summary.seq_len, precision=precision)
    return Request(model_ref, summary, spec, gpus, train, pins, delayed_update)


def with_routing_imbalance(summary: ModelSummary, imbalance: float | None) -> ModelSummary:
    """`summary` with its experts' routing assumed `imbalance` (--moe-imbalance: the busiest expert-parallel rank's
    tokens over the mean), SpecError for a dense model or a value outside 1 .. E / k (the busiest expert gets every
    token at most)."""
    if imbalance is None:
        return summary
    experts = summary.experts
    if experts is None:
        raise SpecError(f"--moe-imbalance {imbalance}: the model has no routed experts (a mixture of experts' "
                        "routing); drop the option")
    most = experts.num_experts / experts.top_k
    if not 1.0 <= imbalance <= most:
        raise SpecError(f"--moe-imbalance {imbalance} is outside 1 (balanced) .. {most:g} (E / k = "
                        f"{experts.num_experts} / {experts.top_k}: every token at the busiest expert): pass a value "
                        "in that range")
    return summary.model_copy(update={"experts": experts.model_copy(update={"imbalance": float(imbalance)})})


def default_global_batch(gpus: int) -> int:
    """One sequence per GPU, at least 8: a starting point; pass --global-batch for the real one."""
    return max(8, gpus)


# Bounds of the request's sizes: far beyond any run (GPT-3 trained on 1536 sequences of 2048 tokens per step), and
# small enough that every search over them ends in seconds.
MAX_GPUS = 1 << 20
MAX_SEQ_LEN = 1 << 24  # and MAX_GLOBAL_BATCH (zplan.schemas.spec: a pinned micro-batch is bounded by it too)


def check_train_sizes(global_batch: int | None, seq_len: int | None) -> None:
    """--global-batch and --seq, where given, within 1 .. their bound."""
    for option, value, bound in (("--global-batch", global_batch, MAX_GLOBAL_BATCH), ("--seq", seq_len, MAX_SEQ_LEN)):
        if value is not None and not 1 <= value <= bound:
            raise SpecError(f"{option} must be 1 to {bound:,} (got {value:,}).")


def check_gpus(gpus: int, cluster: ClusterSpec) -> None:
    if not 1 <= gpus <= MAX_GPUS:
        raise ClusterError(f"--gpus must be 1 to {MAX_GPUS:,} (got {gpus:,}).")
    if gpus > cluster.gpus_per_node and gpus % cluster.gpus_per_node:
        lower = gpus // cluster.gpus_per_node * cluster.gpus_per_node
        raise ClusterError(
            f"{gpus} GPUs is not a whole number of {cluster.name} nodes ({cluster.gpus_per_node} GPUs each): "
            f"pass --gpus {lower} or {lower + cluster.gpus_per_node}."
        )


# The pins check_pins reads as schemas.legality's fields (their names are the same).
PINNED_FIELDS = ("tp", "pp", "cp", "ep", "zero", "offload", "sequence_parallel", "interleave")


def check_pins(gpus: int, pins: Pins) -> None:
    """Contradicting pins fail here, before any search, with the fix."""
    tp, pp, dp, cp = pins.tp or 1, pins.pp or 1, pins.dp or 1, pins.cp or 1
    if gpus % (tp * pp * dp * cp):
        raise SpecError(f"pins tp={tp} x pp={pp} x dp={dp} x cp={cp} do not divide {gpus} GPUs: choose degrees whose "
                        f"product divides {gpus}.")
    if pins.tp and pins.pp and pins.dp and tp * pp * dp * cp != gpus:
        raise SpecError(f"tp*pp*dp*cp = {tp * pp * dp * cp} but --gpus is {gpus}: drop one pin or make the product "
                        f"{gpus}.")
    # the combinations schemas.legality rules out; --compress is check_compression's, with the pins it needs
    pinned = legality.config(**{f: getattr(pins, f) for f in PINNED_FIELDS})
    for rule in legality.violations(pinned):
        named = " and ".join(pin_words(pins, f) for f in rule.fields)
        raise SpecError(f"the pins {named} conflict: {rule.reason}: {rule.fix}.")


def check_pins_against_model(pins: Pins, summary: ModelSummary, precision: str = "bf16") -> None:
    """A pin asking for a parallelism the runtime cannot run on this model fails here, naming the module and the
    pin to change (schemas.capability)."""
    problems = capability_problems(summary.traits, pins.tp or 1, pins.pp or 1, bool(pins.sequence_parallel),
                                   names=PIN_OF, block_tokens=summary.block_tokens, fp8=precision == "fp8",
                                   nvfp4=precision == "nvfp4", cp=pins.cp or 1, ep=pins.ep or 1)
    if problems:
        raise SpecError("; ".join(problems) + ".")


def check_delayed_update(mode: str, pins: Pins) -> None:
    """--delayed-update on with pins that rule out a ZeRO-1 CPU-offload plan fails here, before any search."""
    if mode not in ("auto", "on", "off"):
        raise SpecError(f"--delayed-update must be auto, on or off (got {mode!r}).")
    rules = legality.applicable(dict.fromkeys(("delayed_update", "zero", "offload")))
    conflicts = [pin_words(pins, f) for f in ("zero", "offload") if getattr(pins, f) is not None and not
                 legality.satisfiable(legality.config(delayed_update=1, **{f: getattr(pins, f)}), rules)]
    if mode == "on" and conflicts:
        raise SpecError(f"--delayed-update on needs ZeRO-1 with the optimizer offloaded to the CPU (the only case "
                        f"zplan's runtime delays the update), which {' and '.join(conflicts)} rule out: pin "
                        f"--zero 1 --offload cpu, or pass --delayed-update auto.")


def fingerprint(req: Request) -> Fingerprint:
    path = Path(req.model_ref)
    if is_hf_folder(path):  # its config.json, and the weights in it that train.py starts from
        return Fingerprint(model_ref=req.model_ref, model_sha256=source_sha256(path), cluster=req.cluster.name,
                           world_size=req.gpus, init_from=weights_in_folder(path))
    data = path.read_bytes() if path.is_file() else req.model_ref.encode()
    return Fingerprint(model_ref=req.model_ref, model_sha256=hashlib.sha256(data).hexdigest(),
                       cluster=req.cluster.name, world_size=req.gpus)


def prediction(est: StepEstimate, cluster: ClusterSpec, placed: PlacedStates | None = None,
               overlapped_s: float = 0.0) -> Prediction:
    """Prediction of candidate 0 of `est`; `placed` replaces the model-state terms by the solver's placement;
    `overlapped_s`: the part of the offload time the delayed parameter update hides behind compute."""
    mem = est.memory
    states = dict(parameters=float(mem.parameters[0]), gradients=float(mem.gradients[0]),
                  optimizer=float(mem.optimizer[0]), cpu_bytes_per_node=float(mem.cpu_bytes_per_node[0]),
                  nvme_bytes_per_node=float(mem.nvme_bytes_per_node[0]))
    offload_s, optimizer_s = float(est.offload_s[0]), float(est.optimizer_s[0])
    feasible = bool(mem.fits[0])
    if placed is not None:
        states = dict(parameters=placed.parameters, gradients=placed.gradients, optimizer=placed.optimizer,
                      cpu_bytes_per_node=placed.cpu_bytes_per_node, nvme_bytes_per_node=placed.nvme_bytes_per_node)
        offload_s, optimizer_s = placed.offload_s - overlapped_s, placed.optimizer_s
        feasible = feasible and placed.feasible
    others = float(mem.activations[0] + mem.comm_buffers[0] + mem.reserve[0])
    # not live at the peak (planner.cost.memory), less the gradients the placement takes off the GPU
    moved = max(0.0, float(mem.gradients[0]) - states["gradients"])
    not_at_peak = max(0.0, float(mem.not_at_peak[0]) - moved)
    total = states["parameters"] + states["gradients"] + states["optimizer"] + others - not_at_peak
    terms = {name: float(value[0]) for name, value in mem.terms.items()}
    terms.update({"weights": states["parameters"], "gradients": states["gradients"],
                  "optimizer states": states["optimizer"], "not live at the peak": -not_at_peak})
    terms = {name: value for name, value in terms.items() if value}  # plan.json keeps the terms that add up
    step = float(est.step_time_s[0] - est.offload_s[0] - est.optimizer_s[0]) + offload_s + optimizer_s
    return Prediction(
        step_time_s=step, tokens_per_s=float(est.tokens_per_s[0] * est.step_time_s[0] / step),
        mfu=float(est.mfu[0] * est.step_time_s[0] / step), model_flops_per_step=float(est.model_flops_per_step),
        feasible=feasible and total <= cluster.gpu.hbm_bytes,
        memory=MemoryBreakdown(activations=float(mem.activations[0]), comm_buffers=float(mem.comm_buffers[0]),
                               reserve=float(mem.reserve[0]), not_at_peak=not_at_peak, total=total,
                               capacity=float(cluster.gpu.hbm_bytes), terms=terms,
                               **states),
        time=TimeBreakdown(
            compute=float(est.compute_s[0]), tensor_parallel=float(est.tensor_parallel_s[0]),
            context_parallel=float(est.context_parallel_s[0]), expert_parallel=float(est.expert_parallel_s[0]),
            pipeline_bubble=float(est.pipeline_bubble_s[0]), pipeline_p2p=float(est.pipeline_p2p_s[0]),
            data_parallel=float(est.data_parallel_s[0]), offload=offload_s, optimizer=optimizer_s),
    )


def deepest_tier(placement: Placement) -> str:
    """'nvme', 'cpu' or 'none': the offload the run needs for this placement of the model states."""
    tiers = {placement.parameters, placement.gradients, placement.optimizer}
    return "nvme" if "nvme" in tiers else "cpu" if "cpu" in tiers else "none"


def runnable_pins(req: Request) -> Pins:
    """The pins the search runs under: the request's, plus tp 1 under nvfp4 (runtime/precision/nvfp4.py runs without
    tensor parallel; `zplan estimate` still prices a tp > 1 layout, and train.py refuses it, runtime.plan.check)."""
    rule = legality.BY_NAME["nvfp4_needs_tp1"]
    if not legality.violations(legality.config(precision=req.train.precision, tp=2), [rule]):
        return req.pins
    if (req.pins.tp or 1) > 1:
        raise SpecError(f"--precision {req.train.precision}: {rule.reason}, and --tp {req.pins.tp} asks for it: pin "
                        "--tp 1, or --precision fp8 or bf16.")
    return req.pins.model_copy(update={"tp": 1})


def compile_with_alternatives(req: Request) -> tuple[Plan, Alternatives]:
    """Search, refine and assemble the Plan and what the search scored besides it (alternatives.json; no files
    written)."""
    user_pins = req.pins
    search_pins = runnable_pins(req)
    scored = score(req.summary, req.cluster, req.gpus, req.train, search_pins)
    choice, refined = choose(req.summary, req.cluster, req.gpus, req.train, search_pins, scored)
    cand, est = choice.candidate, choice.estimate
    placed = place(cand, est, req.cluster, req.train, pinned=req.pins.offload is not None)
    layers = req.summary.layers
    stages = [
        Stage(index=s, first_layer=a, last_layer=b, layer_names=[u.name for u in layers[a:b + 1]],
              fwd_flops_per_sample=float(sum(u.fwd_flops for u in layers[a:b + 1])),
              # a tied head's table is the embedding's on stage 0, a copy on a later stage (LayerCost.shared_params)
              params=int(sum(u.params + (u.shared_params if a > 0 else 0) for u in layers[a:b + 1])))
        for s, (a, b) in enumerate(choice.partition.boundaries)
    ]
    # An --offload pin is what the run offloads (the placement put the optimizer states on that tier); unpinned,
    # the run offloads what the placement put off the GPU (the search's tier is an allowance: the solver uses it
    # only when the states do not fit on the GPU, planner.placement).
    delayed, decision = decide_delayed_update(req.delayed_update, int(cand.zero[0]), placed, est, req.cluster)
    compression = req.pins.compress or CompressionConfig()
    parallel = parallel_config(cand, 0, est.num_micro_batches[0], req.summary).model_copy(
        update=dict(offload=req.pins.offload or deepest_tier(placed.placement), delayed_update=delayed,
                    compression=compression))
    predicted = with_interval(prediction(est, req.cluster, placed, decision.saved_s if delayed else 0.0), parallel,
                              req.train.precision, req.summary, req.cluster)
    # Every candidate of the search carries the pinned compression (planner.enumerate); so do their configs.
    others = [alt.model_copy(update={
        "parallel": alt.parallel.model_copy(update={"compression": compression}),
        "step_time_s_interval": step_interval(alt.step_time_s, alt.parallel, req.train.precision, req.summary,
                                              req.cluster)})
        for alt in alternatives(scored, refined, choice, req.summary, req.cluster, req.train)]
    plan = Plan(
        zplan_version=__version__, fingerprint=fingerprint(req), model=req.summary, cluster=req.cluster,
        train=req.train, pins=user_pins, parallel=parallel, stages=stages, placement=placed.placement,
        delayed_update=decision,
        compression=compression_decision(req.summary, req.cluster, req.train, choice, predicted.step_time_s),
        prediction=predicted,
    )
    search = Alternatives(fingerprint=plan.fingerprint, candidates_evaluated=len(scored.candidates),
                          alternatives=others,
                          rejected=rejected_families(scored, choice, req.summary, req.cluster, req.train),
                          assumptions=assumptions(req.cluster, req.summary, req.train))
    return plan, search


def compile_plan(req: Request) -> Plan:
    """The Plan alone (plan.json), for callers that need no alternatives: compile_with_alternatives's first half."""
    return compile_with_alternatives(req)[0]


def write_outputs(plan: Plan | InferencePlan, out_dir: Path, model_ref: str, force: bool = False,
                  alternatives: Alternatives | InferenceAlternatives | None = None,
                  extra_files: dict[str, str] | None = None) -> list[Path]:
    """Render everything (a training Plan or an InferencePlan, alternatives.json when `alternatives` is given, and
    `extra_files`: name -> text, e.g. `zplan plan`'s curve) beside `out_dir` and swap it in all or nothing
    (zplan.out_dir: a new folder is renamed into place; in an existing one, files zplan did not write are kept, and a
    path in the way or a file changed since zplan wrote it is refused unless `force`)."""
    render = render_inference_outputs if isinstance(plan, InferencePlan) else render_outputs
    model_path = Path(model_ref)
    script_model = (os.path.relpath(model_path.resolve(), Path(out_dir).resolve()) if model_path.is_file()
                    or is_hf_folder(model_path) else None)

    def write(folder: Path) -> list[Path]:
        written = render(plan, folder, script_model, alternatives)
        for name, text in (extra_files or {}).items():
            (folder / name).write_text(text, encoding="utf-8", newline="\n")
            written.append(folder / name)
        return written

    return write_out_dir(out_dir, write, force=force)


__all__ = ["Request", "compile_plan", "compile_with_alternatives", "prepare", "write_outputs"]
