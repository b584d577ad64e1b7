"""Place one GPU's share of model states (16-bit parameters, 16-bit gradients, fp32 optimizer states) on
GPU memory, CPU memory or NVMe, with OR-Tools CP-SAT (docs/design.md decision 3).

Variables: 9 booleans x[state, tier], state in {params, grads, optimizer}, tier in {gpu, cpu, nvme}.

Constraints
* each state on exactly one tier; the sum of bytes on each tier <= that tier's free bytes per GPU
  (stated exactly, in floating point, as clauses: no set of states that overflows a tier shares it);
* the legal placements (enumerate_legal_placements): the placement rules of schemas.legality over the three tiers,
  the ZeRO stage and the offload tier, as clauses that forbid every other combination. The offload tier bounds the
  tiers ("none" the GPU, "cpu" the host too, "nvme" NVMe too). A search candidate's tier is an allowance (the solver
  keeps on the GPU what fits there); the user's --offload pin (``offload_pinned``) is a requirement for the
  optimizer states, while parameters and gradients stay on the GPU where they fit. So `--zero 2|3 --offload cpu`
  means the optimizer on the CPU, and the parameter and gradient shards on the host too only when the GPU cannot
  hold them. ZeRO as zplan's runtime runs it: under ZeRO-1 only the optimizer leaves the GPU (to CPU or NVMe:
  runtime.optim.host_states, runtime.optim.nvme_states); under ZeRO 2/3 the optimizer may leave alone
  (runtime.optim.host_states, runtime.optim.nvme_states), and parameters on the host are FSDP2's
  CPUOffloadPolicy, which takes the gradient shards and the optimizer step with them; only ZeRO-3 swaps the
  parameters on to NVMe (runtime.offload.param_swap);
* host memory: the optimizer on the CPU beside parameters on the GPU holds ``optimizer_host_extra_bytes`` there
  besides its states (zplan's CPU Adam: the buffer the gradients come down to, and an fp32 master of the shard
  where the parameters are fp32); the optimizer on NVMe keeps ``optimizer_nvme_host_bytes`` of its states in host
  memory rather than in files (the fp32 masters of 16-bit parameters: runtime.optim.nvme_states);

Objective: minimise the per-step transfer time, serial sum of three parts
(``m`` = micro-batches per step, P/G/O = parameter/gradient/optimizer bytes per GPU):
* host-device (PCIe) bytes, down at device_to_host_bytes_per_s and up at host_device_bytes_per_s:
    - optimizer off GPU: gradients go down to the CPU, G each micro-batch when they live on the CPU, G once
      when they accumulate on the GPU (ZeRO-Offload, Ren et al. 2021, Sec. 4.1: fp16 gradients down,
      fp16 parameters up); updated parameters P go back up when the parameters live on the GPU (once a step:
      ZeRO-1's owned rows, ZeRO 2/3's shards under optimizer-only offload);
    - parameters off GPU: fetched up for every all-gather, ``param_fetches_per_step`` times P (ZeRO-3: every
      forward and backward, 2 m; ZeRO-2: once, the runtime keeps them gathered through the step; ZeRO-Infinity,
      Rajbhandari et al. 2021, Sec. 5);
* NVMe bytes / nvme_bytes_per_s: optimizer on NVMe reads and writes its O bytes in files every step (2 O);
  parameters on NVMe are read for every fetch (2 m P) and written once updated (P) (ZeRO-Infinity);
* CPU Adam when the optimizer is off the GPU: the parameters it updates over cpu_adam_params_per_s (this
  GPU's share of the node's throughput measured by zplan probe) when given, else at memory bandwidth:
  reads and writes the fp32 states (2 O), reads the gradients (G) and writes the 16-bit parameters (P),
  over cpu_memory_bytes_per_s.
Ties are broken towards the faster tier (GPU before CPU before NVMe), so the answer is deterministic.
Not modelled: GPU prefetch buffers and CPU staging buffers for NVMe (the caller leaves room for them).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

import numpy as np
from ortools.sat.python import cp_model

from zplan.schemas import legality

Tier = Literal["gpu", "cpu", "nvme"]
TIERS: tuple[Tier, ...] = ("gpu", "cpu", "nvme")
STATES = ("params", "grads", "optimizer")
FIELD_OF_STATE = dict(zip(STATES, legality.STATES, strict=True))  # params -> schemas.legality's parameters...
TIME_RESOLUTION = 10**9  # integer time units in the largest possible transfer time
OVERFLOW_RESOLUTION = 10**6  # integer memory units in all state bytes, for the overflow diagnostic


@dataclass(frozen=True)
class TransferTimes:
    """Per-step traffic of one placement on one GPU (host_device_bytes: both directions)."""

    host_device_bytes: float
    nvme_bytes: float
    host_device_s: float
    nvme_s: float
    cpu_optimizer_s: float

    @property
    def total_s(self) -> float:
        return self.host_device_s + self.nvme_s + self.cpu_optimizer_s


@dataclass(frozen=True)
class PlacementResult:
    """Tier of each model state, bytes per tier and predicted transfer time per step.

    When ``feasible`` is False the tiers are the legal placement that overflows least, and
    ``overflow_bytes`` says by how much each tier would have to grow for it to fit.
    """

    param_tier: Tier
    grad_tier: Tier
    optimizer_tier: Tier
    gpu_bytes: float
    cpu_bytes: float
    nvme_bytes: float
    transfer: TransferTimes
    feasible: bool
    optimal: bool
    overflow_bytes: dict[str, float]  # tier -> bytes over capacity (all 0.0 when feasible)

    @property
    def total_transfer_s(self) -> float:
        return self.transfer.total_s


def enumerate_legal_placements(zero_stage: int, offload: str, pinned: bool = False) -> list[dict[str, Tier]]:
    """Every placement {state: tier} the placement rules of schemas.legality allow under the ZeRO stage and the
    offload tier (`pinned`: the user's --offload pin, which fixes the optimizer's tier); at most 27, in
    itertools.product order of TIERS. The solver's clauses, and explanations and tests."""
    combos = list(itertools.product(range(len(TIERS)), repeat=len(STATES)))
    tiers = np.array(combos, dtype=np.int64).reshape(-1, len(STATES))
    values = {**legality.config(zero=zero_stage, offload=offload, offload_pinned=pinned),
              **{FIELD_OF_STATE[s]: tiers[:, i] for i, s in enumerate(STATES)}}
    legal = np.broadcast_to(legality.legal_mask(values, legality.PLACEMENT_RULES), len(combos))
    return [{s: TIERS[c] for s, c in zip(STATES, combo, strict=True)}
            for combo, ok in zip(combos, legal, strict=True) if ok]


