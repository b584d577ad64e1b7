"""Model-state memory per rank: ZeRO 1/2/3 against replicated data parallel (ZeRO 0), measured in the
runtime on 2 and 4 processes (gloo), next to the ZeRO paper's ratio and the planner's prediction; and, measured
the same way, tensor parallel 2, pipeline parallel 2 and bf16 against the planner's prediction.

    .venv/bin/python benchmarks/model_state_memory.py [--json] [--worlds 2 4] [--cases NAME ...]

Model: benchmarks/_small_gpt.py (5.3M parameters). Every case is a plan compiled in this process (zplan.api
prepare / compile_plan / write_outputs, as the CLI does), for N processes
    zplan compile benchmarks/_small_gpt.py --gpus N --cluster cpu-local --precision P --zero Z
                  --tp T --pp PP --dp N/(T*PP) --global-batch N --micro-batch 1
and the workers make the emitted train.py's calls (_launch.apply_plan: build_meta_model, parallelize,
plan_optimizer, make_data_iter) and one training step as runtime.training.loop.train runs it (micro-batches
with DDP's no_sync, or PipelineRun.step; clipping; the optimizer step) on the planned micro-batches.
The cases, named LAYOUT_zeroZ_P (--json keys):
    N = 2: dp2_zero{0,1,2,3}_{fp32,bf16}, tp2_zero0_fp32 (dp 1 x tp 2), pp2_zero0_fp32 (pp 2 x dp 1);
    N = 4: dp4_zero{0,1,2,3}_{fp32,bf16}, dp2_tp2_zero{0,3}_fp32 (dp 2 x tp 2).
The first table (fp32, tp 1, pp 1) is the ZeRO study below ('rows' in --json); the second has every case:
the measured model-state bytes of the fullest rank, the plan's prediction (prediction.memory parameters +
gradients + optimizer: planner/cost/memory.py memory_per_gpu for the plan's candidate, the most loaded stage)
and measured / predicted; where ranks differ (pipeline stages), each rank's bytes against the planner's
per-parameter bytes (memory.state_bytes_per_param) times the parameters of that rank's stages in the plan
(plan.stages, blocks / tp, embedding and head whole, as memory_per_gpu counts them).

Measured, after the optimizer step and before zero_grad (where the runtime logs model_state_bytes):
the bytes of the distinct storages behind this rank's parameters, gradients and optimizer states
(DTensors: their local shard; so padding and flat buffers count as allocated). Also shown: the
runtime's own figure (numel x element size of the same tensors), the parameters a rank holds between
forward and backward (its shards plus what FSDP2 has gathered: ZeRO 2 keeps the gathered parameters
from forward until backward), and DDP's gradient buckets (a second copy of the gradients that DDP
allocates for its all-reduce; not a model state).

The planner counts the model states as zplan's runtime holds them at rest (planner/cost/memory.py): in fp32 and
under ZeRO 2/3 fp32 parameters (the masters; FSDP2's MixedPrecisionPolicy makes the 16-bit copies for compute),
fp32 gradients and fp32 Adam moments, 4 + 4 + 8 bytes per parameter; under ZeRO 0/1 with bf16 the ZeRO paper's
layout, bf16 parameters and gradients and the fp32 master with the moments in the optimizer, 2 + 2 + 12
(runtime/optim/layouts.py). ZeRO 1 shards the optimizer's bytes evenly (dim-0 chunks of every parameter), ZeRO 2 is
FSDP2 with reshard_after_forward=False, so parameters, gradients and optimizer states are all shards at
rest, like ZeRO 3, and the gathered parameters (compute dtype) are a transient term of the peak
(planner.cost.memory.compute_copy_bytes, part of the plan's comm_buffers). 'error' compares the
measured states after the step with the plan's model states; 'in step' adds the parameters gathered
between forward and backward and is compared with the model states plus that transient term.
The bf16 table (keys zero1_bytes_per_param, zero2_bytes_per_param) holds ZeRO-1's bytes per parameter
after the step against the paper's 4 + 12/N, and ZeRO-2's in the step against what docs/precision.md states, 2 + 16/N
(the paper's 2 + 14/N keeps a 16-bit gradient shard; FSDP2 reduce-scatters into fp32 shards).
Tensor parallel splits the blocks' parameters over tp and replicates the embedding, the final norm and the
(tied) head on every tp rank; the pipeline keeps each stage's units on its rank (and a tied weight on every
rank that uses it: runtime/parallel/pipeline.py tied_parameters).
The ZeRO paper's numbers, where stage 2 keeps whole parameters (as DeepSpeed does), are the theory
columns.

Theoretical ratio to ZeRO 0 (Rajbhandari et al. 2020, Figure 1, mixed precision, K = 12):
stage 1 (4 + 12/N)/16, stage 2 (2 + 14/N)/16, stage 3 1/N. In fp32 with fp32 master weights, as here,
the same partitioning gives stage 1 (8 + 8/N)/16, stage 2 (4 + 12/N)/16, stage 3 1/N (4 bytes of
parameters, 4 of gradients, 8 of Adam moments per parameter). Takes about 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import (  # noqa: E402
    CLUSTER,
    SMALL_GPT,
    apply_plan,
    predicted_model_state_bytes,
    run_workers,
    write_result,
)

STAGES = (0, 1, 2, 3)
SEED = 0
TOLERANCE = 0.02  # measured / predicted within 2 %


def paper_ratio(stage: int, n: int) -> float:
    """Model states under ZeRO stage `stage` over replicated, mixed precision (K = 12), ZeRO paper Fig. 1."""
    return {0: 1.0, 1: (4 + 12 / n) / 16, 2: (2 + 14 / n) / 16, 3: 1 / n}[stage]


def fp32_ratio(stage: int, n: int) -> float:
    """The same partitioning with fp32 parameters (4 B), gradients (4 B) and Adam moments (8 B)."""
    return {0: 1.0, 1: (8 + 8 / n) / 16, 2: (4 + 12 / n) / 16, 3: 1 / n}[stage]


# ---- cases --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One plan to measure: `world` processes as pp x dp x tp, ZeRO stage `zero`, compute `precision`."""

    world: int
    zero: int
    precision: str = "fp32"
    tp: int = 1
    pp: int = 1

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def name(self) -> str:
        layout = "_".join(f"{k}{v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp)) if v > 1)
        return f"{layout or 'dp1'}_zero{self.zero}_{self.precision}"

    @property
    def zero_study(self) -> bool:
        """A row of the ZeRO study (fp32, data parallel only): the first table and 'rows' in --json."""
        return self.precision == "fp32" and self.tp == 1 and self.pp == 1


def cases_for(world: int) -> list[Case]:
    cases = [Case(world, z, precision) for precision in ("fp32", "bf16") for z in STAGES]
    if world == 2:
        cases += [Case(2, 0, tp=2), Case(2, 0, pp=2)]
    if world == 4:
        cases += [Case(4, 0, tp=2), Case(4, 3, tp=2)]
    return cases


def compile_case(case: Case, out_dir: Path):
    """The plan of `case`, compiled in this process as `zplan compile` does (zplan.api) and written with its
    train.py to `out_dir`; returns the Plan read back from out_dir/plan.json."""
    from zplan.api import compile_plan, prepare, write_outputs
    from zplan.schemas.plan import Plan
    from zplan.schemas.spec import Pins

    pins = Pins(tp=case.tp, pp=case.pp, dp=case.dp, zero=case.zero, micro_batch=1)
    plan = compile_plan(prepare(str(SMALL_GPT), case.world, CLUSTER, case.world, None, case.precision, pins))
    write_outputs(plan, out_dir, str(SMALL_GPT))
    plan = Plan.model_validate_json((out_dir / "plan.json").read_text())
    p = plan.parallel
    if (p.tp, p.pp, p.dp, p.zero_stage, plan.train.precision) != (case.tp, case.pp, case.dp, case.zero,
                                                                   case.precision):
        raise RuntimeError(f"{case.name}: the planner made tp {p.tp} pp {p.pp} dp {p.dp} ZeRO {p.zero_stage} "
                           f"{plan.train.precision}")
    return plan


def stage_params_on_rank(plan, pp_rank: int) -> float:
    """Parameters a rank of pipeline rank `pp_rank` holds by the plan: its stages' units, the blocks / tp and the
    embedding and head whole, a tied head's copy of the table on a later stage (planner/cost/memory.py
    memory_per_gpu's count, on the plan's own stage split)."""
    p, layers = plan.parallel, plan.model.layers
    return sum((layers[i].params + (layers[i].shared_params if stage.first_layer > 0 else 0))
               / (p.tp if layers[i].kind == "block" else 1)
               for stage in plan.stages if stage.index % p.pp == pp_rank
               for i in range(stage.first_layer, stage.last_layer + 1))


def predicted_rank_bytes(plan, pp_rank: int) -> dict[str, float]:
    """The planner's bytes per parameter (memory.state_bytes_per_param) times stage_params_on_rank."""
    from zplan.planner.cost.memory import state_bytes_per_param
    from zplan.schemas.model_states import parameters_in_compute_dtype

    p = plan.parallel
    per_param = state_bytes_per_param(p.zero_stage, p.dp, p.offload != "none",
                                      parameters_offloaded=plan.placement.parameters != "gpu",
                                      sixteen_bit=parameters_in_compute_dtype(p.zero_stage, plan.train.precision,
                                                                              p.compression.grad))
    n = stage_params_on_rank(plan, pp_rank)
    return {k: float(b) * n for k, b in zip(("parameters", "gradients", "optimizer"), per_param, strict=True)}


# ---- worker ---------------------------------------------------------------------------------------------


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (local shards of DTensors)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _ddp_bucket_bytes(model) -> int:
    from torch.nn.parallel import DistributedDataParallel

    modules = getattr(model, "chunks", [model])  # a PipelineRun: each chunk is data-parallel like a model
    total = 0
    for module in modules:
        if isinstance(module, DistributedDataParallel):
            sizes = str(module._get_ddp_logging_data().get("bucket_sizes", ""))
            total += sum(int(s) for s in sizes.split(",") if s.strip())
    return total


def measure(plan, model_file, mesh, ctx) -> dict:
    """One training step of `plan` with the runtime; the bytes this rank holds."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from zplan.runtime.parallel.pipeline import PipelineRun
    from zplan.runtime.training.step import model_state_bytes

    p = plan.parallel
    model, optimizer, data = apply_plan(plan, model_file, mesh, ctx, seed=SEED, lr=3e-4, weight_decay=0.1)
    pipelined = isinstance(model, PipelineRun)
    persistent = list(model.parameters())  # DDP: the parameters; FSDP2: the shards, which stay allocated
    params_in_step = None
    if pipelined:  # the schedule runs every micro-batch's forward and backward (runtime.training.loop.train)
        model.step([next(data) for _ in range(p.num_micro_batches)])
        model.clip_grad_norm_(1.0)
    else:
        params_in_step = 0
        for micro in range(p.num_micro_batches):
            batch = next(data)
            last = micro == p.num_micro_batches - 1
            no_sync = isinstance(model, DistributedDataParallel) and not last  # as train() does
            with model.no_sync() if no_sync else contextlib.nullcontext():
                loss = model_file.loss_fn(model(batch), batch) / p.num_micro_batches
                # forward done, backward not: FSDP2 has gathered parameters (ZeRO 2 keeps them until backward)
                params_in_step = max(params_in_step, _storage_bytes([*persistent, *model.parameters()]))
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()

    params = list({id(q): q for q in model.parameters()}.values())
    # sharded states are DTensors (ZeRO 1: runtime.optim.layouts, ZeRO 2/3: FSDP2): their local shards count
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    row = {
        "parameters": _storage_bytes(params),
        "gradients": _storage_bytes(q.grad for q in params if q.grad is not None),
        "optimizer": _storage_bytes(states),
        "parameters_between_forward_and_backward": params_in_step,
        "ddp_bucket_bytes": _ddp_bucket_bytes(model),
        "num_params": sum(q.numel() for q in model_file.build_model().parameters()),  # tied weights once
        "pp_rank": mesh["pp"].get_local_rank(),
        "local_parameter_numel": sum((q.to_local() if hasattr(q, "to_local") else q).numel() for q in params),
        "parameter_dtypes": sorted({str(q.dtype) for q in params}),
        "gradient_dtypes": sorted({str(q.grad.dtype) for q in params if q.grad is not None}),
        "tied_names": model.tied_names if pipelined else {},  # a tied weight this pipeline rank holds a copy of
        "runtime_reported": sum(model_state_bytes(model, optimizer).values()),  # the runtime's own account
    }
    optimizer.zero_grad(set_to_none=True)
    return row


def predicted_gathered_bytes(plan) -> float:
    """The parameters the plan expects gathered between forward and backward besides the model states
    (ZeRO 2: the whole stage in the compute dtype), from the planner's own formula."""
    import numpy as np

    from zplan.planner.cost.inputs import GRAD_COMPRESSION
    from zplan.planner.cost.memory import compute_copy_bytes

    p = plan.parallel
    stage_params = max(stage.params for stage in plan.stages) / p.tp if p.pp > 1 else plan.model.params / p.tp
    grad_compress = GRAD_COMPRESSION.index(p.compression.grad)
    return float(compute_copy_bytes(np.array([stage_params]), np.array([p.zero_stage]), plan.train.precision,
                                    grad_compress=np.array([grad_compress]))[0])


def _total(r: dict) -> int:
    return r["parameters"] + r["gradients"] + r["optimizer"]


def worker(args, ctx) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from zplan.runtime import build_mesh, check_plan, load_model_file, load_plan

    model_file = load_model_file(SMALL_GPT)
    meshes = {}  # one mesh per shape, as every rank builds them in the same order
    rows = {}
    for name in args.cases:
        plan = load_plan(Path(args.plan_dir) / name / "plan.json")
        check_plan(plan, SMALL_GPT, ctx.world_size)
        p = plan.parallel
        shape = (p.pp, p.dp, p.tp)
        if shape not in meshes:
            meshes[shape] = build_mesh(pp=p.pp, dp=p.dp, tp=p.tp, device_type=ctx.device.type)
        mine = measure(plan, model_file, meshes[shape], ctx)
        gc.collect()  # this case's model and optimizer, before the next one's
        every = [None] * ctx.world_size
        dist.all_gather_object(every, mine)  # ranks may differ (uneven shards, pipeline stages): the fullest
        rows[name] = {**max(every, key=_total), "per_rank_total": [_total(r) for r in every],
                      "per_rank": [{k: r[k] for k in ("pp_rank", "parameters", "gradients", "optimizer",
                                                     "local_parameter_numel", "tied_names")} for r in every]}
    if ctx.is_main:
        write_result(args.worker, {"rows": rows})


# ---- parent -------------------------------------------------------------------------------------------


def stated_bf16_bytes_per_param(zero: int, n: int) -> float:
    """What docs/precision.md states the runtime holds with bf16 on n data-parallel ranks, bytes per parameter:
    ZeRO-1 the paper's 4 + 12/n after the step (bf16 parameters and gradients, fp32 master and moments of its rows:
    runtime.optim.layouts); ZeRO-2 2 + 16/n between forward and backward (FSDP2's gathered bf16 parameters beside its
    fp32 parameter and gradient shards and fp32 moments; the paper's 2 + 14/n has a 16-bit gradient shard)."""
    return {1: 4 + 12 / n, 2: 2 + 16 / n}[zero]


def bf16_row(case: Case, m: dict) -> dict:
    """A ZeRO-1 / ZeRO-2 bf16 case against stated_bf16_bytes_per_param: ZeRO-1's model states after the step, ZeRO-2's
    with the parameters it holds between forward and backward (its peak)."""
    n, params = case.world, m["num_params"]
    after_step = _total(m)
    in_step = m["parameters_between_forward_and_backward"] + m["gradients"] + m["optimizer"]
    measured = (after_step if case.zero == 1 else in_step) / params
    stated = stated_bf16_bytes_per_param(case.zero, n)
    return {"world_size": n, "zero_stage": case.zero, "measured_bytes_per_param": measured,
            "stated_bytes_per_param": stated, "relative_error": measured / stated - 1.0,
            "after_step_bytes_per_param": after_step / params, "in_step_bytes_per_param": in_step / params,
            "paper_bytes_per_param": {1: 4 + 12 / n, 2: 2 + 14 / n}[case.zero]}


def zero_study_row(case: Case, plan, m: dict, replicated: dict) -> dict:
    """A row of the ZeRO study table, as this benchmark has always reported it."""
    n, z = case.world, case.zero
    total = _total(m)
    predicted = predicted_model_state_bytes(plan)
    predicted_in_step = predicted + predicted_gathered_bytes(plan)
    in_step = m["parameters_between_forward_and_backward"] + m["gradients"] + m["optimizer"]
    memory = plan.prediction.memory
    return {
        "world_size": n, "zero_stage": z,
        "measured_bytes": total, "measured_parameters": m["parameters"],
        "measured_gradients": m["gradients"], "measured_optimizer": m["optimizer"],
        "per_rank_total": m["per_rank_total"], "runtime_reported_bytes": m["runtime_reported"],
        "parameters_between_forward_and_backward": m["parameters_between_forward_and_backward"],
        "ddp_bucket_bytes": m["ddp_bucket_bytes"], "planned_comm_buffers": memory.comm_buffers,
        "measured_ratio": total / _total(replicated),
        "paper_ratio_mixed_precision": paper_ratio(z, n), "fp32_ratio": fp32_ratio(z, n),
        "planned_bytes": predicted, "planned_parameters": memory.parameters,
        "planned_gradients": memory.gradients, "planned_optimizer": memory.optimizer,
        "relative_error_vs_plan": total / predicted - 1.0,
        "in_step_bytes": in_step, "planned_in_step_bytes": predicted_in_step,
        "relative_error_in_step_vs_plan": in_step / predicted_in_step - 1.0,
        "num_params": m["num_params"],
    }


def case_result(case: Case, plan, m: dict) -> dict:
    """measured / predicted for one case: the fullest rank against the plan's prediction, and every rank against
    the planner's bytes per parameter on its own stages."""
    memory = plan.prediction.memory
    predicted = predicted_model_state_bytes(plan)
    per_rank = []
    for rank, r in enumerate(m["per_rank"]):
        expected = predicted_rank_bytes(plan, r["pp_rank"])
        per_rank.append({
            "rank": rank, "pp_rank": r["pp_rank"], "measured_bytes": _total(r),
            "measured_parameters": r["parameters"], "measured_gradients": r["gradients"],
            "measured_optimizer": r["optimizer"], "local_parameter_numel": r["local_parameter_numel"],
            "planned_stage_params": stage_params_on_rank(plan, r["pp_rank"]), "tied_names": r["tied_names"],
            "predicted_bytes": sum(expected.values()), **{f"predicted_{k}": v for k, v in expected.items()},
            "ratio": _total(r) / sum(expected.values()),
        })
    p = plan.parallel
    return {
        "world_size": case.world, "dp": p.dp, "tp": p.tp, "pp": p.pp, "zero_stage": p.zero_stage,
        "precision": plan.train.precision, "num_micro_batches": p.num_micro_batches,
        "measured_bytes": _total(m), "measured_parameters": m["parameters"], "measured_gradients": m["gradients"],
        "measured_optimizer": m["optimizer"], "runtime_reported_bytes": m["runtime_reported"],
        "parameter_dtypes": m["parameter_dtypes"], "gradient_dtypes": m["gradient_dtypes"],
        "predicted_bytes": predicted, "predicted_parameters": memory.parameters,
        "predicted_gradients": memory.gradients, "predicted_optimizer": memory.optimizer,
        "ratio": _total(m) / predicted,
        "blocks_per_stage": [sum(plan.model.layers[i].kind == "block" for i in range(s.first_layer, s.last_layer + 1))
                             for s in plan.stages],
        "per_rank": per_rank,
    }


def explain(name: str, c: dict, num_blocks: int) -> list[str]:
    """Why a case's ratio is off by more than TOLERANCE, from what was measured and what the plan says."""
    lines = []
    mib = 2**20
    if c["pp"] > 1:
        uniform = math.ceil(num_blocks / c["pp"])
        if max(c["blocks_per_stage"]) != uniform:
            lines.append(f"{name}: the plan's stages hold {c['blocks_per_stage']} blocks, but memory_per_gpu prices "
                         f"ceil({num_blocks}/{c['pp']}) = {uniform} blocks per stage (blocks_per_stage), not the "
                         "partition's split")
        for r in c["per_rank"]:
            extra = r["local_parameter_numel"] - r["planned_stage_params"]
            if r["tied_names"] and extra > 0:
                tied = ", ".join(f"{mine} (= {first})" for mine, first in r["tied_names"].items())
                lines.append(f"{name}: rank {r['rank']} (pipeline rank {r['pp_rank']}) holds {extra:,.0f} parameters "
                             f"beyond its stage's {r['planned_stage_params']:,.0f} in the plan: its copy of the tied "
                             f"{tied}, with its gradient and Adam states ({r['measured_bytes'] / mib:.2f} MiB "
                             f"measured, {r['predicted_bytes'] / mib:.2f} MiB planned); the plan counts a tied weight "
                             "once, on the first stage (head params 0 when tied)")
    for state in ("parameters", "gradients", "optimizer"):
        measured, predicted = c[f"measured_{state}"], c[f"predicted_{state}"]
        if abs(measured / predicted - 1) > TOLERANCE:
            lines.append(f"{name}: {state} {measured / mib:.2f} MiB measured vs {predicted / mib:.2f} MiB predicted "
                         f"({measured / predicted - 1:+.1%})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="process counts (default 2 4)")
    parser.add_argument("--cases", nargs="+", help="only these cases (names as in --json; default all)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--plan-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from zplan.runtime import run_distributed

        run_distributed(lambda ctx: worker(args, ctx))
        return

    start = time.perf_counter()
    rows, cases, num_blocks, bf16_rows = [], {}, 0, {}
    for n in args.worlds:
        chosen = [c for c in cases_for(n) if args.cases is None or c.name in args.cases]
        if not chosen:
            continue
        with tempfile.TemporaryDirectory(prefix="zplan-memory-") as tmp:
            plans = {c.name: compile_case(c, Path(tmp) / c.name) for c in chosen}
            measured = run_workers(Path(__file__).resolve(), n,
                                   ["--plan-dir", tmp, "--cases", *plans], timeout_s=600)["rows"]
        num_blocks = sum(u.kind == "block" for u in next(iter(plans.values())).model.layers)
        replicated = measured.get(Case(n, 0).name)
        for c in chosen:
            if c.zero_study and replicated is not None:
                rows.append(zero_study_row(c, plans[c.name], measured[c.name], replicated))
            cases[c.name] = case_result(c, plans[c.name], measured[c.name])
            if c.precision == "bf16" and c.tp == c.pp == 1 and c.zero in (1, 2):
                bf16_rows[c.name] = bf16_row(c, measured[c.name])
    largest = {z: max((r for r in bf16_rows.values() if r["zero_stage"] == z), key=lambda r: r["world_size"],
                      default=None) for z in (1, 2)}
    result = {
        "model": "benchmarks/_small_gpt.py", "precision": "fp32", "rows": rows,
        "max_relative_error_vs_plan": max((abs(r["relative_error_vs_plan"]) for r in rows), default=None),
        "max_relative_error_in_step_vs_plan": max((abs(r["relative_error_in_step_vs_plan"]) for r in rows),
                                                  default=None),
        **cases,
        "cases": list(cases),
        "cases_off_by_more_than_2pct": [k for k, c in cases.items() if abs(c["ratio"] - 1) > TOLERANCE],
        "bf16_zero_study": bf16_rows,
        # the bf16 keys: at the largest world measured (4 by default)
        **{f"zero{z}_bytes_per_param": r["measured_bytes_per_param"] for z, r in largest.items() if r},
        **{f"zero{z}_stated_bytes_per_param": r["stated_bytes_per_param"] for z, r in largest.items() if r},
        "wall_s": time.perf_counter() - start,
    }
    notes = [line for k, c in cases.items() if abs(c["ratio"] - 1) > TOLERANCE for line in explain(k, c, num_blocks)]
    result["mismatch_notes"] = notes
    if args.json:
        print(json.dumps(result, indent=2))
        return
    mib = 2**20
    if rows:
        print_zero_study(result, rows)
    print(f"\nevery case: model-state MiB per rank after the optimizer step (p + g + o), the fullest rank, against "
          f"the plan's prediction (within {TOLERANCE:.0%}?)")
    print("  case                    N  dp tp pp  measured (p + g + o)          predicted (p + g + o)         ratio")
    for name, c in cases.items():
        flag = "" if abs(c["ratio"] - 1) <= TOLERANCE else "  <- off"
        print(f"  {name:22s} {c['world_size']:2d}  {c['dp']:2d} {c['tp']:2d} {c['pp']:2d}  "
              f"{c['measured_bytes'] / mib:6.2f} ({c['measured_parameters'] / mib:5.2f} + "
              f"{c['measured_gradients'] / mib:5.2f} + {c['measured_optimizer'] / mib:5.2f})  "
              f"{c['predicted_bytes'] / mib:6.2f} ({c['predicted_parameters'] / mib:5.2f} + "
              f"{c['predicted_gradients'] / mib:5.2f} + {c['predicted_optimizer'] / mib:5.2f})  "
              f"{c['ratio']:5.3f}{flag}")
    for name, c in cases.items():
        totals = [r["measured_bytes"] for r in c["per_rank"]]
        if max(totals) > (1 + TOLERANCE) * min(totals):
            print(f"  {name}: ranks differ; per rank, measured / planner's bytes per parameter x the plan's "
                  "parameters of its stages:")
            for r in c["per_rank"]:
                print(f"      rank {r['rank']} (pp rank {r['pp_rank']}): {r['measured_bytes'] / mib:6.2f} / "
                      f"{r['predicted_bytes'] / mib:6.2f} MiB = {r['ratio']:5.3f}  ({r['local_parameter_numel']:,} "
                      f"parameters held, {r['planned_stage_params']:,.0f} in the plan's stage)")
    for line in notes:
        print("  " + line)
    if bf16_rows:
        print("\nbf16, bytes per parameter per rank: ZeRO-1 after the step, ZeRO-2 between forward and backward, "
              "against the README's statement (within 2 %?) and the ZeRO paper's")
        for name, r in bf16_rows.items():
            flag = "" if abs(r["relative_error"]) <= TOLERANCE else "  <- off"
            print(f"  {name:22s} measured {r['measured_bytes_per_param']:.3f}  stated {r['stated_bytes_per_param']:.3f}"
                  f"  ({r['relative_error']:+.2%})  paper {r['paper_bytes_per_param']:.3f}{flag}")
    print(f"({result['wall_s']:.0f} s)")


def print_zero_study(result: dict, rows: list[dict]) -> None:
    mib = 2**20
    print(f"{result['model']}: {rows[0]['num_params'] / 1e6:.2f}M parameters, fp32; MiB per rank after the "
          "optimizer step (parameters + gradients + optimizer states)")
    print("   N  ZeRO  measured (p + g + o)          ratio  fp32 theory  paper (K=12)  planned (p + g + o)"
          "         error  p fwd->bwd  in step  error  DDP buckets (planned comm buffers)")
    for r in rows:
        print(f"  {r['world_size']:2d}  {r['zero_stage']:4d}  {r['measured_bytes'] / mib:6.2f} "
              f"({r['measured_parameters'] / mib:5.2f} + {r['measured_gradients'] / mib:5.2f} + "
              f"{r['measured_optimizer'] / mib:5.2f})  {r['measured_ratio']:5.3f}  {r['fp32_ratio']:11.3f}  "
              f"{r['paper_ratio_mixed_precision']:12.3f}  {r['planned_bytes'] / mib:6.2f} "
              f"({r['planned_parameters'] / mib:5.2f} + {r['planned_gradients'] / mib:5.2f} + "
              f"{r['planned_optimizer'] / mib:5.2f})  {r['relative_error_vs_plan']:+6.1%}  "
              f"{r['parameters_between_forward_and_backward'] / mib:10.2f}  {r['in_step_bytes'] / mib:7.2f}  "
              f"{r['relative_error_in_step_vs_plan']:+6.1%}  {r['ddp_bucket_bytes'] / mib:11.2f} "
              f"({r['planned_comm_buffers'] / mib:.2f})")
    for r in rows:
        if max(r["per_rank_total"]) > 1.02 * min(r["per_rank_total"]):
            print(f"  N={r['world_size']} ZeRO {r['zero_stage']}: uneven over ranks, MiB per rank "
                  + ", ".join(f"{b / mib:.2f}" for b in r["per_rank_total"]) + " (the largest is shown above)")
    reported = [r for r in rows if r["runtime_reported_bytes"] is not None]
    if reported:
        gap = max(abs(r["runtime_reported_bytes"] / r["measured_bytes"] - 1) for r in reported)
        print(f"the runtime's own model_state_bytes (numel x element size) is within {gap:.2%} of the storages above")
    print(f"max_relative_error_vs_plan {result['max_relative_error_vs_plan']:.1%} after the step (target: within 5%);"
          f" {result['max_relative_error_in_step_vs_plan']:.1%} in the step")
    print("'in step' = parameters between forward and backward + gradients + optimizer states after the step, "
          "against the plan's model states + the parameters it expects gathered then (ZeRO 2: all of them).")


if __name__ == "__main__":
    main()
