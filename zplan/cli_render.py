"""Terminal tables for the CLI (rich). Formatting only: no costs are computed here."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError
from rich import box
from rich.console import Console
from rich.table import Table

from zplan.codegen.context import format_seconds
from zplan.errors import ZplanError, validation_message
from zplan.safe_files import UnsafeFileError, read_capped
from zplan.schemas.alternatives import ALTERNATIVES_FILE, Alternatives, InferenceAlternatives
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.inference import InferencePlan, ServingInterval
from zplan.schemas.plan import MAX_PLAN_FILE_BYTES, Plan, PredictionInterval

GiB = 1024**3


def default_out_dir(model_ref: str) -> Path:
    stem = Path(model_ref).stem if Path(model_ref).is_file() else model_ref.split(":", 1)[0]
    return Path("out") / stem


def _read_json(path: Path, what: str, kind: str, hint: str) -> tuple[str, object]:
    """The text of a JSON file zplan wrote and its parsed value; ZplanError saying why not (`what` names the file,
    e.g. 'the plan', `kind` what it should be, e.g. 'a plan')."""
    try:
        text = read_capped(path, MAX_PLAN_FILE_BYTES, what).decode()
        return text, json.loads(text)
    except UnsafeFileError as exc:
        raise ZplanError(f"{exc}; {hint}.") from None
    except OSError as exc:
        raise ZplanError(f"cannot read {path}: {exc.strerror}. {hint[0].upper()}{hint[1:]}.") from exc
    except RecursionError:
        raise ZplanError(f"{path} is not {kind} (its JSON is nested too deeply to read): {hint}.") from None
    except ValueError as exc:
        raise ZplanError(f"{path} is not JSON ({exc}): {hint}.") from exc


def load_plan_file(path: Path) -> Plan | InferencePlan:
    """A training or an inference plan.json (told apart by its "mode"). A plan.json of an older zplan, with the
    search's alternatives inside (plan schema v1), is refused with the fix: recompile."""
    text, data = _read_json(path, "the plan", "a plan", "pass the plan.json written by `zplan compile`")
    inference = isinstance(data, dict) and data.get("mode") == "inference"
    schema, kind = (InferencePlan, "inference plan") if inference else (Plan, "plan")
    if isinstance(data, dict) and "alternatives" in data:
        version = schema.model_fields["schema_version"].default
        raise ZplanError(f"{path} was written by an older zplan (plan schema v{data.get('schema_version')}, with the "
                         f"alternatives inside); this zplan reads plan schema v{version}, with the alternatives in "
                         f"{ALTERNATIVES_FILE} beside it: recompile it.")
    try:
        return schema.model_validate_json(text)
    except ValidationError as exc:
        raise ZplanError(f"{path} is not a zplan {kind} ({exc.error_count()} schema errors: "
                         f"{validation_message(exc)}): recompile it.") from None


def load_alternatives_file(plan_path: Path, plan: Plan | InferencePlan) -> Alternatives | InferenceAlternatives:
    """alternatives.json beside `plan_path`, checked to be of the same compile as `plan` (its fingerprint)."""
    path = Path(plan_path).parent / ALTERNATIVES_FILE
    hint = f"recompile the model: `zplan compile` writes {ALTERNATIVES_FILE} beside plan.json"
    if not path.exists():
        raise ZplanError(f"no {ALTERNATIVES_FILE} beside {plan_path}: {hint}.")
    text, _ = _read_json(path, "the alternatives", "alternatives", hint)
    schema = InferenceAlternatives if isinstance(plan, InferencePlan) else Alternatives
    try:
        alternatives = schema.model_validate_json(text)
    except ValidationError as exc:
        raise ZplanError(f"{path} is not the alternatives of a zplan {getattr(plan, 'mode', 'training')} plan "
                         f"({exc.error_count()} schema errors: {validation_message(exc)}): {hint}.") from None
    if alternatives.fingerprint != plan.fingerprint:
        raise ZplanError(f"{path} is of another compile than {plan_path} (made for "
                         f"{alternatives.fingerprint.model_ref} on {alternatives.fingerprint.world_size} x "
                         f"{alternatives.fingerprint.cluster}): {hint}.")
    return alternatives


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


# How the model's numbers were obtained (ModelSummary.tracer), in words
HOW_COUNTED = {"fx": "traced with torch.fx", "hooks": "traced with module hooks", "export": "traced with torch.export",
               "closed-form": "counted by the family's formulas"}


