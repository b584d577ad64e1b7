"""`zplan calibrate OUT... -o cluster.yaml`: fit the cluster profile to measured runs (zplan.calibrate).

Each OUT is a folder `zplan compile` wrote whose train.py ran with `--log-json OUT/log.jsonl` (another name:
--log). The fitted profile is written as a cluster file for `--cluster`; the table shows each run's measured step
time and its prediction before and after, and for the --check folders (runs left out of the fit) the same, the
honest figure. Registered in zplan/cli.py as `app.command("calibrate")(calibrate_command)`. User errors print one
message and exit with status 2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from zplan.cli_render import load_plan_file
from zplan.errors import ZplanError
from zplan.out_dir import check_out_file, write_text_atomically
from zplan.safe_files import UnsafeFileError, read_capped
from zplan.schemas.plan import Plan

err = Console(stderr=True)
out = Console()
MAX_LOG_BYTES = 256 << 20


def load_run(folder: Path, log_name: str):
    """A compiled folder and its train.py log as a MeasuredRun."""
    from zplan.calibrate import CalibrationError, measured_run  # start-up time: the planner loads on first use

    plan_file, log = folder / "plan.json", folder / log_name
    if not plan_file.exists():  # a special file is refused by kind when read
        raise CalibrationError(f"{folder} holds no plan.json: pass folders `zplan compile` wrote")
    plan = load_plan_file(plan_file)
    if not isinstance(plan, Plan):
        raise CalibrationError(f"{folder} holds an inference plan: calibrate from training runs")
    if not log.exists():  # a special file is refused by kind when read
        raise CalibrationError(f"{log} does not exist: run {folder}/launch/torchrun.sh --steps 20 --log-json {log} "
                               "first (or name the log with --log)")
    try:
        lines = read_capped(log, MAX_LOG_BYTES, "the train.py log").decode().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except UnsafeFileError as exc:
        raise CalibrationError(str(exc)) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{log} is not a train.py JSON-lines log ({exc})") from None
    return measured_run(str(folder), plan, records)


def _table(title: str, figures) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("run", "measured s", "before s", "error", "after s", "error"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for f in figures:
        table.add_row(f.name, f"{f.measured_s:.4f}", f"{f.before_s:.4f}", f"{f.error_before:+.1%}",
                      f"{f.after_s:.4f}", f"{f.error_after:+.1%}")
    return table


def _mean_abs(values) -> float:
    values = list(values)
    return sum(abs(v) for v in values) / len(values)


def calibrate_command(
    runs: list[Path] = typer.Argument(..., help="Folders `zplan compile` wrote, each with its train.py log."),
    output: Path = typer.Option(..., "-o", "--out", help="The fitted cluster profile (YAML) to write."),
    check: Optional[list[Path]] = typer.Option(
        None, "--check", help="A folder left out of the fit, predicted before and after (repeat the option)."),
    log: str = typer.Option("log.jsonl", "--log", help="The log's name in each folder (train.py --log-json)."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
) -> None:
    """Fit a cluster profile to measured runs of compiled plans.

    Fits the GEMM efficiency, activation-op bandwidth, host costs, collective bandwidth and latency to the runs'
    logs, and prints the prediction error before and after."""
    import yaml

    from zplan.calibrate import CalibrationError, RunFigures, calibrate, predict_step_s  # start-up time, as above

    try:
        check_out_file(output, "-o")
        measured = [load_run(folder, log) for folder in runs]
        held_out = [load_run(folder, log) for folder in check or []]
        base = measured[0].plan.cluster
        foreign = [run.name for run in held_out if run.plan.cluster.name != base.name]
        if foreign:
            raise CalibrationError(f"{', '.join(foreign)} planned for another cluster than {base.name}: check runs "
                                   "of the cluster being calibrated")
        with err.status("fitting the profile", spinner="dots") as status:
            fit = calibrate(measured, progress=lambda message: status.update(f"fitting the profile: {message}"))
        checked = [RunFigures(run.name, run.measured_s, predict_step_s(run.plan, base),
                              predict_step_s(run.plan, fit.cluster)) for run in held_out]
        errors = checked or fit.runs  # the runs left out of the fit are the honest ones
        profile = fit.cluster.model_copy(update={
            "calibration_errors": [math.log(f.measured_s / f.after_s) for f in errors],
            "calibration_errors_held_out": bool(checked)})
        write_text_atomically(output, yaml.safe_dump(profile.model_dump(), sort_keys=False))
    except ZplanError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True, markup=True)
        raise typer.Exit(code=2) from None
    summary = {
        "cluster": str(output), "factors": fit.factors,
        "fitted_runs": [dict(name=f.name, measured_s=f.measured_s, before_s=f.before_s, after_s=f.after_s)
                        for f in fit.runs],
        "checked_runs": [dict(name=f.name, measured_s=f.measured_s, before_s=f.before_s, after_s=f.after_s)
                         for f in checked],
        "fitted_mean_abs_error_before": _mean_abs(f.error_before for f in fit.runs),
        "fitted_mean_abs_error_after": _mean_abs(f.error_after for f in fit.runs),
    }
    if checked:
        summary["checked_mean_abs_error_before"] = _mean_abs(f.error_before for f in checked)
        summary["checked_mean_abs_error_after"] = _mean_abs(f.error_after for f in checked)
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    out.print(_table("runs fitted", fit.runs))
    if checked:
        out.print(_table("runs left out of the fit (--check)", checked))
    out.print("fitted factors on the base profile: " + ", ".join(f"{k} x{v:.3g}" for k, v in fit.factors.items()))
    line = (f"mean |error| of the fitted runs {summary['fitted_mean_abs_error_before']:.1%} -> "
            f"{summary['fitted_mean_abs_error_after']:.1%}")
    if checked:
        line += (f"; of the runs left out {summary['checked_mean_abs_error_before']:.1%} -> "
                 f"{summary['checked_mean_abs_error_after']:.1%}")
    out.print(line)
    err.print(f"wrote {output}; use it with --cluster {output}")
