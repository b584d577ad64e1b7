"""`zplan plan MODEL --tokens T --days D`: the fewest GPUs that train T tokens within D days, and the cost-time curve.

Each GPU count the search evaluates (planner.inverse: doubling, then bisecting in node steps) is compiled as `zplan
compile --gpus N` would compile it; each is reported on stderr with its days as it finishes. Without -o the curve
is printed as a table; with -o OUT the chosen count's compile outputs are written with curve.json, curve.md and
curve.svg. Registered in zplan/cli.py as `app.command("plan")(plan_command)`. Exit status 2 on bad input or a
deadline no count up to --max-gpus meets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from zplan.cli_options import Precision
from zplan.errors import SpecError, ZplanError
from zplan.out_dir import check_out_dir

err = Console(stderr=True)
out = Console()
COLUMNS = (("gpus", "GPUs"), ("global_batch", "batch"), ("layout", "layout"), ("tokens_per_s", "tokens/s"),
           ("days", "days (80 %)"), ("gpu_hours", "GPU-hours"), ("cost", "cost"), ("meets", "meets"))


def _fail(exc: ZplanError) -> None:
    err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True, markup=True)
    raise typer.Exit(code=2)


def _progress(point) -> None:
    """One line on stderr per evaluated count (point: planner.inverse.Point)."""
    if point.days is None:
        line = f"{point.gpus} GPU{'s' if point.gpus > 1 else ''}: no plan ({point.error})"
    else:
        interval = point.days_interval
        spread = f" (80 %: {interval[0]:,.2f} - {interval[1]:,.2f})" if interval is not None else ""
        line = f"{point.gpus} GPU{'s' if point.gpus > 1 else ''}: {point.days:,.2f} days{spread}"
    err.print(f"zplan: {line}", markup=False, highlight=False, soft_wrap=True)


def plan_command(
    model: str = typer.Argument(..., metavar="MODEL", help="A model file or a family spec, as `zplan compile` "
                                                           "takes (see its --help)."),
    tokens: float = typer.Option(..., "--tokens", metavar="T", help="Tokens to train on, e.g. 1e12."),
    days: float = typer.Option(..., "--days", metavar="D", help="The deadline: days of training, e.g. 30."),
    cluster: Optional[str] = typer.Option(None, "--cluster", metavar="NAME|FILE",
                                          help="The hardware, as for `zplan compile` (default: its default)."),
    max_gpus: Optional[int] = typer.Option(
        None, "--max-gpus", metavar="N", help="The most GPUs to consider (default 16384: cluster profiles record no "
                                              "size)."),
    price: Optional[float] = typer.Option(
        None, "--price-per-gpu-hour", metavar="P", help="Price of one GPU-hour: the curve shows cost (default: it "
                                                        "shows GPU-hours only)."),
    global_batch: Optional[int] = typer.Option(
        None, "--global-batch", help="Sequences per optimizer step at every count (it must split over each count's "
                                     "data-parallel degree; default: compile's, max(8, GPUs), at each count)."),
    tokens_per_step: Optional[int] = typer.Option(
        None, "--tokens-per-step", help="Tokens per optimizer step instead of --global-batch: a whole number of "
                                        "sequences."),
    seq: Optional[int] = typer.Option(None, "--seq", help="Sequence length (default: the model's)."),
    precision: Optional[Precision] = typer.Option(None, "--precision", help="Compute precision, as for `zplan "
                                                                            "compile` (default: the device's "
                                                                            "fastest)."),
    moe_imbalance: Optional[float] = typer.Option(None, "--moe-imbalance", metavar="F",
                                                  help="A mixture of experts' routing imbalance, as for `zplan "
                                                       "compile`."),
    out_dir: Optional[str] = typer.Option(None, "-o", "--out", metavar="DIR",  # a str: Path('') is Path('.')
                                          help="Write the chosen count's compile outputs and curve.json, curve.md, "
                                               "curve.svg here (default: print the table only)."),
    force: bool = typer.Option(False, "--force", help="Overwrite files in the -o folder changed since zplan wrote "
                                                      "them."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout instead of a table."),
) -> None:
    """Find the fewest GPUs that train --tokens in --days.

    Compiles the model at GPU counts found by doubling from one GPU and bisecting in whole nodes (train time =
    tokens / the plan's predicted tokens/s), and prints or writes (-o) the cost-time curve of the counts
    evaluated."""
    from zplan.cli import _cluster_or_default  # zplan.cli imports this module: names the cluster it assumes
    from zplan.inverse_api import (  # start-up time: torch and the planner load on first use
        plan_for_deadline,
        table_rows,
        verdict,
        write_deadline_outputs,
    )

    folder = Path(out_dir) if out_dir else None
    try:
        if out_dir == "":
            raise SpecError("-o '': give a folder, not an empty string (-o . writes into the current folder).")
        if folder is not None:
            check_out_dir(folder)  # before tracing and searching
    except ZplanError as exc:
        _fail(exc)
    cluster = _cluster_or_default(cluster)
    try:
        found = plan_for_deadline(
            model, cluster, tokens, days, max_gpus=max_gpus, price=price, global_batch=global_batch,
            tokens_per_step=tokens_per_step, seq=seq, precision=precision.value if precision else None,
            moe_imbalance=moe_imbalance, on_point=_progress)
        plan, alternatives = found.chosen()
        if folder is not None:
            write_deadline_outputs(folder, model, plan, alternatives, found.curve, force=force)
    except ZplanError as exc:
        _fail(exc)
    curve = found.curve
    if as_json:
        print(json.dumps(curve | ({"out_dir": str(folder)} if folder is not None else {}), indent=2))
        return
    title = f"{tokens:.3g} tokens within {days:g} day{'s' if days != 1 else ''} on {curve['cluster']}"
    table = Table(title=title, box=box.SIMPLE_HEAD)
    columns = [(key, header) for key, header in COLUMNS if key != "cost" or price is not None]
    for key, header in columns:
        table.add_column(header, justify="left" if key in ("layout", "meets") else "right")
    for row in table_rows(curve):
        row["days"] += f" ({row['interval']})" if row["interval"] != "-" else ""
        table.add_row(*(row[key] for key, _ in columns))
    out.print(table)
    out.print(verdict(curve, strong=""), highlight=False, soft_wrap=True)
    if folder is not None:
        err.print(f"wrote {folder}: the plan of {plan.fingerprint.world_size} GPUs, curve.json, curve.md, curve.svg",
                  highlight=False, soft_wrap=True)