def _model_line(model) -> str:
    """Parameters, layers (the repeated blocks the plan splits) and how they were counted."""
    active = f" ({_count(model.experts.active_params)} active)" if model.experts else ""
    layers = f"{model.num_blocks} layer{'s' if model.num_blocks != 1 else ''}"
    return (f"{_count(model.params)} parameters{active}, {layers}, "
            f"{HOW_COUNTED.get(model.tracer, model.tracer)}")


def _config_line(p) -> str:
    sp = " +SP" if p.sequence_parallel else ""
    cp = f" cp={p.cp}" if p.cp > 1 else ""
    cp += f" ep={p.ep}" if p.ep > 1 else ""
    return (f"tp={p.tp} pp={p.pp} dp={p.dp}{cp} micro-batch={p.micro_batch} x{p.num_micro_batches} "
            f"ZeRO-{p.zero_stage} recompute={p.recompute}{sp} schedule={p.schedule}"
            f"{f' v={p.interleave}' if p.interleave > 1 else ''} offload={p.offload}")


def print_plan_summary(console: Console, plan: Plan, alternatives: Alternatives, out_dir: Path,
                       files: list[Path]) -> None:
    pred, mem, t = plan.prediction, plan.prediction.memory, plan.prediction.time
    table = Table(title=f"zplan: {plan.model.name} on {plan.fingerprint.world_size}x {plan.cluster.gpu.name}",
                  show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("model", _model_line(plan.model))
    table.add_row("batch", f"{plan.train.global_batch} x {plan.train.seq_len} tokens, {plan.train.precision}")
    table.add_row("plan", _config_line(plan.parallel))
    table.add_row("step time", f"{pred.step_time_s:.3f} s  ({pred.tokens_per_s:,.0f} tokens/s, MFU {pred.mfu:.1%})"
                               + interval_words(pred.interval))
    ep = f"EP {t.expert_parallel:.3f}, " if plan.parallel.ep > 1 else ""
    table.add_row("time parts", f"compute {t.compute:.3f} s, TP {t.tensor_parallel:.3f}, {ep}bubble "
                                f"{t.pipeline_bubble:.3f}, p2p {t.pipeline_p2p:.3f}, DP {t.data_parallel:.3f}, "
                                f"offload {t.offload:.3f}, optimizer {t.optimizer:.3f}")
    table.add_row("memory/GPU", f"{mem.total / GiB:.1f} of {mem.capacity / GiB:.1f} GiB (weights "
                                f"{mem.parameters / GiB:.1f}, grads {mem.gradients / GiB:.1f}, optimizer "
                                f"{mem.optimizer / GiB:.1f}, activations {mem.activations / GiB:.1f})")
    table.add_row("searched", f"{alternatives.candidates_evaluated:,} configurations")
    table.add_row("written", f"{out_dir}/ ({len(files)} files: plan.json, train.py, launch/, report.html, ...)")
    console.print(table)


def print_estimate(console: Console, result: dict) -> None:
    table = Table(title=f"estimate: {result['model']} on {result['gpus']}x {result['cluster']}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    c = result["config"]
    cp = f" cp={c['cp']}" if c.get("cp", 1) > 1 else ""
    cp += f" ep={c['ep']}" if c.get("ep", 1) > 1 else ""
    table.add_row("config", f"tp={c['tp']} pp={c['pp']} dp={c['dp']}{cp} micro-batch={c['micro_batch']} "
                            f"x{c['num_micro_batches']:g} ZeRO-{c['zero_stage']} recompute={c['recompute']} "
                            f"offload={c['offload']}")
    table.add_row("feasible", "yes" if result["feasible"] else "NO (does not fit memory)")
    if not result.get("runtime_runs_it", True):
        table.add_row("runs on zplan", "NO: a prediction only (the warnings say why)")
    table.add_row("step time", f"{result['step_time_s']:.3f} s, MFU {result['mfu']:.1%}"
                  + interval_words(PredictionInterval(**result["interval"])))
    table.add_row("memory/GPU", f"{result['memory_per_gpu_bytes'] / GiB:.1f} GiB")
    over = result.get("over_memory")
    if over:
        table.add_row("over memory", over["summary"])
        table.add_row("would fit", ", ".join(over["fixes"]) or "nothing tried would fit: use a larger GPU")
    for warning in result.get("warnings", []):
        table.add_row("warning", warning)
    console.print(table)


def print_explanation(console: Console, plan: Plan, alternatives: Alternatives) -> None:
    console.print(f"[bold]chosen:[/] {_config_line(plan.parallel)}: {plan.prediction.step_time_s:.3f} s/step, "
                  f"{plan.prediction.memory.total / GiB:.1f} GiB/GPU" + interval_words(plan.prediction.interval))
    table = Table(title="best alternatives (near-tie: its 80 % interval overlaps the chosen plan's)")
    for col in ("#", "configuration", "step s", "80 % interval", "vs chosen", "GiB/GPU", "near-tie"):
        table.add_column(col)
    ranked = sorted((c for c in alternatives.alternatives if c.feasible), key=lambda c: c.step_time_s)[:10]
    mine = plan.prediction.interval
    for i, c in enumerate(ranked, 1):
        ratio = c.step_time_s / plan.prediction.step_time_s - 1
        low_high = c.step_time_s_interval
        tied = mine is not None and low_high is not None and mine.overlaps(low_high)
        table.add_row(str(i), _config_line(c.parallel), f"{c.step_time_s:.3f}",
                      f"{low_high[0]:.3f} - {low_high[1]:.3f}" if low_high else "-", f"{ratio:+.1%}",
                      f"{c.memory_per_gpu_bytes / GiB:.1f}", "yes" if tied else "")
    console.print(table)
    rej = Table(title="why other families lost")
    for col in ("family", "reason", "detail"):
        rej.add_column(col)
    for r in alternatives.rejected:
        rej.add_row(r.family, r.reason, r.detail)
    console.print(rej)


def interval_words(interval: PredictionInterval | None) -> str:
    """'; 80 %: 1.20 - 1.60 s (3D, 13 published runs)' for a prediction's interval, '' without one."""
    if interval is None:
        return ""
    low, high = interval.step_time_s
    runs = {"validation": f"{interval.runs} published runs", "thin": f"only {interval.runs} published runs",
            "unseen": "no published run: calibrate", "calibration": f"{interval.runs} of your runs"}[interval.basis]
    return f"; {interval.level:.0%}: {low:.3f} - {high:.3f} s ({interval.regime}, {runs})"


def serving_interval_words(interval: ServingInterval) -> str:
    """'TTFT 70.1 - 90.2 ms, TPOT ..., request ...; 1,100.0 - 1,500.0 tokens/s (87 published TensorRT-LLM runs)'."""
    parts = ", ".join(f"{name} {format_seconds(low)} - {format_seconds(high)}" for name, (low, high) in (
        ("TTFT", interval.ttft_s), ("TPOT", interval.tpot_s), ("request", interval.request_latency_s)))
    low, high = interval.tokens_per_s
    runs = f"{interval.runs} published TensorRT-LLM runs" + ("" if interval.basis == "validation"
                                                             else f", {interval.basis}")
    return f"{parts}; {low:,.1f} - {high:,.1f} tokens/s ({runs})"


def print_inference_summary(console: Console, plan: InferencePlan, alternatives: InferenceAlternatives, out_dir: Path,
                            files: list[Path]) -> None:
    pred, mem, par, t = plan.prediction, plan.prediction.memory, plan.parallel, plan.prediction.time
    table = Table(title=f"zplan inference: {plan.model.name} on {plan.fingerprint.world_size}x "
                        f"{plan.cluster.gpu.name}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("model", _model_line(plan.model))
    table.add_row("request", f"target {plan.spec.target}, batch {plan.spec.batch} per replica, prompt "
                             f"{plan.spec.prompt_len} + {plan.spec.gen_len} generated tokens")
    table.add_row("plan", f"{par.replicas} replica(s) x tp={par.tp}, {par.weight_precision} weights on "
                          f"{par.weight_tier}, {par.compute_dtype} compute")
    table.add_row("latency", f"TTFT {format_seconds(pred.ttft_s)}, TPOT {format_seconds(pred.tpot_s)}, request "
                             f"{format_seconds(pred.request_latency_s)}")
    table.add_row("throughput", f"{pred.tokens_per_s:,.1f} tokens/s")
    if pred.interval is not None:
        table.add_row(f"{pred.interval.level:.0%} interval", serving_interval_words(pred.interval))
    table.add_row("decode step", f"weights {format_seconds(t.decode_weights_s)}, KV {format_seconds(t.decode_kv_s)}, "
                                 f"compute {format_seconds(t.decode_compute_s)}, TP {format_seconds(t.decode_tp_s)}, "
                                 f"stream {format_seconds(t.decode_stream_s)}")
    table.add_row("memory/GPU", f"{mem.total / GiB:.1f} of {mem.capacity / GiB:.1f} GiB (weights "
                                f"{mem.weights / GiB:.1f}, KV cache {mem.kv_cache / GiB:.1f}, activations "
                                f"{mem.activations / GiB:.2f})")
    table.add_row("why", plan.reason)
    table.add_row("searched", f"{alternatives.candidates_evaluated:,} configurations")
    table.add_row("written", f"{out_dir}/ ({len(files)} files: plan.json, report.html, generate.py, serve.py, ...)")
    console.print(table)


def print_inference_explanation(console: Console, plan: InferencePlan, alternatives: InferenceAlternatives) -> None:
    par, pred = plan.parallel, plan.prediction
    console.print(f"[bold]chosen:[/] {par.replicas} x tp={par.tp} {par.weight_precision} weights on "
                  f"{par.weight_tier}, batch {plan.spec.batch}: TTFT {format_seconds(pred.ttft_s)}, TPOT "
                  f"{format_seconds(pred.tpot_s)}, "
                  f"{pred.tokens_per_s:,.1f} tokens/s, {pred.memory.total / GiB:.1f} GiB/GPU")
    console.print(f"[bold]why:[/] {plan.reason}", highlight=False)
    table = Table(title=f"alternatives (target {plan.spec.target}, best first)")
    for col in ("#", "configuration", "TTFT", "TPOT", "tokens/s", "GiB/GPU", "fits", "note"):
        table.add_column(col)
    for i, c in enumerate(alternatives.alternatives, 1):
        table.add_row(str(i), f"tp={c.tp} {c.weight_precision} {c.weight_tier}", format_seconds(c.ttft_s),
                      format_seconds(c.tpot_s), f"{c.tokens_per_s:,.1f}", f"{c.memory_per_gpu_bytes / GiB:.1f}",
                      "yes" if c.feasible else "no", c.note)
    console.print(table)


def print_clusters(console: Console, clusters: dict[str, ClusterSpec]) -> None:
    """Two tables that fit 80 columns (the GPU; the node and its links), two-line headers, no column rules;
    `zplan clusters --json` has every field."""
    def table(title: str, headers: tuple[str, ...]) -> Table:
        made = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        made.add_column("cluster", no_wrap=True)
        for header in headers:
            made.add_column(header, justify="left" if header == "GPU" else "right", no_wrap=True)
        return made

    def tflops(flops: float) -> str:  # 2 significant digits below 10 TFLOP/s (a CPU core: 0.0019)
        return "-" if not flops else f"{flops / 1e12:.0f}" if flops >= 10e12 else f"{flops / 1e12:.2g}"

    gpus = table("built-in clusters: the GPU",
                 ("GPU", "HBM\nGB", "HBM\nGB/s", "bf16\nTFLOP/s", "fp8\nTFLOP/s", "fp4\nTFLOP/s"))
    links = table("per node (bandwidths per GPU and direction)",
                  ("GPUs", "NVLink\ndomain", "NVLink\nGB/s", "network\nGB/s", "PCIe\nGB/s", "host\nGB",
                   "NVMe\nTB"))
    for c in clusters.values():
        g = c.gpu
        gpus.add_row(c.name, g.name, f"{g.hbm_bytes / 1e9:.0f}", f"{g.hbm_bandwidth_Bps / 1e9:.0f}",
                     tflops(g.peak_bf16_flops), tflops(g.peak_fp8_flops), tflops(g.peak_fp4_flops))
        links.add_row(c.name, str(c.gpus_per_node), str(c.link_domain()), f"{c.intra_node_bandwidth_Bps / 1e9:.0f}",
                      f"{c.inter_node_bandwidth_Bps / 1e9:.2f}", f"{c.host_to_device_bandwidth_Bps / 1e9:.0f}",
                      f"{c.cpu_memory_bytes / 1e9:.0f}", f"{c.nvme_bytes / 1e12:.0f}")
    console.print(gpus)
    console.print()
    console.print(links)
