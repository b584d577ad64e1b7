"""Fit a cluster profile to measured runs of emitted scripts (`zplan calibrate`).

    runs = [measured_run(plan, records) for ...]         # plan.json + train.py --log-json records
    fit = calibrate(runs)                                 # Calibration: the fitted profile, figures per run
    predicted = predict_step_s(plan, fit.cluster)         # any plan under the fitted profile

A run is a compiled plan and the step times its train.py logged; its measured step time is the median of the
logged step_time_s after the warm-up steps (WARMUP_STEPS: compilation, allocator growth, the first all-gathers).
Each run is re-predicted by the cost model under a candidate profile (zplan.estimate_api.estimate_config with every
choice of the plan pinned), and the profile's parameters that the runs can inform are fitted by minimising

    sum over runs of log(predicted / measured)^2  +  PRIOR * sum over parameters of log(value / base)^2

(the prior keeps what the runs cannot tell apart at the base profile's value; the parameters' bounds keep their
meaning: an efficiency is at most 1). Parameters (FITTED): the GEMM efficiency curve's maximum, the fraction of
HBM bandwidth the activation ops reach, the host time per aten op and per FSDP2 unit (profiles with host costs),
and the collectives' bandwidth and latency (per collective type where the profile measures them, else the links'
efficiencies and latencies), and the share of each phase's compute the data-parallel collectives hide behind
(profiles whose collectives overlap compute), each fitted as one factor on the base profile's value(s). Coordinate
descent with a golden-section search per parameter in log space, SWEEPS times.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from zplan.api import Request
from zplan.errors import ZplanError
from zplan.estimate_api import estimate_config
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.plan import Plan
from zplan.schemas.spec import Pins

WARMUP_STEPS = 3  # logged steps left out of the median (fewer when a run logged few)
PRIOR = 1e-3  # weight of log(value / base)^2 per parameter against the runs' squared log errors
SWEEPS = 4
RANGE = 8.0  # each factor is searched within [1/RANGE, RANGE] of the base value (and its bound)
GOLDEN_STEPS = 16  # the bracket shrinks to 0.618^16 of log(RANGE^2): 0.2 % of a factor


class CalibrationError(ZplanError):
    """Runs that cannot calibrate a profile: no steps logged, different clusters, not a training plan."""


@dataclass(frozen=True)
class MeasuredRun:
    name: str
    plan: Plan
    measured_s: float  # median logged step time after the warm-up
    steps: int  # logged steps the median is over


@dataclass(frozen=True)
class RunFigures:
    name: str
    measured_s: float
    before_s: float  # predicted under the base profile
    after_s: float  # under the fitted one

    @property
    def error_before(self) -> float:
        return self.before_s / self.measured_s - 1.0

    @property
    def error_after(self) -> float:
        return self.after_s / self.measured_s - 1.0


@dataclass(frozen=True)
class Calibration:
    cluster: ClusterSpec
    factors: dict[str, float]  # fitted value over the base profile's, per parameter
    runs: list[RunFigures]


def _seconds(value) -> float | None:
    """A logged step time, or None for anything that is not a positive finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def measured_run(name: str, plan: Plan, records: list[dict]) -> MeasuredRun:
    times = [t for r in records if isinstance(r, dict) for t in [_seconds(r.get("step_time_s"))] if t is not None]
    if not times:
        raise CalibrationError(f"{name}: its log has no positive step_time_s records: run the plan's train.py with "
                               "--log-json FILE for a few steps (10 or more)")
    skip = WARMUP_STEPS if len(times) > 2 * WARMUP_STEPS else min(1, len(times) - 1)
    kept = times[skip:]
    return MeasuredRun(name, plan, statistics.median(kept), len(kept))


def plan_pins(plan: Plan) -> Pins:
    """Every choice the plan made, pinned: the cost model re-predicts this configuration and no other."""
    p = plan.parallel
    return Pins(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, zero=p.zero_stage, offload=p.offload,
                micro_batch=p.micro_batch, recompute=p.recompute, sequence_parallel=p.sequence_parallel,
                interleave=p.interleave,
                compress=p.compression)


def predict_step_s(plan: Plan, cluster: ClusterSpec) -> float:
    p = plan.parallel
    request = Request(plan.fingerprint.model_ref, plan.model, cluster, p.tp * p.pp * p.dp, plan.train,
                      plan_pins(plan), "on" if p.delayed_update else "off")
    return float(estimate_config(request)["step_time_s"])


# ---- the parameters: name -> (applies a factor to a profile, the largest factor its bounds allow) ----------------

def _efficiency(cluster: ClusterSpec, **update) -> ClusterSpec:
    return cluster.model_copy(update={"efficiency": cluster.efficiency.model_copy(update=update)})


def _host(cluster: ClusterSpec, **update) -> ClusterSpec:
    return cluster.model_copy(update={"host_overheads": cluster.host_overheads.model_copy(update=update)})


def _collectives(cluster: ClusterSpec, field: str, factor: float) -> ClusterSpec:
    costs = cluster.collectives
    update = {kind: getattr(costs, kind).model_copy(update={field: getattr(getattr(costs, kind), field) * factor})
              for kind in ("all_reduce", "all_gather", "reduce_scatter")}
    return cluster.model_copy(update={"collectives": costs.model_copy(update=update)})