def cpu_adam_step_s(optimizer_bytes: float, grad_update_bytes: float, param_update_bytes: float,
                    cpu_memory_bytes_per_s: float, optimizer_params: float = 0.0,
                    cpu_adam_params_per_s: float | None = None) -> float:
    """One GPU's CPU Adam step, s: optimizer_params / cpu_adam_params_per_s (measured throughput, this GPU's
    share) when given, else the bytes it streams, 2 O + G + P, over cpu_memory_bytes_per_s (module docstring)."""
    if cpu_adam_params_per_s is not None:
        return optimizer_params / cpu_adam_params_per_s
    return (2 * optimizer_bytes + grad_update_bytes + param_update_bytes) / cpu_memory_bytes_per_s


def transfer_times(
    param_tier: Tier, grad_tier: Tier, optimizer_tier: Tier, *, param_bytes: float, grad_bytes: float,
    optimizer_bytes: float, host_device_bytes_per_s: float, nvme_bytes_per_s: float,
    cpu_memory_bytes_per_s: float, micro_batches_per_step: int = 1, param_update_bytes: float | None = None,
    grad_update_bytes: float | None = None, device_to_host_bytes_per_s: float | None = None,
    optimizer_params: float = 0.0, cpu_adam_params_per_s: float | None = None,
    param_fetches_per_step: int | None = None, optimizer_nvme_host_bytes: float = 0.0,
) -> TransferTimes:
    """Per-step transfer time of one placement (the objective of ``place_model_states``, in floats).

    ``param_update_bytes`` / ``grad_update_bytes``: the share this rank's optimizer updates / consumes
    when the state itself is replicated (ZeRO-1/2 weights, ZeRO-1 gradients: 1/dp of it); default all.
    ``device_to_host_bytes_per_s``: the downward bandwidth (default: ``host_device_bytes_per_s``).
    ``optimizer_params``, ``cpu_adam_params_per_s``: the parameters this rank's optimizer updates and this
    GPU's share of the measured CPU Adam throughput; when the latter is given, the CPU step takes their ratio.
    ``param_fetches_per_step``: all-gathers of parameters held off the GPU per step (default 2 m, ZeRO-3's).
    ``optimizer_nvme_host_bytes``: the optimizer's bytes kept in host memory, not swapped, when it is on NVMe.
    """
    param_update = param_bytes if param_update_bytes is None else param_update_bytes
    grad_update = grad_bytes if grad_update_bytes is None else grad_update_bytes
    down_per_s = device_to_host_bytes_per_s or host_device_bytes_per_s
    params_off, optimizer_off = param_tier != "gpu", optimizer_tier != "gpu"
    fetches = 2 * micro_batches_per_step if param_fetches_per_step is None else param_fetches_per_step
    down = up = 0.0  # host-device bytes: device to host, host to device
    nvme = 0.0
    cpu_optimizer_s = 0.0
    if optimizer_off:
        down += grad_bytes * micro_batches_per_step if grad_tier == "cpu" else grad_update
        up += param_update if not params_off else 0.0
        cpu_optimizer_s = cpu_adam_step_s(optimizer_bytes, grad_update, param_update, cpu_memory_bytes_per_s,
                                          optimizer_params, cpu_adam_params_per_s)
    if optimizer_tier == "nvme":
        nvme += 2 * (optimizer_bytes - optimizer_nvme_host_bytes)
    if params_off:
        up += fetches * param_bytes
        down += param_bytes if not optimizer_off else 0.0
    if param_tier == "nvme":
        nvme += (fetches + 1) * param_bytes
    return TransferTimes(
        host_device_bytes=down + up,
        nvme_bytes=nvme,
        host_device_s=down / down_per_s + up / host_device_bytes_per_s,
        nvme_s=nvme / nvme_bytes_per_s if nvme else 0.0,
        cpu_optimizer_s=cpu_optimizer_s,
    )


