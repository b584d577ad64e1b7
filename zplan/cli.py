"""The `zplan` command line: compile | plan | estimate | explain | export | clusters | probe | reduce | dryrun | data.

User errors (ZplanError) print one message on stderr, no traceback, and exit with status 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from pydantic import ValidationError
from rich.console import Console

from zplan.calibrate_cli import calibrate_command
from zplan.cli_options import DelayedUpdate, Mode, Offload, Precision, Recompute, Target, WeightPrecision
from zplan.cli_render import (
    default_out_dir,
    load_alternatives_file,
    load_plan_file,
    print_clusters,
    print_estimate,
    print_explanation,
    print_inference_explanation,
    print_inference_summary,
    print_plan_summary,
)
from zplan.data_cli import data_app
from zplan.dryrun_cli import dryrun_command
from zplan.errors import ClusterError, SpecError, ZplanError, validation_message
from zplan.out_dir import check_out_dir, check_out_file, write_text_atomically
from zplan.plan_cli import plan_command
from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.reduce_cli import reduce_command
from zplan.runtime.plan.check import runtime_gaps
from zplan.schemas.inference import InferencePlan
from zplan.schemas.spec import Pins
from zplan.serve_cli import serve_command

# rich_markup_mode=None: click's plain help, which wraps each option's text beside its name at any width; rich's
# seven-column option table leaves compile's help texts about 15 characters at 80 columns and cuts words with "…"
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Plan 3D-parallel + ZeRO training, prove it fits, emit the program that runs it.")
err = Console(stderr=True)
out = Console()


MAX_PROBE_SECONDS = 3600.0

DEFAULT_CLUSTER = "dgx-a100-80g"  # what --cluster plans for when not given (a note on stderr says so)
MODEL_METAVAR = "MODEL"  # a model file or a family spec
MODEL_HELP = ("A Python file that defines build_model() (zplan runs it: only files you trust), or a model family "
              "with its sizes, e.g. gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200")


def _pins(tp, pp, dp, zero, offload, micro_batch, recompute, sequence_parallel, interleave, compress=None,
          cp=None, ep=None) -> Pins:
    from zplan.planner.compression import parse_compress  # start-up time: numpy and the cost model

    if zero is not None and zero not in (0, 1, 2, 3):
        raise ZplanError(f"--zero must be 0, 1, 2 or 3 (got {zero}).")
    compression = parse_compress(compress) if compress is not None else None
    try:
        return Pins(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero=zero, offload=offload.value if offload else None,
                    micro_batch=micro_batch, recompute=recompute.value if recompute else None,
                    sequence_parallel=sequence_parallel, interleave=interleave, compress=compression)
    except ValidationError as exc:
        raise ZplanError(f"invalid pin: {validation_message(exc)}") from None


def _fail(exc: ZplanError) -> None:
    err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True, markup=True)
    raise typer.Exit(code=2)


# Options shared by compile and estimate.
GPUS = typer.Option(..., "--gpus", metavar="N", help="Number of GPUs.")
CLUSTER = typer.Option(None, "--cluster", metavar="NAME|FILE",
                       help=f"The hardware: a built-in profile (see `zplan clusters`) or a YAML/JSON file "
                            f"(default: {DEFAULT_CLUSTER}).")
BATCH = typer.Option(None, "--global-batch", help="Sequences per optimizer step (default: max(8, gpus)).")
SEQ = typer.Option(None, "--seq", help="Sequence length (default: the model's).")
PRECISION = typer.Option(None, "--precision", help="Compute precision (default: the device's fastest of bf16, fp16 "
                                                  "and fp32: bf16 on data-centre GPUs, fp32 on cpu-local); fp8: the "
                                                  "layers' matrix multiplies in fp8, all else bf16; nvfp4: those in "
                                                  "4-bit NVFP4 (tp 1), all else bf16.")
TP = typer.Option(None, "--tp", help="Pin the tensor-parallel degree.")
PP = typer.Option(None, "--pp", help="Pin the pipeline-parallel degree.")
DP = typer.Option(None, "--dp", help="Pin the data-parallel degree.")
CP = typer.Option(None, "--cp", help="Pin the context-parallel degree: each sequence split over cp GPUs (default: "
                                     "searched where each GPU keeps at least 4096 tokens of a sequence).")
EP = typer.Option(None, "--ep", help="Pin the expert-parallel degree of a mixture of experts: its routed experts split "
                                     "over ep data-parallel ranks (ep divides the experts and dp; the runtime runs it "
                                     "with ZeRO 0 or 1). Searched inside the NVLink domain (default: the search's).")
MOE_IMBALANCE = typer.Option(None, "--moe-imbalance", metavar="F",
                             help="A mixture of experts' routing: the busiest expert-parallel rank gets F times the "
                                  "mean routed tokens (1 to E / k; default 1: balanced, as published benchmarks "
                                  "force it). Prices its compute, all-to-alls and activations.")
ZERO = typer.Option(None, "--zero", help="Pin the ZeRO stage (0-3).")
OFFLOAD = typer.Option(None, "--offload", help="Pin where optimizer states live: none (the GPU), cpu or nvme (these "
                                                "need ZeRO >= 1; default: the search's choice).")
MICRO = typer.Option(None, "--micro-batch", help="Pin the micro-batch size.")
RECOMPUTE = typer.Option(None, "--recompute", help="Pin activation recompute.")
SP = typer.Option(None, "--sequence-parallel/--no-sequence-parallel", help="Pin sequence parallelism.")
INTERLEAVE = typer.Option(None, "--interleave", help="Pin model chunks per pipeline stage.")
JSON = typer.Option(False, "--json", help="Print JSON on stdout instead of tables.")
FORCE = typer.Option(False, "--force", help="Overwrite files in the -o folder that were changed since zplan wrote "
                                            "them (default: refuse, naming them, and change nothing).")
COMPRESS = typer.Option(
    None, "--compress",
    help="Compressed communication, key=value pairs separated by commas: grad=int8 (ZeRO 0/1, tp 1) or grad=1bit "
         "(1-bit Adam: ZeRO 0/1, tp = pp = 1), weights=int8 (ZeRO 3), act=int8 (pp > 1); 'none' allowed. The search "
         "keeps the configurations that support it.")


def _cluster_or_default(cluster: Optional[str]) -> str:
    """--cluster as given, or DEFAULT_CLUSTER with one line on stderr naming the hardware the plan then assumes."""
    if cluster is not None:
        return cluster
    spec = BUILTIN_CLUSTERS[DEFAULT_CLUSTER]
    err.print(f"note: no --cluster given: planned for {DEFAULT_CLUSTER} ({spec.gpus_per_node} x {spec.gpu.name} per "
              "node); pass --cluster NAME|FILE, see `zplan clusters`", markup=False, highlight=False, soft_wrap=True)
    return DEFAULT_CLUSTER


def _check_mode_options(mode: Mode, given: dict[str, bool]) -> None:
    """Options of the other mode are errors naming the option (given: option -> whether it was passed)."""
    training_only = ("--global-batch", "--seq", "--pp", "--dp", "--cp", "--ep", "--moe-imbalance", "--zero",
                     "--micro-batch",
                     "--recompute", "--sequence-parallel", "--interleave", "--delayed-update", "--compress")
    inference_only = ("--target", "--batch", "--prompt-len", "--gen-len", "--precision int8", "--precision int4")
    other, kind, fix = ((training_only, "training", "drop {} with --mode inference (inference takes "
                         "--target, --batch, --prompt-len, --gen-len, --precision, --tp, --offload)")
                        if mode is Mode.inference else
                        (inference_only, "inference", "add --mode inference, or drop {} for training"))
    wrong = [name for name in other if given.get(name)]
    if len(wrong) == 1:
        article = "an" if kind == "inference" else "a"
        raise SpecError(f"{wrong[0]} is {article} {kind} option: {fix.format('it')}.")
    if wrong:
        raise SpecError(f"{', '.join(wrong)} are {kind} options: {fix.format('them')}.")


@app.command()
def compile(
    model: str = typer.Argument(..., metavar=MODEL_METAVAR, help=MODEL_HELP),
    gpus: int = GPUS, cluster: Optional[str] = CLUSTER,
    mode: Mode = typer.Option(Mode.training, "--mode", help="training (train.py) or inference (generate.py, "
                              "serve.py)."),
    global_batch: Optional[int] = BATCH, seq: Optional[int] = SEQ,
    precision: Optional[WeightPrecision] = typer.Option(
        None, "--precision",
        help="Training: bf16, fp16 or fp32 (default: the device's fastest: bf16 on data-centre GPUs, fp32 on "
             "cpu-local); fp8: the layers' matrix multiplies in fp8 (GPUs with fp8 tensor cores), all else bf16; "
             "nvfp4: those in 4-bit NVFP4 (GPUs with fp4 tensor cores; tp 1), all else bf16. Inference: the "
             "weights' precision (default: the compute precision); int8, int4: weight-only quantization, chosen only "
             "when nothing else fits or when given here; fp8: weights and activations in fp8 (GPUs with fp8 tensor "
             "cores; only when given here)."),
    tp: Optional[int] = TP, pp: Optional[int] = PP, dp: Optional[int] = DP, cp: Optional[int] = CP,
    ep: Optional[int] = EP, moe_imbalance: Optional[float] = MOE_IMBALANCE, zero: Optional[int] = ZERO,
    offload: Optional[Offload] = typer.Option(
        None, "--offload", help="Training: where optimizer states live: none (GPU memory), cpu or nvme (needs ZeRO "
                                ">= 1); parameters (ZeRO 3) and gradients (ZeRO >= 2) follow only where they do not "
                                "fit on the GPU (default: the search's choice). Inference: where the weights live: "
                                "none (the GPU), cpu or nvme (streamed layer by layer; default: the GPU, streaming "
                                "only when nothing fits there)."),
    micro_batch: Optional[int] = MICRO,
    recompute: Optional[Recompute] = RECOMPUTE, sequence_parallel: Optional[bool] = SP,
    interleave: Optional[int] = INTERLEAVE,
    delayed_update: Optional[DelayedUpdate] = typer.Option(
        None, "--delayed-update",
        help="ZeRO-Offload's one-step delayed parameter update (ZeRO-1 with CPU offload only): auto (default) turns "
             "it on where it saves at least 10 % of the step; on forces it (an error for any other plan); off."),
    compress: Optional[str] = COMPRESS,
    target: Optional[Target] = typer.Option(
        None, "--target", help="Inference: latency (default: the smallest time per output token) or throughput "
                               "(the most tokens/s over all replicas)."),
    batch: Optional[int] = typer.Option(
        None, "--batch", help="Inference: sequences per replica (default: 1 for latency; for throughput the power "
                              "of two up to 256 with the most tokens/s that fits the KV cache)."),
    prompt_len: Optional[int] = typer.Option(
        None, "--prompt-len", help="Inference: prompt tokens per sequence (default 512, less where the model's "
                                   "sequence length is shorter: prompt + gen <= it)."),
    gen_len: Optional[int] = typer.Option(
        None, "--gen-len", help="Inference: generated tokens per sequence (default 128, at most a quarter of the "
                                "model's sequence length)."),
    out_dir: Optional[str] = typer.Option(None, "-o", "--out", metavar="DIR",  # a str: Path('') is Path('.')
                                          help="Output folder (default: out/<model>)."),
    force: bool = FORCE,
    verify: bool = typer.Option(False, "--verify", help="Training: dry-run the plan's program on fake tensors at "
                                                         "its world size (`zplan dryrun`) before writing it, and "
                                                         "record the measured memory in plan.json and the report; "
                                                         "a plan the dry run finds over capacity is refused (exit "
                                                         "1), naming the next plan it shows fits."),
    as_json: bool = JSON,
) -> None:
    """Plan MODEL's training or serving and write its program.

    Traces MODEL, searches the fastest plan that fits and writes plan.json, alternatives.json, train.py, launch/,
    report.md/html and ds_config.json (--mode inference: plan.json, alternatives.json, generate.py, serve.py,
    launch/, report.md/html)."""
    given = {"--global-batch": global_batch is not None, "--seq": seq is not None, "--pp": pp is not None,
             "--dp": dp is not None, "--cp": cp is not None, "--ep": ep is not None,
             "--moe-imbalance": moe_imbalance is not None, "--zero": zero is not None,
             "--micro-batch": micro_batch is not None,
             "--recompute": recompute is not None, "--sequence-parallel": sequence_parallel is not None,
             "--interleave": interleave is not None, "--delayed-update": delayed_update is not None,
             "--compress": compress is not None, "--target": target is not None, "--batch": batch is not None,
             "--prompt-len": prompt_len is not None, "--gen-len": gen_len is not None,
             "--precision int8": precision is WeightPrecision.int8,
             "--precision int4": precision is WeightPrecision.int4}
    folder = Path(out_dir) if out_dir else default_out_dir(model)
    try:
        if out_dir == "":
            raise SpecError("-o '': give a folder, not an empty string (-o . writes into the current folder).")
        _check_mode_options(mode, given)
        check_out_dir(folder)  # before tracing and searching
    except ZplanError as exc:
        _fail(exc)
    cluster = _cluster_or_default(cluster)
    if mode is Mode.inference:
        _compile_inference(model, gpus, cluster, target or Target.latency, batch, prompt_len, gen_len,
                           precision.value if precision else None, tp, offload.value if offload else None,
                           folder, force, as_json)
        return
    from zplan.api import (  # start-up time: torch and the planner load on first use
        compile_with_alternatives,
        prepare,
        write_outputs,
    )

    delayed_update = delayed_update or DelayedUpdate.auto
    try:
        pins = _pins(tp, pp, dp, zero, offload, micro_batch, recompute, sequence_parallel, interleave, compress, cp,
                     ep)
        with err.status("tracing the model", spinner="dots") as status:
            req = prepare(model, gpus, cluster, global_batch, seq, precision.value if precision else None, pins,
                          delayed_update.value, moe_imbalance)
            status.update(f"scoring configurations for {gpus} GPUs")
            plan, alternatives = compile_with_alternatives(req)
        if verify:
            plan = _verified(plan, alternatives, req, model)
        with err.status("writing outputs", spinner="dots"):
            files = write_outputs(plan, folder, model, force=force, alternatives=alternatives)
    except ZplanError as exc:
        _fail(exc)
    gaps = runtime_gaps(plan)
    if as_json:
        print(json.dumps({"out_dir": str(folder), "parallel": plan.parallel.model_dump(),
                          "prediction": plan.prediction.model_dump(),
                          "placement": plan.placement.model_dump(),
                          "delayed_update": plan.delayed_update.model_dump(),
                          "compression": plan.compression.model_dump(), "runtime_gaps": gaps}, indent=2))
    else:
        print_plan_summary(out, plan, alternatives, folder, files)
    for gap in gaps:
        err.print(f"warning: the emitted train.py cannot run this plan yet: {gap}.", soft_wrap=True)


def _verified(plan, alternatives, req, model: str):
    """compile --verify (zplan.dryrun.verify): the plan with the dry run's numbers, or exit 1 with why (the next of
    `alternatives` that the dry run shows fits)."""
    from zplan.dryrun import DryRunError, verify  # start-up time: the runtime and torch load on first use

    if plan.model.source == "family":
        raise SpecError("--verify runs the model's code, and a family spec has none: compile a model file")
    try:
        verified, why = verify(plan, req, model, say=lambda message: err.print(f"zplan: {message}", highlight=False),
                               alternatives=alternatives)
    except DryRunError as exc:
        err.print(f"[bold red]the plan does not run:[/] {exc}", highlight=False, soft_wrap=True, markup=True)
        raise typer.Exit(code=1) from None
    if verified is None:
        err.print(f"[bold red]refused:[/] {why}", highlight=False, soft_wrap=True, markup=True)
        raise typer.Exit(code=1)
    return verified


def _compile_inference(model: str, gpus: int, cluster: str, target: Target, batch: Optional[int],
                       prompt_len: Optional[int], gen_len: Optional[int], precision: Optional[str],
                       tp: Optional[int], offload: Optional[str], folder: Path, force: bool, as_json: bool) -> None:
    """compile --mode inference: search the serving configuration and write its outputs."""
    from zplan import api, inference_api  # start-up time: torch and the planner load on first use

    try:
        with err.status("tracing the model", spinner="dots") as status:
            req = inference_api.prepare(model, gpus, cluster, target.value, batch, prompt_len, gen_len, precision, tp,
                                        offload)
            status.update(f"scoring serving configurations for {gpus} GPUs")
            plan, alternatives = inference_api.compile_inference_with_alternatives(req)
            status.update("writing outputs")
            files = api.write_outputs(plan, folder, model, force=force, alternatives=alternatives)
    except ZplanError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps({"out_dir": str(folder), "parallel": plan.parallel.model_dump(),
                          "prediction": plan.prediction.model_dump(), "reason": plan.reason}, indent=2))
    else:
        print_inference_summary(out, plan, alternatives, folder, files)


@app.command()
def estimate(
    model: str = typer.Argument(..., metavar=MODEL_METAVAR, help=MODEL_HELP),
    gpus: int = GPUS, cluster: Optional[str] = CLUSTER, global_batch: Optional[int] = BATCH, seq: Optional[int] = SEQ,
    precision: Optional[Precision] = PRECISION, tp: int = typer.Option(..., "--tp", help="Tensor-parallel degree."),
    pp: int = typer.Option(..., "--pp", help="Pipeline-parallel degree."), dp: Optional[int] = DP,
    cp: Optional[int] = CP, ep: Optional[int] = EP, moe_imbalance: Optional[float] = MOE_IMBALANCE,
    zero: Optional[int] = ZERO, offload: Optional[Offload] = OFFLOAD, micro_batch: Optional[int] = MICRO,
    recompute: Optional[Recompute] = RECOMPUTE, sequence_parallel: Optional[bool] = SP,
    interleave: Optional[int] = INTERLEAVE, compress: Optional[str] = COMPRESS, as_json: bool = JSON,
) -> None:
    """Predict the step time (with its 80 % interval) and memory of one configuration, as pinned.

    Choices not pinned (micro-batch, recompute, ...) take the fastest value that fits; where nothing fits, the
    least-memory one without offload, with how far over and what would fit. A pipeline with fewer micro-batches
    than stages is priced too, with a warning (zplan's runtime does not run it)."""
    from zplan.api import prepare  # start-up time: torch and the planner load on first use
    from zplan.estimate_api import estimate_config

    cluster = _cluster_or_default(cluster)
    try:
        pins = _pins(tp, pp, dp, zero, offload, micro_batch, recompute, sequence_parallel, interleave, compress, cp,
                     ep)
        req = prepare(model, gpus, cluster, global_batch, seq, precision.value if precision else None, pins,
                      moe_imbalance=moe_imbalance)
        result = estimate_config(req)
    except ZplanError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print_estimate(out, result)


@app.command()
def explain(plan_json: Path = typer.Argument(..., help="A plan.json written by `zplan compile` (its "
                                                       "alternatives.json beside it).")) -> None:
    """Show a plan's best alternatives and why the others lost.

    For an inference plan: its alternatives and the reason for the choice."""
    try:
        plan = load_plan_file(plan_json)
        alternatives = load_alternatives_file(plan_json, plan)
    except ZplanError as exc:
        _fail(exc)
    if isinstance(plan, InferencePlan):
        print_inference_explanation(out, plan, alternatives)
    else:
        print_explanation(out, plan, alternatives)


@app.command()
def export(
    checkpoint: Path = typer.Argument(..., help="A checkpoint folder (step-N) or a folder of them (newest is used)."),
    to: Path = typer.Option(..., "--to", help="The .safetensors file to write; with --hf, the folder."),
    hf: bool = typer.Option(False, "--hf", help="Write a Hugging Face folder (config.json, tokenizer files, sharded "
                                               "safetensors with their index) that from_pretrained loads."),
    config_from: Optional[Path] = typer.Option(
        None, "--config-from", metavar="HF_DIR",
        help="With --hf: the Hugging Face folder whose config.json and tokenizer go with the weights (default: the "
             "folder the run was compiled from)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", metavar="fp32|bf16|fp16",
                                        help="dtype of the floating-point weights (default: with --hf the config's "
                                             "dtype or fp32; without --hf the checkpoint's)."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", metavar="SIZE",
                                       help="With --hf: the largest shard, e.g. 5GB, 500MB, 2GiB (default 5GB)."),
    force: bool = typer.Option(False, "--force", help="With --hf: replace a folder that is not empty."),
    allow_unverified: bool = typer.Option(
        False, "--allow-unverified",
        help="Export a checkpoint that has no MANIFEST.json (its files cannot be checked: damage goes unnoticed)."),
) -> None:
    """Merge a sharded training checkpoint into one safetensors file, or a Hugging Face folder (--hf).

    The checkpoint is read chunk by chunk, once its files match its MANIFEST.json."""
    from zplan.export import export_checkpoint  # start-up time: torch loads on first use
    from zplan.export_hf import export_hf_folder, parse_size  # start-up time: torch loads on first use

    try:
        if not hf and (config_from is not None or force or max_shard_size != "5GB"):
            raise ZplanError("--config-from, --max-shard-size and --force go with --hf (a Hugging Face folder)")
        with err.status(f"exporting {checkpoint}", spinner="dots"):
            if hf:
                written = export_hf_folder(checkpoint, to, config_from=config_from, dtype=dtype, force=force,
                                           max_shard_bytes=parse_size(max_shard_size),
                                           allow_unverified=allow_unverified)
            else:
                written = export_checkpoint(checkpoint, to, allow_unverified=allow_unverified, dtype=dtype)
    except ZplanError as exc:
        _fail(exc)
    err.print(f"wrote {written}")


@app.command()
def clusters(as_json: bool = JSON) -> None:
    """List the built-in cluster profiles and their numbers."""

    if as_json:
        print(json.dumps({k: v.model_dump() for k, v in BUILTIN_CLUSTERS.items()}, indent=2))
    else:
        print_clusters(out, BUILTIN_CLUSTERS)


@app.command()
def probe(
    output: Path = typer.Option(Path("cluster-local.yaml"), "-o", "--out", help="Where to write the profile."),
    seconds: float = typer.Option(10.0, "--seconds", help="Measurement budget."),
    nvme_path: Optional[str] = typer.Option(  # a str: Path('') is Path('.')
        None, "--nvme-path", help="Folder offloaded states would be swapped to (default: the temporary folder)."),
) -> None:
    """Measure this machine into a cluster profile file.

    It measures matmul FLOP/s, memory, gloo and disk bandwidth, CPU Adam throughput and, where a GPU exists,
    host-GPU bandwidth."""
    import yaml

    from zplan.probe import probe_this_machine  # start-up time: torch loads on first use

    # the inputs and the output file are checked before anything is measured
    if not 0 < seconds <= MAX_PROBE_SECONDS:
        _fail(ClusterError(f"--seconds must be more than 0 and at most {MAX_PROBE_SECONDS:g} (got {seconds:g})"))
    if nvme_path == "":
        _fail(ClusterError("--nvme-path '': give a folder, not an empty string (--nvme-path . measures the current "
                           "folder's disk)"))
    if nvme_path is not None and not Path(nvme_path).is_dir():
        _fail(ClusterError(f"--nvme-path {nvme_path} is not a folder: create it on the disk to measure"))
    try:
        check_out_file(output, "-o")
    except ZplanError as exc:
        _fail(exc)
    with err.status("measuring this machine", spinner="dots"):
        spec = probe_this_machine(seconds, nvme_path)
    try:
        write_text_atomically(output, yaml.safe_dump(spec.model_dump(), sort_keys=False))
    except ZplanError as exc:
        _fail(exc)
    err.print(f"wrote {output}; use it with --cluster {output}")


app.command("reduce")(reduce_command)  # zplan reduce: zplan/reduce_cli.py
app.command("dryrun")(dryrun_command)  # zplan dryrun: zplan/dryrun_cli.py
app.command("calibrate")(calibrate_command)  # zplan calibrate: zplan/calibrate_cli.py
app.command("serve")(serve_command)  # zplan serve: zplan/serve_cli.py
app.command("plan")(plan_command)  # zplan plan: zplan/plan_cli.py
app.add_typer(data_app, name="data")  # zplan data prepare: zplan/data_cli.py
