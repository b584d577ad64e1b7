"""`zplan serve MODEL`: serve a model over the OpenAI API in one command, as `vllm serve` does.

MODEL is a Hugging Face folder (config.json, safetensors, tokenizer), a model file, or a folder `zplan compile
--mode inference` wrote (it holds plan.json). Without a compiled plan, zplan plans serving for the machine it runs
on (`--gpus`, `--cluster`; no CUDA: cpu-local) with the throughput target, writes the plan to --plan OUT (default:
a new temporary folder), says what it chose, and starts the plan's launch/serve.sh, the same server the emitted
serve.py runs (under torchrun when the plan is tensor parallel).

Registered in zplan/cli.py as `app.command("serve")(serve_command)`. Exit status: the server's, or 2 on bad input.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from zplan.errors import SpecError, ZplanError

err = Console(stderr=True)
PLAN_FILE = "plan.json"
CPU_CLUSTER = "cpu-local"


def _compiled_plan(folder: Path) -> bool:
    """A folder `zplan compile --mode inference` wrote."""
    plan = folder / PLAN_FILE
    if not plan.is_file():
        return False
    try:
        return json.loads(plan.read_text()).get("mode") == "inference"
    except (OSError, ValueError, AttributeError):
        return False


def _default_cluster(cluster: Optional[str]) -> str:
    """--cluster as given; on a machine without CUDA, cpu-local; else the compile command's default."""
    if cluster is not None:
        return cluster
    import torch

    if not torch.cuda.is_available():
        return CPU_CLUSTER
    from zplan.cli import _cluster_or_default  # names the cluster it assumes

    return _cluster_or_default(None)


def _plan_here(model: str, gpus: int, cluster: str, folder: Path, max_seq_len: Optional[int]) -> None:
    """Compile MODEL for serving (the throughput target) into `folder`; print what was chosen."""
    from zplan import api, inference_api  # start-up time: torch and the planner load on first use

    with err.status(f"planning serving of {model} on {gpus} x {cluster}", spinner="dots"):
        prompt_len = None if max_seq_len is None else max_seq_len - min(128, max_seq_len // 4)
        gen_len = None if max_seq_len is None else max_seq_len - prompt_len
        req = inference_api.prepare(model, gpus, cluster, "throughput", None, prompt_len, gen_len, None, None, None)
        plan, alternatives = inference_api.compile_inference_with_alternatives(req)
        api.write_outputs(plan, folder, model, alternatives=alternatives)
    p = plan.parallel
    err.print(f"zplan: planned for {gpus} x {cluster}: tp {p.tp} x {p.replicas} replica(s), {p.weight_precision} "
              f"weights, up to {p.max_batch} sequences of {p.max_seq_len} tokens at a time; plan in {folder}",
              highlight=False, soft_wrap=True)


def serve_command(
    model: str = typer.Argument(..., metavar="MODEL", help="A Hugging Face folder, a model file (.py), or a folder "
                                "`zplan compile --mode inference` wrote."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (127.0.0.1: this machine only; "
                             "0.0.0.0: all interfaces)."),
    gpus: int = typer.Option(1, "--gpus", help="GPUs to plan for (without a compiled plan)."),
    cluster: Optional[str] = typer.Option(None, "--cluster", help="Cluster to plan for (default: cpu-local without "
                                          "CUDA, else the compile command's default)."),
    plan: Optional[Path] = typer.Option(None, "--plan", metavar="OUT", help="Folder of the compiled plan: used when "
                                        "it holds one, else the plan made now is written there (default: a new "
                                        "temporary folder)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="ZPLAN_API_KEY",
                                          help="Require `Authorization: Bearer KEY` on every request but /health."),
    weights: Optional[Path] = typer.Option(None, "--weights", help="Weights to serve (default: the model folder's "
                                           "own)."),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", help="Prompt + generated tokens per request "
                                              "(default: the plan's, from the model's context)."),
) -> None:
    """Serve MODEL over HTTP with the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics), planning it for this machine first when MODEL is not a compiled plan."""
    try:
        source = Path(model)
        if source.is_dir() and _compiled_plan(source):
            folder = source
        elif plan is not None and _compiled_plan(plan):
            folder = plan
        else:
            if max_seq_len is not None and max_seq_len < 2:
                raise SpecError(f"--max-seq-len {max_seq_len}: must be at least 2 (a prompt token and a new one)")
            folder = plan or Path(tempfile.mkdtemp(prefix="zplan-serve-"))
            _plan_here(model, gpus, _default_cluster(cluster), folder, max_seq_len)
        script = folder / "launch" / "serve.sh"
        if not script.is_file():
            raise SpecError(f"{folder} holds no launch/serve.sh: compile it again with `zplan compile MODEL --mode "
                            "inference`")
    except ZplanError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from None
    args = ["bash", str(script), "--host", host, "--port", str(port)]
    if weights is not None:
        args += ["--weights", str(weights)]
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}
    if api_key:
        env["ZPLAN_API_KEY"] = api_key  # not on the command line, where other users of the machine could read it
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe("bash", args, env)  # the server replaces this process: signals reach it directly