def place_model_states(
    *,
    param_bytes: float,
    grad_bytes: float,
    optimizer_bytes: float,
    gpu_free_bytes: float,
    cpu_free_bytes: float,
    nvme_free_bytes: float,
    host_device_bytes_per_s: float,
    nvme_bytes_per_s: float,
    cpu_memory_bytes_per_s: float,
    zero_stage: int,
    offload: Literal["none", "cpu", "nvme"],
    micro_batches_per_step: int = 1,
    time_limit_s: float = 5.0,
    param_update_bytes: float | None = None,
    grad_update_bytes: float | None = None,
    device_to_host_bytes_per_s: float | None = None,
    optimizer_params: float = 0.0,
    cpu_adam_params_per_s: float | None = None,
    offload_pinned: bool = False,
    param_fetches_per_step: int | None = None,
    optimizer_host_extra_bytes: float = 0.0,
    optimizer_nvme_host_bytes: float = 0.0,
) -> PlacementResult:
    """Choose the tier of each model state: minimise per-step transfer time subject to tier capacities,
    the offload tier and ZeRO semantics (objective and constraints in the module docstring).
    ``offload_pinned``: ``offload`` is the user's pin, so the optimizer states go to that tier (a requirement;
    otherwise an allowance). Raises ValueError when the ZeRO stage rules the pinned tier out (ZeRO 0).

    Byte arguments are per GPU (already divided by the ZeRO sharding); ``*_free_bytes`` are what is left
    for model states on that tier (GPU: after activations and buffers). Bandwidths and throughputs are per
    GPU; ``device_to_host_bytes_per_s`` defaults to ``host_device_bytes_per_s``; ``optimizer_params`` and
    ``cpu_adam_params_per_s``, ``param_fetches_per_step`` as in ``transfer_times``.
    ``optimizer_host_extra_bytes``: host bytes the optimizer needs besides ``optimizer_bytes`` when it is on the
    CPU and the parameters on the GPU (module docstring; counted in ``cpu_bytes``); ``optimizer_nvme_host_bytes``:
    the part of ``optimizer_bytes`` that stays in host memory when the optimizer is on NVMe. Never raises for lack of
    memory: returns ``feasible=False`` with the least-overflowing legal placement.
    """
    state_bytes = {"params": float(param_bytes), "grads": float(grad_bytes),
                   "optimizer": float(optimizer_bytes)}
    capacity = {"gpu": float(gpu_free_bytes), "cpu": float(cpu_free_bytes), "nvme": float(nvme_free_bytes)}
    if zero_stage not in (0, 1, 2, 3) or offload not in legality.OFFLOAD_TIERS:
        raise ValueError(f"zero_stage must be 0..3 and offload none|cpu|nvme, got {zero_stage}, {offload!r}")
    if (micro_batches_per_step < 1 or min(*state_bytes.values(), *capacity.values(), optimizer_host_extra_bytes,
                                           optimizer_nvme_host_bytes) < 0
            or optimizer_nvme_host_bytes > optimizer_bytes):
        raise ValueError("bytes and capacities must be >= 0 and micro_batches_per_step >= 1")
    measured = [v for v in (device_to_host_bytes_per_s, cpu_adam_params_per_s) if v is not None]
    if min(host_device_bytes_per_s, nvme_bytes_per_s, cpu_memory_bytes_per_s, *measured) <= 0 or optimizer_params < 0:
        raise ValueError("bandwidths and throughputs must be > 0, optimizer_params >= 0")
    rates = dict(host_device_bytes_per_s=host_device_bytes_per_s, nvme_bytes_per_s=nvme_bytes_per_s,
                      cpu_memory_bytes_per_s=cpu_memory_bytes_per_s,
                      device_to_host_bytes_per_s=device_to_host_bytes_per_s or host_device_bytes_per_s,
                      optimizer_params=float(optimizer_params), cpu_adam_params_per_s=cpu_adam_params_per_s,
                      param_fetches_per_step=param_fetches_per_step,
                      optimizer_nvme_host_bytes=float(optimizer_nvme_host_bytes))
    updates = dict(param_update_bytes=float(param_bytes if param_update_bytes is None else param_update_bytes),
                   grad_update_bytes=float(grad_bytes if grad_update_bytes is None else grad_update_bytes))
    legal = enumerate_legal_placements(zero_stage, offload, offload_pinned)
    if not legal:  # a pin the ZeRO stage rules out (ZeRO 0 with the optimizer off the GPU)
        broken = legality.violations(legality.config(zero=zero_stage, offload=offload))
        raise ValueError(f"no placement of the model states is legal with ZeRO {zero_stage} and the offload pin "
                         f"{offload!r}: {'; '.join(rule.reason for rule in broken) or 'schemas.legality'}")

    rules = dict(host_extra_bytes=float(optimizer_host_extra_bytes))
    tiers, proven, _ = _solve(state_bytes, updates, capacity, legal, rates, micro_batches_per_step, time_limit_s,
                              allow_overflow=False, **rules)
    feasible = tiers is not None
    if tiers is None:  # nothing fits: the legal placement that overflows least, then the fastest
        tiers, proven, _ = _solve(state_bytes, updates, capacity, legal, rates, micro_batches_per_step,
                                  time_limit_s, allow_overflow=True, **rules)
        assert tiers is not None, "a placement with unbounded overflow always exists"
    used = {tier: sum(state_bytes[s] for s in STATES if tiers[s] == tier) for tier in TIERS}
    if tiers["optimizer"] == "cpu" and tiers["params"] == "gpu":
        used["cpu"] += float(optimizer_host_extra_bytes)
    if tiers["optimizer"] == "nvme":
        used["nvme"] -= float(optimizer_nvme_host_bytes)
        used["cpu"] += float(optimizer_nvme_host_bytes)
    return PlacementResult(
        param_tier=tiers["params"],
        grad_tier=tiers["grads"],
        optimizer_tier=tiers["optimizer"],
        gpu_bytes=used["gpu"],
        cpu_bytes=used["cpu"],
        nvme_bytes=used["nvme"],
        transfer=transfer_times(tiers["params"], tiers["grads"], tiers["optimizer"], param_bytes=param_bytes,
                                grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes,
                                micro_batches_per_step=micro_batches_per_step, **rates, **updates),
        feasible=feasible,
        optimal=proven,
        overflow_bytes={tier: max(0.0, used[tier] - capacity[tier]) for tier in TIERS},
    )


