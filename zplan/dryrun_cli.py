"""`zplan dryrun OUT/`: the command and its report (zplan.dryrun does the work).

Registered in zplan/cli.py as `app.command("dryrun")(dryrun_command)`. Exit status: 0 when every rank fits, 1
when a rank is over its device's capacity or the program fails on a rank (the message says where and what to
change), 2 on bad input (a folder that is not a compiled plan, a model file that changed since).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from zplan.cli_render import load_alternatives_file
from zplan.errors import ZplanError

err = Console(stderr=True)
out = Console()
GIB = 2**30
MIB = 2**20


def _gib(value: float) -> str:
    return f"{value / GIB:,.2f}"


def _in(unit: int):
    return lambda value: f"{value / unit:,.2f}"


def print_result(console: Console, result, plan) -> None:
    """One table per kind of rank: measured and predicted bytes by category, then the verdict."""
    for rank in result.ranks:
        unit, name = (GIB, "GiB") if rank.measured_peak_bytes >= GIB else (MIB, "MiB")
        size = _in(unit)
        table = Table(title=f"rank {rank.rank} of {result.world_size}: {rank.role}", title_justify="left")
        table.add_column(f"{name} per GPU")
        table.add_column("measured (dry run)", justify="right")
        table.add_column("planned", justify="right")
        measured, planned = rank.by_category, rank.predicted_by_category
        for name in ("parameters", "gradients", "optimizer"):
            table.add_row(name, size(measured[name]), size(planned[name]))
        table.add_row("activations", size(measured["activations"]), size(planned["activations"]))
        table.add_row("temporaries / buffers", size(measured["temporaries"]), size(planned["comm_buffers"]))
        table.add_row("[bold]peak allocated[/]", f"[bold]{size(rank.measured_peak_bytes)}[/]",
                      f"[bold]{size(rank.predicted_peak_bytes)}[/]")
        table.add_row("capacity (HBM - reserve)", size(rank.capacity_bytes), size(rank.capacity_bytes))
        if rank.host_peak_bytes or rank.predicted_host_bytes:
            table.add_row("host memory (offload)", size(rank.host_peak_bytes), size(rank.predicted_host_bytes))
        console.print(table)
    console.print(f"categories are read near the peak; the plan budgets each category's own maximum, the dry run "
                  f"counts what is live at once. Dry run: {result.steps} steps per rank, {result.seconds:.1f} s.",
                  highlight=False)
    verdict = "fits" if result.fits else "[bold red]does not fit[/]"
    console.print(f"plan {verdict}; the plan's peak is {result.max_rel_error:.1%} off the measured one (most loaded "
                  "rank)", highlight=False)


def next_plan_that_fits(result, plan, alternatives) -> str | None:
    """The fastest of the search's `alternatives` (alternatives.json) that fits once scaled by how far the dry run
    found the plan off (an estimate: dry-run it to prove it)."""
    from zplan.dryrun import pins_of  # start-up time: the runtime and torch load on first use

    top = max(result.ranks, key=lambda r: r.measured_peak_bytes)
    scale = top.measured_peak_bytes / max(1.0, top.predicted_peak_bytes)
    reserve = plan.prediction.memory.reserve
    for alternative in alternatives.alternatives:
        expected = (alternative.memory_per_gpu_bytes - reserve) * scale
        if alternative.feasible and expected <= top.capacity_bytes:
            return f"{pins_of(alternative.parallel)[1]} (planned {_gib(expected)} GiB at the dry run's scale)"
    return None


def dryrun_command(
    out_dir: Path = typer.Argument(..., help="A folder `zplan compile` wrote for training (plan.json, train.py)."),
    model: Optional[Path] = typer.Option(None, "--model", help="The model file (default: the one train.py names)."),
    steps: int = typer.Option(2, "--steps", min=1, max=10, help="Optimizer steps per rank (the first makes the "
                                                                  "optimizer's states)."),
    end_stages: bool = typer.Option(False, "--end-stages", help="Only the first and the last pipeline stage (the "
                                                                 "ones the plan prices; the middle ones are skipped)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON on stdout instead of tables."),
) -> None:
    """Run a compiled plan on fake tensors and check its memory.

    The plan's program runs at its full world size, one rank per pipeline stage, and the memory it allocates is
    compared with the plan's (what it proves and what it cannot: docs/dry-run.md)."""
    from zplan.dryrun import DryRunError, dry_run, load_program  # start-up time, as above

    began = time.perf_counter()

    def say(message: str) -> None:  # one line per phase on stderr, as it begins (stdout stays the tables or JSON)
        err.print(f"zplan [{time.perf_counter() - began:6.1f} s] {message}", highlight=False, soft_wrap=True)

    try:
        say(f"dry run: reading {out_dir}, checking its model file")
        program = load_program(out_dir, model)
        pp = program.plan.parallel.pp
        result = dry_run(program, steps=steps, say=say, stages=sorted({0, pp - 1}) if end_stages else None)
    except ZplanError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True, markup=True)
        raise typer.Exit(code=2) from None
    except DryRunError as exc:
        err.print(f"[bold red]the plan does not run:[/] {exc}", highlight=False, soft_wrap=True, markup=True)
        raise typer.Exit(code=1) from None
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print_result(out, result, program.plan)
    if not result.fits:
        try:
            alternatives, missing = load_alternatives_file(out_dir / "plan.json", program.plan), ""
        except ZplanError as exc:  # the verdict stands; only the suggestion needs the search's alternatives
            alternatives, missing = None, f" ({exc})"
        fix = next_plan_that_fits(result, program.plan, alternatives) if alternatives is not None else None
        over = [r for r in result.ranks if not r.fits]
        worst = max(over, key=lambda r: r.measured_peak_bytes)
        err.print(f"[bold red]over capacity:[/] rank {worst.rank} ({worst.role}) allocates "
                  f"{_gib(worst.measured_peak_bytes)} GiB at its peak (planned {_gib(worst.predicted_peak_bytes)}); "
                  f"the device holds {_gib(worst.capacity_bytes)}. "
                  + (f"Recompile with {fix} and dry-run it." if fix else
                     f"No alternative in alternatives.json fits{missing}: more GPUs, recompute or offload (`zplan "
                     "compile --help`)."),
                  highlight=False, soft_wrap=True)
        raise typer.Exit(code=1)