def _activation_ops(cluster: ClusterSpec) -> float:
    eff = cluster.efficiency
    return eff.activation_ops if eff.activation_ops is not None else eff.memory_bound


def _bandwidth(cluster: ClusterSpec, factor: float) -> ClusterSpec:
    if cluster.collectives is not None:
        return _collectives(cluster, "bandwidth_Bps", factor)
    eff = cluster.efficiency
    return _efficiency(cluster, intra_node_link=min(1.0, eff.intra_node_link * factor),
                       inter_node_link=min(1.0, eff.inter_node_link * factor))


def _latency(cluster: ClusterSpec, factor: float) -> ClusterSpec:
    scaled = cluster.model_copy(update={"intra_node_latency_s": cluster.intra_node_latency_s * factor,
                                        "inter_node_latency_s": cluster.inter_node_latency_s * factor})
    return _collectives(scaled, "latency_s", factor) if cluster.collectives is not None else scaled


Parameter = tuple[Callable[[ClusterSpec, float], ClusterSpec], Callable[[ClusterSpec], float]]
FITTED: dict[str, Parameter] = {
    "gemm_max": (lambda c, f: _efficiency(c, gemm_max=min(1.0, c.efficiency.gemm_max * f)),
                 lambda c: 1.0 / c.efficiency.gemm_max),
    "activation_ops": (lambda c, f: _efficiency(c, activation_ops=min(1.0, _activation_ops(c) * f)),
                       lambda c: 1.0 / _activation_ops(c)),
    "host_op_s": (lambda c, f: _host(c, op_s=c.host_overheads.op_s * f), lambda c: RANGE),
    "sharded_unit_s": (lambda c, f: _host(c, sharded_unit_s=c.host_overheads.sharded_unit_s * f), lambda c: RANGE),
    "collective_bandwidth": (_bandwidth, lambda c: RANGE if c.collectives is not None else
                             1.0 / max(c.efficiency.intra_node_link, c.efficiency.inter_node_link)),
    "collective_latency": (_latency, lambda c: RANGE),
    "comm_overlap": (lambda c, f: _efficiency(c, comm_overlap=min(1.0, c.efficiency.comm_overlap * f)),
                     lambda c: 1.0 / c.efficiency.comm_overlap),
}


def fitted_parameters(cluster: ClusterSpec) -> list[str]:
    """The parameters a profile has something to fit in (a zero host cost has nothing to scale)."""
    host = cluster.host_overheads
    absent = {"host_op_s"} if host.op_s == 0 else set()
    absent |= {"sharded_unit_s"} if host.sharded_unit_s == 0 else set()
    absent |= {"comm_overlap"} if not cluster.overlaps_comm_with_compute else set()  # every collective is exposed
    return [name for name in FITTED if name not in absent]


def apply(cluster: ClusterSpec, factors: dict[str, float]) -> ClusterSpec:
    for name, factor in factors.items():
        cluster = FITTED[name][0](cluster, factor)
    return cluster


def _golden(objective: Callable[[float], float], low: float, high: float) -> float:
    """The x in [low, high] (log space) minimising objective, by golden-section search."""
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = objective(c), objective(d)
    for _ in range(GOLDEN_STEPS):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = objective(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = objective(d)
    return (a + b) / 2.0


def calibrate(runs: list[MeasuredRun], progress: Callable[[str], None] = lambda message: None) -> Calibration:
    """Fit the runs' common profile (module docstring)."""
    if not runs:
        raise CalibrationError("no runs to calibrate from")
    names = {run.plan.cluster.name for run in runs}
    if len(names) > 1:
        raise CalibrationError(f"the runs were planned for different clusters ({', '.join(sorted(names))}): "
                               "calibrate one cluster's runs at a time")
    base = runs[0].plan.cluster
    parameters = fitted_parameters(base)
    log_factors = dict.fromkeys(parameters, 0.0)

    def objective(logs: dict[str, float]) -> float:
        cluster = apply(base, {name: math.exp(value) for name, value in logs.items()})
        error = sum(math.log(predict_step_s(run.plan, cluster) / run.measured_s) ** 2 for run in runs)
        return error + PRIOR * sum(value * value for value in logs.values())

    for sweep in range(SWEEPS):
        for name in parameters:
            upper = math.log(min(RANGE, FITTED[name][1](base)))
            log_factors[name] = _golden(lambda x, name=name: objective({**log_factors, name: x}),
                                        -math.log(RANGE), upper)
        progress(f"sweep {sweep + 1}/{SWEEPS}: objective {objective(log_factors):.4f}")
    factors = {name: math.exp(value) for name, value in log_factors.items()}
    fitted = apply(base, factors).model_copy(update={
        "name": f"{base.name}-calibrated",
        "source": f"{base.source}; calibrated by zplan calibrate on {len(runs)} measured run(s): "
                  + ", ".join(f"{name} x{factor:.3g}" for name, factor in factors.items())})
    figures = [RunFigures(run.name, run.measured_s, predict_step_s(run.plan, base), predict_step_s(run.plan, fitted))
               for run in runs]
    return Calibration(fitted, factors, figures)
