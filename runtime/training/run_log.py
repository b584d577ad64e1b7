"""What the training loop (runtime.training.loop.train) shows of a run beside what its plan predicted: rank 0's
progress (a bar with steps/s and ETA on a terminal, else one line per step), its per-step log (JSON lines,
--log-json, and TensorBoard scalars, --tensorboard) and the summary at the end; MFU as PaLM (Appendix B) defines it.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text

from zplan.errors import ZplanError
from zplan.runtime.launch.distributed import RunContext

# The per-step record's fields (runtime.training.loop.train) written as TensorBoard scalars, and their tags; a field
# absent from a step's record (val_loss and val_ppl: only on the steps that were validated) or None is left out.
TENSORBOARD_TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "val_loss": "val/loss", "val_ppl": "val/ppl",
    "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s", "mfu": "perf/mfu",
    "model_state_bytes": "memory/model_state_bytes",
}
# Steps over which the bar's steps/s and ETA are averaged (rich keeps at most 1,000 samples); rich's default
# window of 30 s would leave no estimate at all once a step takes longer than that.
RATE_WINDOW_S = 7 * 24 * 3600.0
TENSORBOARD_FLUSH_S = 10  # seconds between the event file's flushes while a run goes on (closed at its end)


class TensorBoardMissingError(ZplanError):
    """--tensorboard was given but the tensorboard package is not installed."""


def tensorboard_writer_class():
    """torch.utils.tensorboard.SummaryWriter, or TensorBoardMissingError naming the install (every rank calls it
    before the first collective, so that all stop together)."""
    try:
        # optional dependency: tensorboard (pip install tensorboard, or zplan[logs])
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise TensorBoardMissingError(
            f"--tensorboard needs the tensorboard package, which cannot be imported ({error}): "
            "pip install tensorboard (or pip install 'zplan[logs]'), or leave out --tensorboard") from error
    return SummaryWriter


class StepLog:
    """Rank 0's per-step log: the JSON-lines file and the TensorBoard event files, either or both. write() takes
    one step's record; close() flushes and closes both (the training loop calls it also when a step fails)."""

    def __init__(self, json_file, writer):
        self.json_file, self.writer = json_file, writer

    def write(self, record: dict) -> None:
        if self.json_file is not None:
            self.json_file.write(json.dumps(record) + "\n")
            self.json_file.flush()
        if self.writer is not None:
            for field, tag in TENSORBOARD_TAGS.items():
                value = record.get(field)
                if value is not None:
                    self.writer.add_scalar(tag, float(value), global_step=record["step"])
            for tier, size in (record.get("state_bytes_by_tier") or {}).items():
                self.writer.add_scalar(f"memory/{tier}_bytes", float(size), global_step=record["step"])

    def close(self) -> None:
        try:
            if self.writer is not None:
                self.writer.close()  # flushes first
        finally:
            if self.json_file is not None:
                self.json_file.close()


def _open_json_lines(path: Path, steps_done: int):
    """The JSON-lines file; a resumed run keeps the records up to its checkpoint and appends."""
    if steps_done == 0 or not path.exists():
        return open(path, "w")
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= steps_done]
    path.write_text("".join(line + "\n" for line in kept))
    return open(path, "a")


def open_log(log_json: str | Path | None, ctx: RunContext, steps_done: int,
             tensorboard: str | Path | None = None) -> StepLog | None:
    """Rank 0's per-step log (None on the other ranks, or when neither --log-json nor --tensorboard was given). A
    resumed run keeps the JSON records up to its checkpoint, and TensorBoard drops the events of the steps after it
    that an earlier run wrote (purge_step)."""
    if not ctx.is_main or not (log_json or tensorboard):
        return None
    writer = None
    if tensorboard:
        summary_writer = tensorboard_writer_class()
        writer = summary_writer(str(tensorboard), purge_step=steps_done + 1 if steps_done else None,
                                flush_secs=TENSORBOARD_FLUSH_S)
    try:
        json_file = _open_json_lines(Path(log_json), steps_done) if log_json else None
    except BaseException:
        if writer is not None:
            writer.close()
        raise
    return StepLog(json_file, writer)


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


def step_rate(steps_per_s: float | None) -> str:
    """'2.50 steps/s', or for a slower run the seconds per step ('12.3 s/step'); '' before there is an estimate."""
    if not steps_per_s:
        return ""
    return f"{steps_per_s:.2f} steps/s" if steps_per_s >= 1 else f"{1 / steps_per_s:.1f} s/step"


def eta(seconds: float | None) -> str:
    """'1:02:03' (h:mm:ss, or 'Nd h:mm:ss' past a day); '-:--:--' before there is an estimate."""
    if seconds is None or not math.isfinite(seconds):
        return "-:--:--"
    days, rest = divmod(int(math.ceil(seconds)), 86400)
    hours, rest = divmod(rest, 3600)
    text = f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


class StepRateColumn(ProgressColumn):
    """The bar's steps/s (or s/step), over the steps after the first of this run (which holds one-off work)."""

    def render(self, task) -> Text:
        return Text(step_rate(task.speed), style="progress.data.speed")


class StepProgress:
    """Rank 0's progress: on a terminal a rich bar (steps done of all, the last step's numbers, steps/s, ETA),
    elsewhere (a log file, a pipe) one plain line per step; nothing on the other ranks.

    The rate and the ETA are those of the steps of this run after its first (rich's estimate: the first update is
    its reference point, so the first step's one-off work, allocations and lazy initialisation, is left out), over
    up to 1,000 steps whatever their duration."""

    def __init__(self, ctx: RunContext, steps: int, steps_done: int, terminal: bool | None = None):
        terminal = sys.stdout.isatty() if terminal is None else terminal
        self.steps, self.lines = steps, ctx.is_main and not terminal
        self.bar = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
            StepRateColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            disable=not (ctx.is_main and terminal), speed_estimate_period=RATE_WINDOW_S,
        )
        self.task = self.bar.add_task("train", total=steps, completed=steps_done, status="")

    @property
    def console(self):
        return self.bar.console

    def __enter__(self) -> StepProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.stop()

    def show(self, record: dict) -> None:
        """One step done: `record` is its log record (runtime.training.loop.train)."""
        status = f"loss {record['loss']:.4f}  {record['tokens_per_s']:,.0f} tok/s  mfu {record['mfu']:.1%}"
        self.bar.update(self.task, advance=1, status=status)
        if self.lines:
            task = self.bar.tasks[0]
            rate = step_rate(task.speed)
            timing = f"  {rate}  ETA {eta(task.time_remaining)}" if rate else ""
            print(f"step {record['step']}/{self.steps}  {status}  lr {record['lr']:.3g}  "
                  f"grad_norm {record['grad_norm']:.3g}{timing}", flush=True)


def progress_bar(ctx: RunContext, steps: int, steps_done: int) -> StepProgress:
    """Rank 0's progress (StepProgress): a bar when stdout is a terminal, one line per step when it is not."""
    return StepProgress(ctx, steps, steps_done)


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
    if mfu > 1.0:  # more FLOP/s than the profile's peak: the profile is not this machine's
        print(f"note: the measured MFU is above 100 %: this machine computes faster than the cluster profile's peak "
              f"({figures.peak_flops / 1e12:.3g} TFLOP/s a device); measure this one with "
              "`zplan probe -o cluster.yaml` (or fit one to runs with `zplan calibrate`) and compile with "
              "--cluster cluster.yaml", flush=True)
