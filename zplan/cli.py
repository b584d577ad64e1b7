"""The `zplan` command line: compile | estimate | explain | export | clusters | probe.

User errors (ZplanError) print one message on stderr, no traceback, and exit with status 2.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from pydantic import ValidationError
from rich.console import Console

from zplan.errors import ClusterError, ZplanError
from zplan.reduce_cli import reduce_command
from zplan.schemas.spec import Pins

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Plan 3D-parallel + ZeRO training, prove it fits, emit the program that runs it.")
err = Console(stderr=True)
out = Console()


class Precision(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class Recompute(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


class Offload(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class DelayedUpdate(str, Enum):
    auto = "auto"
    on = "on"
    off = "off"


MODEL_HELP = ("A Python file defining build_model() (zplan executes it), or a family spec such as "
              "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200")


def _pins(tp, pp, dp, zero, offload, micro_batch, recompute, sequence_parallel, interleave, compress=None) -> Pins:
    from zplan.planner.compression import parse_compress

    if zero is not None and zero not in (0, 1, 2, 3):
        raise ZplanError(f"--zero must be 0, 1, 2 or 3 (got {zero}).")
    compression = parse_compress(compress) if compress is not None else None
    try:
        return Pins(tp=tp, pp=pp, dp=dp, zero=zero, offload=offload.value if offload else None,
                    micro_batch=micro_batch, recompute=recompute.value if recompute else None,
                    sequence_parallel=sequence_parallel, interleave=interleave, compress=compression)
    except ValidationError as exc:
        raise ZplanError(f"invalid pin: {exc.errors()[0]['loc'][0]} {exc.errors()[0]['msg']}") from exc


def _fail(exc: ZplanError) -> None:
    err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True, markup=True)
    raise typer.Exit(code=2)


# Options shared by compile and estimate.
GPUS = typer.Option(..., "--gpus", help="Number of GPUs.")
CLUSTER = typer.Option("dgx-a100-80g", "--cluster", help="Built-in profile (see `zplan clusters`) or YAML/JSON file.")
BATCH = typer.Option(None, "--global-batch", help="Sequences per optimizer step (default: max(8, gpus)).")
SEQ = typer.Option(None, "--seq", help="Sequence length (default: the model's).")
PRECISION = typer.Option(Precision.bf16, "--precision", help="Compute precision.")
TP = typer.Option(None, "--tp", help="Pin the tensor-parallel degree.")
PP = typer.Option(None, "--pp", help="Pin the pipeline-parallel degree.")
DP = typer.Option(None, "--dp", help="Pin the data-parallel degree.")
ZERO = typer.Option(None, "--zero", help="Pin the ZeRO stage (0-3).")
OFFLOAD = typer.Option(None, "--offload", help="Pin where optimizer states live.")
MICRO = typer.Option(None, "--micro-batch", help="Pin the micro-batch size.")
RECOMPUTE = typer.Option(None, "--recompute", help="Pin activation recompute.")
SP = typer.Option(None, "--sequence-parallel/--no-sequence-parallel", help="Pin sequence parallelism.")
INTERLEAVE = typer.Option(None, "--interleave", help="Pin model chunks per pipeline stage.")
JSON = typer.Option(False, "--json", help="Print JSON on stdout instead of tables.")
COMPRESS = typer.Option(
    None, "--compress",
    help="Compressed communication, key=value pairs separated by commas: grad=int8 (ZeRO 0/1, tp 1) or grad=1bit "
         "(1-bit Adam: ZeRO 0, tp = pp = 1), weights=int8 (ZeRO 3), act=int8 (pp > 1); 'none' allowed. The search "
         "keeps the configurations that support it.")


@app.command()
def compile(
    model: str = typer.Argument(..., help=MODEL_HELP),
    gpus: int = GPUS, cluster: str = CLUSTER, global_batch: Optional[int] = BATCH, seq: Optional[int] = SEQ,
    precision: Precision = PRECISION, tp: Optional[int] = TP, pp: Optional[int] = PP, dp: Optional[int] = DP,
    zero: Optional[int] = ZERO, offload: Optional[Offload] = OFFLOAD, micro_batch: Optional[int] = MICRO,
    recompute: Optional[Recompute] = RECOMPUTE, sequence_parallel: Optional[bool] = SP,
    interleave: Optional[int] = INTERLEAVE,
    delayed_update: DelayedUpdate = typer.Option(
        DelayedUpdate.auto, "--delayed-update",
        help="ZeRO-Offload's one-step delayed parameter update (ZeRO-1 with CPU offload only): auto turns it on "
             "where it saves at least 10 % of the step; on forces it (an error for any other plan); off."),
    compress: Optional[str] = COMPRESS,
    out_dir: Optional[Path] = typer.Option(None, "-o", "--out", help="Output folder (default: out/<model>)."),
    as_json: bool = JSON,
) -> None:
    """Trace MODEL, search the plan, write plan.json, train.py, launch/, report.md/html, ds_config.json."""
    from zplan.api import compile_plan, prepare, write_outputs
    from zplan.cli_render import default_out_dir, print_plan_summary

    try:
        pins = _pins(tp, pp, dp, zero, offload, micro_batch, recompute, sequence_parallel, interleave, compress)
        with err.status("tracing the model", spinner="dots") as status:
            req = prepare(model, gpus, cluster, global_batch, seq, precision.value, pins, delayed_update.value)
            status.update(f"scoring configurations for {gpus} GPUs")
            plan = compile_plan(req)
            status.update("writing outputs")
            target = out_dir or default_out_dir(model)
            files = write_outputs(plan, target, model)
    except ZplanError as exc:
        _fail(exc)
    from zplan.runtime.plan_check import runtime_gaps

    gaps = runtime_gaps(plan)
    if as_json:
        print(json.dumps({"out_dir": str(target), "parallel": plan.parallel.model_dump(),
                          "prediction": plan.prediction.model_dump(),
                          "placement": plan.placement.model_dump(),
                          "delayed_update": plan.delayed_update.model_dump(),
                          "compression": plan.compression.model_dump(), "runtime_gaps": gaps}, indent=2))
    else:
        print_plan_summary(out, plan, target, files)
    for gap in gaps:
        err.print(f"warning: the emitted train.py cannot run this plan yet: {gap}.", soft_wrap=True)


@app.command()
def estimate(
    model: str = typer.Argument(..., help=MODEL_HELP),
    gpus: int = GPUS, cluster: str = CLUSTER, global_batch: Optional[int] = BATCH, seq: Optional[int] = SEQ,
    precision: Precision = PRECISION, tp: int = typer.Option(..., "--tp", help="Tensor-parallel degree."),
    pp: int = typer.Option(..., "--pp", help="Pipeline-parallel degree."), dp: Optional[int] = DP,
    zero: Optional[int] = ZERO, offload: Optional[Offload] = OFFLOAD, micro_batch: Optional[int] = MICRO,
    recompute: Optional[Recompute] = RECOMPUTE, sequence_parallel: Optional[bool] = SP,
    interleave: Optional[int] = INTERLEAVE, compress: Optional[str] = COMPRESS, as_json: bool = JSON,
) -> None:
    """Predict one configuration; unpinned choices (micro-batch, recompute, ...) take their best value."""
    from zplan.api import estimate_config, prepare
    from zplan.cli_render import print_estimate

    try:
        pins = _pins(tp, pp, dp, zero, offload, micro_batch, recompute, sequence_parallel, interleave, compress)
        req = prepare(model, gpus, cluster, global_batch, seq, precision.value, pins)
        result = estimate_config(req)
    except ZplanError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print_estimate(out, result)


@app.command()
def explain(plan_json: Path = typer.Argument(..., help="A plan.json written by `zplan compile`.")) -> None:
    """The best alternatives to a plan and why each rejected family lost."""
    from zplan.cli_render import load_plan_file, print_explanation

    try:
        plan = load_plan_file(plan_json)
    except ZplanError as exc:
        _fail(exc)
    print_explanation(out, plan)


@app.command()
def export(
    checkpoint: Path = typer.Argument(..., help="A checkpoint folder (step-N) or a folder of them (newest is used)."),
    to: Path = typer.Option(..., "--to", help="The .safetensors file to write."),
) -> None:
    """Consolidate a sharded training checkpoint into one safetensors file (read chunk by chunk)."""
    from zplan.export import export_checkpoint

    try:
        with err.status(f"exporting {checkpoint}", spinner="dots"):
            written = export_checkpoint(checkpoint, to)
    except ZplanError as exc:
        _fail(exc)
    err.print(f"wrote {written}")


@app.command()
def clusters(as_json: bool = JSON) -> None:
    """The built-in cluster profiles and their numbers."""
    from zplan.cli_render import print_clusters
    from zplan.planner.clusters import BUILTIN_CLUSTERS

    if as_json:
        print(json.dumps({k: v.model_dump() for k, v in BUILTIN_CLUSTERS.items()}, indent=2))
    else:
        print_clusters(out, BUILTIN_CLUSTERS)


@app.command()
def probe(
    output: Path = typer.Option(Path("cluster-local.yaml"), "-o", "--out", help="Where to write the profile."),
    seconds: float = typer.Option(10.0, "--seconds", help="Measurement budget."),
    nvme_path: Optional[Path] = typer.Option(
        None, "--nvme-path", help="Folder offloaded states would be swapped to (default: the temporary folder)."),
) -> None:
    """Measure this machine (matmul FLOP/s, memory, gloo and disk bandwidth, CPU Adam throughput, host-GPU
    bandwidth where a GPU exists) into a cluster profile file."""
    import yaml

    from zplan.planner.probe import probe_this_machine

    if nvme_path is not None and not nvme_path.is_dir():
        _fail(ClusterError(f"--nvme-path {nvme_path} is not a folder: create it on the disk to measure"))
    with err.status("measuring this machine", spinner="dots"):
        spec = probe_this_machine(seconds, None if nvme_path is None else str(nvme_path))
    output.write_text(yaml.safe_dump(spec.model_dump(), sort_keys=False))
    err.print(f"wrote {output}; use it with --cluster {output}")


app.command("reduce")(reduce_command)  # zplan reduce: zplan/reduce_cli.py
