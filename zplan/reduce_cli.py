"""`zplan reduce`: keep some of a teacher model file's layers and prune attention heads, writing a smaller
model file that `zplan compile` takes (zplan.model_reduction.write_reduced_model_file).

Registered in zplan/cli.py as `app.command("reduce")(reduce_command)`. As there, user errors (ZplanError)
print one message on stderr, no traceback, and exit with status 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from zplan.errors import ZplanError
from zplan.out_dir import check_out_file

err = Console(stderr=True)


# Calibration batches at most: each is held in memory until the heads are scored (the default is 8).
MAX_CALIBRATION_BATCHES = 10_000


def parse_layers(text: str) -> list[int]:
    """'0,2,5' -> [0, 2, 5]; anything else is a ZplanError (int() alone would read '1_0' as 10 and other scripts'
    digits as these)."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isascii() and part.isdigit() for part in parts):
        raise ZplanError(f"--keep-layers takes layer indices (0, 1, ...) separated by commas, e.g. 0,2 (got {text!r}).")
    return [int(part) for part in parts]


def check_options(calibration_batches: int, blocks: str | None) -> None:
    """ZplanError for --calibration-batches out of its range or an empty --blocks (read as not given)."""
    if not 1 <= calibration_batches <= MAX_CALIBRATION_BATCHES:
        raise ZplanError(f"--calibration-batches must be 1 to {MAX_CALIBRATION_BATCHES:,} "
                         f"(got {calibration_batches:,}).")
    if blocks is not None and not blocks.strip():
        raise ZplanError(f"--blocks {blocks!r}: give the module path of the block container (e.g. blocks), or leave "
                         "it out for the one the planner finds.")


def reduce_command(
    teacher: str = typer.Argument(..., help="The teacher: a Python file defining build_model()."),
    out: Path = typer.Option(..., "-o", "--out", help="The reduced model file to write."),
    keep_layers: Optional[str] = typer.Option(
        None, "--keep-layers", help="Teacher layers to keep, in order, e.g. 0,2 (default: all)."),
    prune_heads: Optional[int] = typer.Option(
        None, "--prune-heads",
        help="Attention heads to prune in each layer: the least important by Michel et al. 2019's score."),
    weights: Optional[Path] = typer.Option(
        None, "--weights", help="Teacher state dict (.pt or .safetensors) loaded before reducing and scoring."),
    calibration_batches: int = typer.Option(8, "--calibration-batches", help="Batches that score the heads."),
    blocks: Optional[str] = typer.Option(
        None, "--blocks", help="Module path of the block container (default: the one the planner finds)."),
) -> None:
    """Write a smaller model file: fewer layers and attention heads.

    The teacher's layers you keep and the heads you prune make a model file for `zplan compile`."""
    from zplan.model_reduction import write_reduced_model_file  # start-up time: torch loads on first use

    try:
        check_options(calibration_batches, blocks)
        check_out_file(out, "-o")  # before the teacher is loaded and scored
        keep = parse_layers(keep_layers) if keep_layers is not None else None
        prune = {"heads_per_layer": prune_heads} if prune_heads is not None else None
        with err.status("reducing the model", spinner="dots"):
            result = write_reduced_model_file(teacher, out, keep, prune, weights, calibration_batches,
                                              block_prefix=blocks)
    except ZplanError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True, markup=True)
        raise typer.Exit(code=2) from None
    kept = (f"{result.block_prefix} {result.keep} of {result.teacher_layers}" if result.keep is not None
            else f"all {result.teacher_layers} {result.block_prefix}")
    pruned = f"{result.prune} ({{layer: [heads]}})" if result.prune else "none"
    err.print(f"wrote {result.path}: {result.params_before:,} -> {result.params_after:,} parameters; kept {kept}; "
              f"pruned heads {pruned}", highlight=False, soft_wrap=True, markup=False)
    if prune is not None and weights is None:
        err.print("note: heads were scored on the teacher's initial weights; pass --weights to score trained ones.",
                  soft_wrap=True)
