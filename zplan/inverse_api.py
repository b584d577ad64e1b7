"""`zplan plan`'s work: compile the model at each GPU count the search of planner.inverse asks for (zplan.api's
prepare and compile), and write the chosen count's outputs with the cost-time curve."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from zplan.api import MAX_GPUS, compile_with_alternatives, prepare, write_outputs
from zplan.codegen.curve_report import curve_files, table_rows, verdict
from zplan.errors import SpecError, ZplanError
from zplan.planner import inverse
from zplan.schemas.alternatives import Alternatives
from zplan.schemas.plan import Plan
from zplan.schemas.spec import MAX_GLOBAL_BATCH, Pins


def layout(plan: Plan) -> str:
    """The plan's parallel layout in a few words, e.g. 'tp4 pp2 dp8 ZeRO-1 cpu offload'."""
    p = plan.parallel
    words = [f"tp{p.tp}", f"pp{p.pp}", f"dp{p.dp}"] + [f"{name}{value}" for name, value in (("cp", p.cp), ("ep", p.ep))
                                                      if value > 1]
    words.append(f"ZeRO-{p.zero_stage}")
    if p.offload != "none":
        words.append(f"{p.offload} offload")
    return " ".join(words)


def rate_interval(prediction) -> tuple[float, float] | None:
    """[low, high] global tokens/s of the prediction's 80 % interval (schemas.plan.PredictionInterval), None where
    the plan has none (an older plan.json)."""
    return None if prediction.interval is None else tuple(prediction.interval.tokens_per_s)


def check_budget(tokens: float, days: float, max_gpus: int | None, price: float | None) -> None:
    """The budget's numbers, before anything is traced."""
    if not tokens > 0 or tokens == float("inf"):
        raise SpecError(f"--tokens must be a positive number of tokens, e.g. 1e12 (got {tokens:g}).")
    if not days > 0 or days == float("inf"):
        raise SpecError(f"--days must be a positive number of days (got {days:g}).")
    if max_gpus is not None and not 1 <= max_gpus <= MAX_GPUS:
        raise SpecError(f"--max-gpus must be 1 to {MAX_GPUS:,} (got {max_gpus:,}).")
    if price is not None and not 0 < price < float("inf"):
        raise SpecError(f"--price-per-gpu-hour must be a positive amount (got {price:g}).")


def batch_of_tokens(tokens_per_step: int, seq_len: int) -> int:
    """--tokens-per-step as sequences per step: a whole number of sequences of `seq_len` tokens."""
    if tokens_per_step % seq_len or not 1 <= tokens_per_step // seq_len <= MAX_GLOBAL_BATCH:
        lower = max(1, tokens_per_step // seq_len) * seq_len
        raise SpecError(f"--tokens-per-step {tokens_per_step:,} is not a whole number of {seq_len}-token sequences "
                        f"(1 to {MAX_GLOBAL_BATCH:,}): pass {lower:,} or {lower + seq_len:,}.")
    return tokens_per_step // seq_len


@dataclass(frozen=True)
class DeadlinePlan:
    """The search, its curve (curve.json) and the compiled plan of every count that had one."""

    search: inverse.Search
    curve: dict
    compiled: dict[int, tuple[Plan, Alternatives]]

    def chosen(self) -> tuple[Plan, Alternatives]:
        """The chosen count's plan and alternatives; DeadlineError naming the fastest count found when none."""
        if self.search.chosen is None:
            raise inverse.DeadlineError(inverse.unreachable_message(self.search))
        return self.compiled[self.search.chosen.gpus]


def plan_for_deadline(model: str, cluster: str, tokens: float, days: float, *, max_gpus: int | None = None,
                      price: float | None = None, global_batch: int | None = None,
                      tokens_per_step: int | None = None, seq: int | None = None, precision: str | None = None,
                      moe_imbalance: float | None = None, on_point: Callable[[inverse.Point], None] | None = None,
                      ) -> DeadlinePlan:
    """The search over GPU counts, its curve and the compiled plan of every count that had one. The global batch at
    each count is `global_batch` (or `tokens_per_step` / the sequence length), else compile's default for that count
    (one sequence per GPU, at least 8). A count whose compile finds no plan (nothing fits, the batch does not split)
    is a point without days; errors of the request itself (the model, the cluster, the options) are raised at once."""
    if global_batch is not None and tokens_per_step is not None:
        raise SpecError("--global-batch and --tokens-per-step both set the batch: pass one.")
    check_budget(tokens, days, max_gpus, price)
    # the request at the smallest count checks the model, the cluster and the options once
    first = prepare(model, 1, cluster, global_batch, seq, precision, Pins(), moe_imbalance=moe_imbalance)
    spec = first.cluster
    max_gpus = max_gpus if max_gpus is not None else inverse.DEFAULT_MAX_GPUS
    counts = inverse.candidate_counts(spec.gpus_per_node, max_gpus)
    if tokens_per_step is not None:
        global_batch = batch_of_tokens(tokens_per_step, first.train.seq_len)
    compiled: dict[int, tuple[Plan, Alternatives]] = {}

    def evaluate(gpus: int) -> inverse.Point:
        req = prepare(model, gpus, cluster, global_batch, seq, precision, Pins(), moe_imbalance=moe_imbalance)
        try:
            plan, alternatives = compile_with_alternatives(req)
        except ZplanError as exc:
            return inverse.Point(gpus=gpus, global_batch=req.train.global_batch, error=first_sentence(str(exc)))
        if not plan.prediction.feasible:
            return inverse.Point(gpus=gpus, global_batch=req.train.global_batch, error="the plan does not fit")
        compiled[gpus] = (plan, alternatives)
        return inverse.point_from_rate(gpus, tokens, plan.prediction.tokens_per_s, rate_interval(plan.prediction),
                                       req.train.global_batch, layout(plan))

    points, chosen = inverse.search(counts, evaluate, days, on_point)
    result = inverse.Search(tokens=tokens, deadline_days=days, max_gpus=max_gpus, points=points, chosen=chosen,
                            price_per_gpu_hour=price)
    return DeadlinePlan(result, inverse.as_dict(result, model, spec.name), compiled)


def first_sentence(text: str) -> str:
    """The first sentence of an error's first line (the curve's cell stays short; the fix follows it)."""
    line = text.strip().splitlines()[0] if text.strip() else "no plan"
    end = line.find(". ")
    return line[:end + 1] if end > 0 else line


def write_deadline_outputs(folder: Path, model: str, plan: Plan, alternatives: Alternatives, curve: dict,
                           force: bool = False) -> list[Path]:
    """The chosen count's compile outputs and curve.json, curve.md and curve.svg, swapped into `folder` all or
    nothing (zplan.api.write_outputs)."""
    return write_outputs(plan, folder, model, force, alternatives, extra_files=curve_files(curve))


# what `zplan plan` needs (zplan/plan_cli.py imports it in one place, on first use): the search and the curve's text
__all__ = ["DeadlinePlan", "plan_for_deadline", "table_rows", "verdict", "write_deadline_outputs"]
