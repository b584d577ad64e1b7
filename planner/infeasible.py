"""When nothing fits: name the closest configuration, how far over memory it is, and what would fit.

Each suggestion is checked by re-running the (cheap) numpy scoring with one request relaxed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from zplan.errors import InfeasibleError
from zplan.planner.cost.inputs import OFFLOAD_TIERS, RECOMPUTE_MODES, Candidates
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


# fits(gpus, pins): whether the search finds a plan on `gpus` GPUs under `pins` (the search hands it in)
Fits = Callable[[int, Pins], bool]


def suggestions(fits: Fits, cluster: ClusterSpec, gpus: int, pins: Pins) -> list[str]:
    found = []
    relaxed = {}
    if pins.offload in (None, "none"):
        relaxed["--offload cpu"] = {"offload": "cpu", "zero": None if pins.zero in (None, 0) else pins.zero}
        relaxed["--offload nvme"] = {"offload": "nvme", "zero": None if pins.zero in (None, 0) else pins.zero}
    if pins.micro_batch not in (None, 1):
        relaxed["--micro-batch 1"] = {"micro_batch": 1}
    if pins.recompute not in (None, "full"):
        relaxed["--recompute full"] = {"recompute": "full"}
    if pins.zero not in (None, 3):
        relaxed["--zero 3"] = {"zero": 3}
    for flag, change in relaxed.items():
        if fits(gpus, pins.model_copy(update=change)):
            found.append(flag)
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
        if fits(n, pins):
            high = n
            break
        low, n = n, n * 2
    if high is None:
        return None
    for n in range(low + step, high, step)[:16]:
        if fits(n, pins):
            return n
    return high


def raise_infeasible(summary: ModelSummary, cluster: ClusterSpec, gpus: int, pins: Pins, scored: Scored,
                     fits: Fits) -> NoReturn:
    mem = scored.estimate.memory
    closest = int(np.argmin(mem.total))
    over = mem.total[closest] - cluster.gpu.hbm_bytes
    where = (f"needs {mem.total[closest] / GiB:.1f} GiB per GPU against {cluster.gpu.hbm_bytes / GiB:.1f} GiB "
             f"({over / GiB:+.1f} GiB)")
    if over <= 0:
        where = ("fits the GPU but not host/NVMe capacity "
                 f"(CPU {mem.cpu_bytes_per_node[closest] / GiB:.0f} GiB/node, "
                 f"NVMe {mem.nvme_bytes_per_node[closest] / GiB:.0f} GiB/node)")
    fixes = suggestions(fits, cluster, gpus, pins)
    hint = ("; would fit: " + ", ".join(fixes)) if fixes else "; nothing tried would fit: use a larger GPU"
    raise InfeasibleError(
        f"no plan for {summary.name} fits {gpus}x {cluster.gpu.name}. Closest: {describe(scored.candidates, closest)}, "
        f"which {where}{hint}."
    )
