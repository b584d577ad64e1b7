"""What the training loop (runtime.training.loop.train) shows of a run beside what its plan predicted: rank 0's
progress bar, its JSON-lines log (one record per step) and the summary at the end; MFU as PaLM (Appendix B) defines it.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from zplan.runtime.launch.distributed import RunContext


def open_log(log_json: str | Path | None, ctx: RunContext, steps_done: int):
    """Rank 0's JSON-lines log; a resumed run keeps the records up to its checkpoint and appends."""
    if not (log_json and ctx.is_main):
        return None
    path = Path(log_json)
    if steps_done == 0 or not path.exists():
        return open(path, "w")
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= steps_done]
    path.write_text("".join(line + "\n" for line in kept))
    return open(path, "a")


@dataclass(frozen=True)
class PlanFigures:
    """What the plan predicts per rank (printed beside what the run measures) and the FLOP numbers of MFU."""

    step_time_s: float = 0.0
    mfu: float = 0.0
    model_flops_per_step: float = 0.0  # FLOP of one optimizer step of the whole model (6 * params * tokens + attention)
    peak_flops: float = 0.0  # per device at the run's precision, FLOP/s (0: no MFU)
    model_state_bytes: float | None = None  # parameters + gradients + optimizer states per rank
    state_bytes_by_tier: dict | None = None  # {"gpu": .., "cpu": .., "nvme": ..} bytes per rank


def mfu_of(model_flops_per_step: float, step_time_s: float, world_size: int, peak_flops: float) -> float:
    """Model FLOPs utilisation (PaLM, Appendix B): achieved model FLOP/s over the peak of all devices."""
    return model_flops_per_step / (step_time_s * world_size * peak_flops) if peak_flops > 0 else 0.0


def progress_bar(ctx: RunContext):
    """Rank 0's progress bar (disabled on the other ranks)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(), disable=not ctx.is_main,
    )


def print_summary(losses, step_times_s, state_bytes, figures: PlanFigures, ctx) -> None:
    """Rank 0's last lines: the loss from first to last step, measured against predicted step time, MFU, states."""
    if not losses:
        return
    # The first step includes one-off work (allocations, FSDP lazy init): leave it out when we can.
    step_time_s = statistics.median(step_times_s[1:] or step_times_s)
    mfu = mfu_of(figures.model_flops_per_step, step_time_s, ctx.world_size, figures.peak_flops)
    mib = 2**20
    predicted_states = (
        f" (predicted {figures.model_state_bytes / mib:.1f} MiB)" if figures.model_state_bytes else ""
    )
    print(
        f"trained {len(losses)} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}\n"
        f"measured vs predicted: step time {step_time_s:.4f} s vs {figures.step_time_s:.4f} s, "
        f"MFU {mfu:.2%} vs {figures.mfu:.2%}, "
        f"model states {sum(state_bytes.values()) / mib:.1f} MiB per rank{predicted_states}",
        flush=True,
    )
