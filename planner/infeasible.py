"""When nothing fits: name the closest configuration, how far over memory it is and the terms that make it so, and what
would fit, each change with its predicted step time, the fastest first.

Each suggestion is checked by re-running the (cheap) numpy scoring with one request changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from zplan.errors import InfeasibleError
from zplan.planner.cost.inputs import OFFLOAD_TIERS, RECOMPUTE_MODES, Candidates
from zplan.planner.cost.memory import MemoryEstimate
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.model import ModelSummary
from zplan.schemas.spec import Pins

if TYPE_CHECKING:
    from zplan.planner.search import Scored

GiB = 1024**3
MAX_GPU_MULTIPLE = 64


def describe(cand: Candidates, i: int) -> str:
    return (f"tp={cand.tp[i]} pp={cand.pp[i]} dp={cand.dp[i]} cp={cand.cp[i]} micro_batch={cand.micro_batch[i]} "
            f"ZeRO-{cand.zero[i]} recompute={RECOMPUTE_MODES[cand.recompute[i]]} "
            f"offload={OFFLOAD_TIERS[cand.offload[i]]}")


# fits(gpus, pins): the step time of the fastest plan the search finds on `gpus` GPUs under `pins`, None when none
# fits (the search hands it in)
Fits = Callable[[int, Pins], float | None]
TOP_TERMS = 3  # terms an over-memory message names


def overflow(mem: MemoryEstimate, i: int, capacity: float) -> str:
    """How far candidate i is over `capacity` and the terms that make it so, largest first (MemoryEstimate.terms),
    e.g. "78.2 GiB against 74.5 GiB (+3.7 GiB); the largest terms: weights 20.1 GiB, ...". """
    over = mem.total[i] - capacity
    terms = sorted(((float(v[i]), name) for name, v in mem.terms.items() if v[i] > 0), reverse=True)[:TOP_TERMS]
    named = ", ".join(f"{name} {value / GiB:.1f} GiB" for value, name in terms)
    return (f"{mem.total[i] / GiB:.1f} GiB against {capacity / GiB:.1f} GiB ({over / GiB:+.1f} GiB); the largest "
            f"terms: {named}")


def changes_to_try(cluster: ClusterSpec, gpus: int, pins: Pins) -> dict[str, dict]:
    """One change at a time to the pins: a recompute level more, a ZeRO stage more, twice the tp (half the dp), the
    optimizer offloaded, the micro-batch halved; {flag: pin update}."""
    changes = {}
    if pins.recompute not in (None, "full"):
        deeper = RECOMPUTE_MODES[RECOMPUTE_MODES.index(pins.recompute) + 1]
        changes[f"--recompute {deeper}"] = {"recompute": deeper}
    if pins.zero not in (None, 3):
        changes[f"--zero {pins.zero + 1}"] = {"zero": pins.zero + 1}
    tp = pins.tp or 1
    if 2 * tp <= cluster.gpus_per_node and (pins.dp is None or pins.dp % 2 == 0):
        changes[f"--tp {2 * tp}"] = {"tp": 2 * tp, "dp": pins.dp // 2 if pins.dp else None}
    if pins.offload in (None, "none"):  # offload steps each rank's optimizer shard: ZeRO >= 1
        zero = " --zero 1" if pins.zero == 0 else ""
        for tier in ("cpu", "nvme"):
            changes[f"--offload {tier}{zero}"] = {"offload": tier, "zero": 1 if pins.zero == 0 else pins.zero}
    if pins.micro_batch not in (None, 1):
        changes[f"--micro-batch {pins.micro_batch // 2}"] = {"micro_batch": pins.micro_batch // 2}
    return changes


def suggestions(fits: Fits, cluster: ClusterSpec, gpus: int, pins: Pins, base_s: float | None = None) -> list[str]:
    """The changes of changes_to_try that fit, each with its predicted step time (and what it costs over `base_s`,
    the step time of the configuration that does not fit), the cheapest (fastest) first, then the fewest GPUs that
    fit the pins."""
    timed = []
    for flag, change in changes_to_try(cluster, gpus, pins).items():
        step_s = fits(gpus, pins.model_copy(update=change))
        if step_s is not None:
            timed.append((step_s, flag))
    found = [f"{flag} ({step_s:.3g} s a step" + (f", {step_s - base_s:+.3g} s)" if base_s else ")")
             for step_s, flag in sorted(timed)]
    more = pins.model_copy(update={"dp": None})
    fewest = fewest_gpus_that_fit(fits, cluster, gpus, more)
    if fewest is not None:
        found.append(f"--gpus {fewest} (the fewest that fit with these pins)")
    return found


def fewest_gpus_that_fit(fits: Fits, cluster: ClusterSpec, gpus: int, pins: Pins) -> int | None:
    """Double the GPU count until a plan fits, then walk back node by node to the fewest that fit."""
    step = cluster.gpus_per_node if gpus % cluster.gpus_per_node == 0 else 1
    low, high = gpus, None
    n = gpus * 2
    while n <= gpus * MAX_GPU_MULTIPLE:
        if fits(n, pins) is not None:
            high = n
            break
        low, n = n, n * 2
    if high is None:
        return None
    for n in range(low + step, high, step)[:16]:
        if fits(n, pins) is not None:
            return n
    return high


def raise_infeasible(summary: ModelSummary, cluster: ClusterSpec, gpus: int, pins: Pins, scored: Scored,
                     fits: Fits) -> NoReturn:
    mem = scored.estimate.memory
    closest = int(np.argmin(mem.total))
    where = f"needs {overflow(mem, closest, cluster.gpu.hbm_bytes)}"
    if mem.total[closest] <= cluster.gpu.hbm_bytes:
        where = ("fits the GPU but not host/NVMe capacity "
                 f"(CPU {mem.cpu_bytes_per_node[closest] / GiB:.0f} GiB/node, "
                 f"NVMe {mem.nvme_bytes_per_node[closest] / GiB:.0f} GiB/node)")
    fixes = suggestions(fits, cluster, gpus, pins, float(scored.estimate.step_time_s[closest]))
    hint = ("; would fit, the fastest first: " + ", ".join(fixes)) if fixes else \
        "; nothing tried would fit: use a larger GPU"
    raise InfeasibleError(
        f"no plan for {summary.name} fits {gpus}x {cluster.gpu.name}. Closest: {describe(scored.candidates, closest)}, "
        f"which {where}{hint}."
    )