def _solve(state_bytes, updates, capacity, legal, rates, micro_batches_per_step, time_limit_s, *,
           allow_overflow: bool, host_extra_bytes: float = 0.0) -> tuple[dict[str, Tier] | None, bool, float]:
    """Build and solve the CP-SAT model (`legal`: the placements allowed, enumerate_legal_placements;
    `host_extra_bytes`: the optimizer's host bytes beside parameters on the GPU; module docstring). Returns
    ({state: tier} or None if infeasible, proven optimal, the model's own transfer seconds for that placement: a
    cross-check of ``transfer_times``)."""
    model = cp_model.CpModel()
    on = {(s, t): model.new_bool_var(f"{s}_on_{t}") for s in STATES for t in TIERS}
    for s in STATES:
        model.add_exactly_one(on[s, t] for t in TIERS)
        for t in TIERS:
            if all(placement[s] != t for placement in legal):
                model.add(on[s, t] == 0)
    allowed = {tuple(placement[s] for s in STATES) for placement in legal}
    for combo in itertools.product(TIERS, repeat=len(STATES)):
        if combo not in allowed:  # not this combination
            model.add_bool_or([~on[s, t] for s, t in zip(STATES, combo, strict=True)])
    optimizer_off, params_off = ~on["optimizer", "gpu"], ~on["params", "gpu"]

    def both(a, b, name):
        """A boolean equal to a AND b."""
        var = model.new_bool_var(name)
        model.add_bool_and([a, b]).only_enforce_if(var)
        model.add_bool_or([~a, ~b, var])
        return var

    # What each tier holds: (boolean, bytes) items, the states, and on the CPU the optimizer's extra host bytes
    # beside parameters on the GPU, and its part kept in host memory when it is on NVMe.
    nvme_host = rates.get("optimizer_nvme_host_bytes", 0.0)
    loads = {t: [(on[s, t], state_bytes[s] - (nvme_host if (s, t) == ("optimizer", "nvme") else 0.0))
                 for s in STATES] for t in TIERS}
    if host_extra_bytes > 0:
        loads["cpu"].append((both(on["optimizer", "cpu"], on["params", "gpu"], "host_master"), host_extra_bytes))
    if nvme_host > 0:
        loads["cpu"].append((on["optimizer", "nvme"], nvme_host))

    # Transfer time of each term in seconds, by the boolean that switches it on (module docstring).
    param_b, grad_b, optim_b = state_bytes["params"], state_bytes["grads"], state_bytes["optimizer"]
    param_u, grad_u = updates["param_update_bytes"], updates["grad_update_bytes"]
    m = micro_batches_per_step
    fetches = rates.get("param_fetches_per_step") or 2 * micro_batches_per_step
    # `rates`: transfer_times' keyword arguments; the measured ones (downward link, CPU Adam) may be absent.
    up, nvme = rates["host_device_bytes_per_s"], rates["nvme_bytes_per_s"]
    down = rates.get("device_to_host_bytes_per_s") or up
    adam_s = cpu_adam_step_s(optim_b, grad_u, param_u, rates["cpu_memory_bytes_per_s"],
                             rates.get("optimizer_params", 0.0), rates.get("cpu_adam_params_per_s"))
    terms_s = [
        (on["grads", "cpu"], grad_b * m / down),  # gradients streamed to CPU every micro-batch
        (both(optimizer_off, on["grads", "gpu"], "grads_down_once"), grad_u / down),  # accumulated on GPU
        (both(optimizer_off, on["params", "gpu"], "params_up_after_step"), param_u / up),
        (params_off, fetches * param_b / up),  # ZeRO-3 fetches from CPU/NVMe every forward and backward
        (both(on["optimizer", "gpu"], params_off, "params_down_after_step"), param_b / down),
        (optimizer_off, adam_s),  # CPU Adam
        (on["optimizer", "nvme"], 2 * (optim_b - nvme_host) / nvme),  # optimizer states swapped in and out
        (on["params", "nvme"], (fetches + 1) * param_b / nvme),  # fetch reads + write of updated params
    ]
    time_unit_s = max(sum(seconds for _, seconds in terms_s), 1e-30) / TIME_RESOLUTION
    time_units = [(var, round(seconds / time_unit_s)) for var, seconds in terms_s]
    # Lexicographic: time first, then tier rank (gpu 0, cpu 1, nvme 2); ranks sum to at most 6 < 8.
    objective = [(var, 8 * units) for var, units in time_units]
    objective += [(on[s, t], rank) for s in STATES for rank, t in enumerate(TIERS)]

    if not allow_overflow:
        # Capacity, exactly in floating point: no set of items whose bytes exceed a tier may share it.
        for t in TIERS:
            for size in range(1, len(loads[t]) + 1):
                for items in itertools.combinations(loads[t], size):
                    if sum(nbytes for _, nbytes in items) > capacity[t]:
                        model.add_bool_or([~var for var, _ in items])
    else:
        # Least overflow, in integer units of 1e-6 of all state bytes (a diagnostic: nearest rounding).
        # Small integers on purpose: CP-SAT 9.15's presolve returned a wrong OPTIMAL on this model with
        # byte-sized coefficients (~1e10) next to the AND auxiliaries.
        memory_unit_bytes = max(sum(state_bytes.values()) + host_extra_bytes, 1.0) / OVERFLOW_RESOLUTION
        overflow_vars = []
        for t in TIERS:
            capacity_units = round(min(capacity[t] / memory_unit_bytes, OVERFLOW_RESOLUTION))
            overflow = model.new_int_var(0, OVERFLOW_RESOLUTION + len(loads[t]), f"{t}_overflow")
            load = cp_model.LinearExpr.weighted_sum([var for var, _ in loads[t]],
                                                    [round(nbytes / memory_unit_bytes) for _, nbytes in loads[t]])
            model.add(load <= capacity_units + overflow)
            overflow_vars.append(overflow)
    time_expr = cp_model.LinearExpr.weighted_sum([v for v, _ in objective], [w for _, w in objective])
    solver = _solver(time_limit_s)
    if allow_overflow:  # first the least overflow, then the fastest placement with that overflow
        total_overflow = cp_model.LinearExpr.sum(overflow_vars)
        model.minimize(total_overflow)
        if solver.solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None, False, float("nan")
        model.add(total_overflow <= round(solver.objective_value))
    model.minimize(time_expr)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, status == cp_model.INFEASIBLE, float("nan")
    tiers = {s: next(t for t in TIERS if solver.boolean_value(on[s, t])) for s in STATES}
    model_time_s = sum(units * solver.value(var) for var, units in time_units) * time_unit_s
    return tiers, status == cp_model.OPTIMAL, model_time_s


def _solver(time_limit_s: float) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 2  # the former num_search_workers
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.random_seed = 0
    return solver
