"""Runtime overhead: step time of zplan's runtime under ZeRO 0/1/2/3 against hand-written torch code
for the same plan, and against DeepSpeed itself (ZeRO 1 and 2 in fp32, ZeRO 1 in bf16), all in the same
2 processes (gloo).

    .venv/bin/python benchmarks/runtime_overhead.py [--json] [--rounds 3] [--steps 4] [--skip-deepspeed]
                                                    [--skip-bf16] [--stages 0 1 2 3]

The model is benchmarks/_small_gpt.py (examples/gpt.py at 4 layers, hidden 256, vocabulary 8192,
64 tokens, 5.3M parameters), compiled for each stage with
    zplan compile benchmarks/_small_gpt.py --gpus 2 --cluster cpu-local --precision fp32 --tp 1 --pp 1
                  --zero Z --global-batch 4 --micro-batch 1            (2 micro-batches per rank)
zplan's side makes the calls the emitted train.py makes (build_model, apply_* in the plan's order,
build_optimizer, make_data_iter, train). The baselines are written out here in plain torch:
ZeRO 0 against DDP, ZeRO 1 against DDP + ZeroRedundancyOptimizer, ZeRO 2 and 3 against FSDP2
fully_shard per block and at the root (reshard_after_forward False / True); same model, seed, data,
micro-batches, fused AdamW, clipping, and the same per-step loss all-reduce that logging needs.
DeepSpeed runs the plan's ds_config.json (codegen.ds_config) with `torch_adam: true`, on its CPU
accelerator (DS_ACCELERATOR=cpu; without oneCCL it falls back to gloo), with the warm-up/cosine learning rate
the other sides use set on its optimizer's groups before each step. In fp32 (ZeRO 1 and 2) its engine wraps
torch.optim.AdamW in deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.

bf16 ZeRO 1 (on by default, --skip-bf16 leaves it out; it runs when --stages has 1): the ZeRO-1 plan
compiled again with --precision bf16, nothing else changed (checked: same parallel config, placement, batch),
timed against DeepSpeed like the pairs above. zplan: bf16 parameters and gradients on every rank
(runtime.precision.mixed.cast_parameters; DDP all-reduces the bf16 gradients after the last micro-batch), and
runtime.optim.sharded_adamw.ShardedAdamW (ZeRO-1 rows, device states) keeps fp32 master rows and fp32 moments for its
dim-0 row shard, steps them with the fused AdamW kernel, rounds them into the bf16 parameter rows and gathers those (the
clipping factor divides the upcast gradient rows in the step: train_loop._clip_in_step). DeepSpeed 0.19.8: the same
config with "bf16": {"enabled": true} and zero_optimization stage 1 (codegen.ds_config writes it for a bf16 plan) and
torch_adam. Its engine casts the parameters (not the buffers) to bf16; with no data_types.grad_accum_dtype the
gradients accumulate in bf16 too, so _do_optimizer_sanity_check picks ZeRO (not BF16_Optimizer, which it takes
only for fp32 gradient accumulation) and the optimizer that runs is DeepSpeedZeroOptimizer over torch.optim.AdamW
(torch's default on CPU, the single-tensor loop, over one flat fp32 partition per group) holding the fp32 master
partition and fp32 moments of its shard; gradients are all-reduced in bf16 (its communication_data_type) at the
accumulation boundary and the bf16 partitions all-gathered after the step: the same precision and memory layout
as zplan's. The JSON says which class ran (deepspeed.optimizer_by_precision), and its rows are in the DeepSpeed
section with "precision": "bf16". Both sides start from the same fp32 weights rounded to bf16: their first losses
are equal (first_loss_zplan, first_loss_deepspeed), the later ones within bf16 rounding (3e-4 over 11 steps).

A step is timed from the outside, from the fetch of its first micro-batch to the next step's, so it
includes everything the loop does (wall time, and this process's CPU time). Each pair (zplan and its
baseline) runs `--rounds` times back to back, alternating which side goes first; the first 2 steps of
every run are left out (lazy initialisation). A ratio is the median over rounds of the round's
zplan median over the baseline's median; the CPU-time ratio (same steps) is printed beside it: on
this shared 2-core machine other processes take the cores and the wall ratio of a single round can
swing by +-50 %, while CPU time shows whether zplan does more work. The load average is printed.
Targets: max_step_time_ratio <= 1.05, step_time_ratio_vs_deepspeed <= 1.0 (zplan over
DeepSpeed, the larger of ZeRO 1 and 2, fp32). Target: zero1_bf16_vs_deepspeed <= 1.0 (zplan's bf16 ZeRO-1 step
time over DeepSpeed's; zero1_bf16_vs_deepspeed_cpu, its CPU-time ratio, beside it).

The first DeepSpeed run on a machine JIT-builds its shared-memory comm op (about 3.5 minutes on 2
cores, cached in ~/.cache/torch_extensions afterwards). The script takes about 110 s on a quiet 2-core
machine, up to 4 minutes when other processes load it; the bf16 ZeRO-1 pair adds about 10 s (--skip-bf16).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import (  # noqa: E402
    CLUSTER,
    SMALL_GPT,
    StepClock,
    apply_plan,
    compile_plan_files,
    load_average,
    median,
    run_workers,
    write_result,
)

WORLD = 2
SEED = 0
LR = 3e-4
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
WARMUP_STEPS_SKIPPED = 2  # left out of every run: lazy init, first allocations
GLOBAL_BATCH, MICRO_BATCH = 4, 1
BF16_ZERO1 = "zero1-bf16"  # the plan key (and folder) of the ZeRO-1 plan compiled with --precision bf16
BASELINES = {0: "DDP", 1: "DDP + ZeroRedundancyOptimizer", 2: "FSDP2 (reshard_after_forward=False)",
             3: "FSDP2 (reshard_after_forward=True)"}


# ---- the three sides, each building its own model from the same seed --------------------------------


def run_zplan(plan, model_file, model_path, mesh, ctx, steps: int) -> tuple[list[float], list[float], float]:
    """The emitted train.py's calls for `plan`; returns (wall and CPU seconds of the kept steps, first loss)."""
    from zplan.runtime import WarmupCosine, check_plan, train, train_config

    check_plan(plan, model_path, ctx.world_size)
    model, optimizer, data = apply_plan(plan, model_file, mesh, ctx, seed=SEED, lr=LR, weight_decay=WEIGHT_DECAY,
                                        steps=steps)
    clock = StepClock(data, plan.parallel.num_micro_batches)
    # rank 0's progress bar and summary go to this worker's stdout, as train.py's do (the parent drops them)
    schedule = WarmupCosine(max_lr=LR, warmup_steps=max(1, steps // 10), total_steps=steps)
    losses = train(model, optimizer, clock, model_file.loss_fn,
                   train_config(plan, steps=steps, lr_schedule=schedule, grad_clip=GRAD_CLIP), ctx)
    return clock.step_times_s(WARMUP_STEPS_SKIPPED), clock.step_cpu_s(WARMUP_STEPS_SKIPPED), losses[0]


def _param_groups(model):
    """nanoGPT's AdamW groups: weight decay on matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _next_token_loss(logits, tokens):  # logits (B, T, V), tokens (B, T)
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def run_baseline(plan, model_file, ctx, steps: int) -> tuple[list[float], list[float], float]:
    """Hand-written torch for the same plan: DDP (+ ZeroRedundancyOptimizer) or FSDP2."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    from zplan.runtime import WarmupCosine, synthetic_token_batches

    p = plan.parallel
    torch.manual_seed(SEED)
    model = model_file.build_model()
    if p.zero_stage in (0, 1):
        model = DistributedDataParallel(model)
        if p.zero_stage == 1:
            optimizer = ZeroRedundancyOptimizer(_param_groups(model), optimizer_class=torch.optim.AdamW, lr=LR,
                                                fused=True)
        else:
            optimizer = torch.optim.AdamW(_param_groups(model), lr=LR, fused=True)
    else:
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=p.zero_stage == 3)
        fully_shard(model, reshard_after_forward=p.zero_stage == 3)
        optimizer = torch.optim.AdamW(_param_groups(model), lr=LR, fused=True)
    micro = p.num_micro_batches
    clock = StepClock(synthetic_token_batches(
        vocab=plan.model.vocab, seq_len=plan.train.seq_len, micro_batch=p.micro_batch, num_micro_batches=micro,
        dp_rank=ctx.rank, dp_size=p.dp, seed=SEED), micro)
    schedule = WarmupCosine(max_lr=LR, warmup_steps=max(1, steps // 10), total_steps=steps)
    losses = []
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = schedule(step)
        loss_sum = torch.zeros(())
        for m in range(micro):
            tokens = next(clock)  # (B, T)
            no_sync = isinstance(model, DistributedDataParallel) and m < micro - 1
            with model.no_sync() if no_sync else contextlib.nullcontext():
                loss = _next_token_loss(model(tokens), tokens) / micro
                loss.backward()
            loss_sum += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        losses.append(loss_sum.item() / ctx.world_size)
        float(norm)
    return clock.step_times_s(WARMUP_STEPS_SKIPPED), clock.step_cpu_s(WARMUP_STEPS_SKIPPED), losses[0]


# What DeepSpeed's engine wrapped around which optimizer, by plan precision (run_deepspeed notes it; the worker
# reports it): e.g. "DeepSpeedZeroOptimizer over AdamW", never assumed.
DEEPSPEED_OPTIMIZERS: dict[str, str] = {}


def run_deepspeed(plan, model_file, ctx, steps: int) -> tuple[list[float], list[float], float]:
    """DeepSpeed's engine on the plan's ds_config.json (AdamW with torch_adam; bf16 enabled for a bf16 plan), same
    model, data and learning-rate schedule."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from zplan.codegen.ds_config import deepspeed_config
    from zplan.runtime import WarmupCosine, synthetic_token_batches

    p = plan.parallel
    config = deepspeed_config(plan)
    config["optimizer"]["params"].update(lr=LR, torch_adam=True)
    config["steps_per_print"] = 10**9
    torch.manual_seed(SEED)
    model = model_file.build_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=_param_groups(model), config=config)
    DEEPSPEED_OPTIMIZERS[plan.train.precision] = (f"{type(engine.optimizer).__name__} over "
                                                  f"{type(engine.basic_optimizer).__name__}")
    micro = p.num_micro_batches
    clock = StepClock(synthetic_token_batches(
        vocab=plan.model.vocab, seq_len=plan.train.seq_len, micro_batch=p.micro_batch, num_micro_batches=micro,
        dp_rank=ctx.rank, dp_size=p.dp, seed=SEED), micro)
    schedule = WarmupCosine(max_lr=LR, warmup_steps=max(1, steps // 10), total_steps=steps)
    losses = []
    engine.train()
    for step in range(steps):
        for group in engine.optimizer.param_groups:  # the wrapper's groups are its torch AdamW's
            group["lr"] = schedule(step)
        loss_sum = torch.zeros(())
        for _ in range(micro):
            tokens = next(clock)  # (B, T)
            loss = _next_token_loss(engine(tokens), tokens)
            engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
            engine.step()  # steps the optimizer at the accumulation boundary only
            loss_sum += loss.detach() / micro
        dist.all_reduce(loss_sum)
        losses.append(loss_sum.item() / ctx.world_size)
        float(engine.get_global_grad_norm() or 0.0)
    if hasattr(engine, "destroy"):
        engine.destroy()
    return clock.step_times_s(WARMUP_STEPS_SKIPPED), clock.step_cpu_s(WARMUP_STEPS_SKIPPED), losses[0]


# ---- the worker: every configuration, round after round, in these 2 processes ------------------------


def worker(args, ctx) -> None:
    import torch

    torch.set_num_threads(1)
    from zplan.runtime import build_mesh, load_model_file, load_plan

    plan_dir = Path(args.plan_dir)
    plans = {z: load_plan(plan_dir / f"zero{z}" / "plan.json") for z in (0, 1, 2, 3)}
    if (plan_dir / BF16_ZERO1).exists():
        plans[BF16_ZERO1] = load_plan(plan_dir / BF16_ZERO1 / "plan.json")
    model_file = load_model_file(SMALL_GPT)
    mesh = build_mesh(pp=1, dp=WORLD, tp=1, device_type=ctx.device.type)
    steps = WARMUP_STEPS_SKIPPED + args.steps + 1  # the last step has no next fetch to end its timing
    runners = {  # by plan key: a ZeRO stage (fp32), or BF16_ZERO1
        "zplan": lambda key: run_zplan(plans[key], model_file, SMALL_GPT, mesh, ctx, steps),
        "baseline": lambda key: run_baseline(plans[key], model_file, ctx, steps),
        "deepspeed": lambda key: run_deepspeed(plans[key], model_file, ctx, steps),
    }

    def compare(other: str, keys, rounds: int) -> list[dict]:
        """zplan against `other` for each plan key, `rounds` times, alternating which goes first (by round and
        ZeRO stage)."""
        wall, cpu, first_loss = {}, {}, {}
        round_ratios = {z: [] for z in keys}
        for r in range(rounds):
            for z in keys:
                medians = {}
                stage = plans[z].parallel.zero_stage
                for side in (("zplan", other) if (r + stage) % 2 == 0 else (other, "zplan")):
                    kept_wall, kept_cpu, first_loss[side, z] = runners[side](z)
                    wall.setdefault((side, z), []).extend(kept_wall)
                    cpu.setdefault((side, z), []).extend(kept_cpu)
                    medians[side] = median(kept_wall)
                round_ratios[z].append(medians["zplan"] / medians[other])
        return [{
            "zero_stage": plans[z].parallel.zero_stage, "precision": plans[z].train.precision,
            "zplan_step_s": median(wall["zplan", z]), f"{other}_step_s": median(wall[other, z]),
            # each round's pair runs back to back, under much the same machine load: the median of the
            # rounds' ratios is the headline; the ratio of the pooled medians is kept beside it
            "ratio": median(round_ratios[z]), "pooled_ratio": median(wall["zplan", z]) / median(wall[other, z]),
            "round_ratios": round_ratios[z],
            "zplan_cpu_s": median(cpu["zplan", z]), f"{other}_cpu_s": median(cpu[other, z]),
            "cpu_ratio": median(cpu["zplan", z]) / median(cpu[other, z]), "steps_timed": len(wall["zplan", z]),
            "first_loss_zplan": first_loss["zplan", z], f"first_loss_{other}": first_loss[other, z],
        } for z in keys]

    stages = tuple(args.stages)
    rows = compare("baseline", stages, args.rounds)
    for row in rows:
        row["baseline"] = BASELINES[row["zero_stage"]]
    deepspeed_result = {"ran": False, "error": None, "rows": [], "bf16_ran": False, "bf16_error": None}
    with_bf16 = BF16_ZERO1 in plans and not args.skip_bf16 and 1 in stages
    if not args.skip_deepspeed and (with_bf16 or any(z in (1, 2) for z in stages)):
        try:
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
            deepspeed_result.update(version=deepspeed.__version__, accelerator=os.environ.get("DS_ACCELERATOR"))
        except Exception as exc:  # neither comparison can run
            deepspeed_result["error"] = deepspeed_result["bf16_error"] = f"{type(exc).__name__}: {exc}"
            deepspeed_result["traceback"] = traceback.format_exc()[-3000:]
    if not args.skip_deepspeed and any(z in (1, 2) for z in stages) and not deepspeed_result["error"]:
        try:
            deepspeed_result["rows"] = compare("deepspeed", tuple(z for z in stages if z in (1, 2)),
                                               args.deepspeed_rounds)
            deepspeed_result["ran"] = True
        except Exception as exc:  # say exactly why; never a made-up number
            deepspeed_result["error"] = f"{type(exc).__name__}: {exc}"
            deepspeed_result["traceback"] = traceback.format_exc()[-3000:]
    # mixed-precision ZeRO 1 against DeepSpeed's
    if not args.skip_deepspeed and with_bf16 and not deepspeed_result["bf16_error"]:
        try:
            deepspeed_result["rows"] += compare("deepspeed", (BF16_ZERO1,), args.deepspeed_rounds)
            deepspeed_result["bf16_ran"] = True
        except Exception as exc:  # its own error: the fp32 rows stand
            deepspeed_result["bf16_error"] = f"{type(exc).__name__}: {exc}"
            deepspeed_result["bf16_traceback"] = traceback.format_exc()[-3000:]
    deepspeed_result["optimizer_by_precision"] = dict(DEEPSPEED_OPTIMIZERS)
    if ctx.is_main:
        write_result(args.worker, {"rows": rows, "deepspeed": deepspeed_result, "torch": torch.__version__,
                                   "load_average_end": load_average()})


# ---- the parent ----------------------------------------------------------------------------------------


def compile_bf16_plan(out_dir: Path):
    """_launch.compile_plan_files(..., zero=1) with --precision bf16: the same pins (tp 1, pp 1, ZeRO 1, global batch
    and micro-batch), the same zplan.api calls as the CLI."""
    from zplan.api import compile_plan, prepare, write_outputs
    from zplan.schemas.plan import Plan
    from zplan.schemas.spec import Pins

    pins = Pins(tp=1, pp=1, dp=None, zero=1, micro_batch=MICRO_BATCH, recompute=None)
    plan = compile_plan(prepare(str(SMALL_GPT), WORLD, CLUSTER, GLOBAL_BATCH, None, "bf16", pins))
    write_outputs(plan, out_dir, str(SMALL_GPT))
    return Plan.model_validate_json((out_dir / "plan.json").read_text())


def _check_same_plan(fp32_plan, bf16_plan) -> None:
    """The bf16 pair times the fp32 ZeRO-1 plan's layout in bf16: only the precision may differ."""
    same = (fp32_plan.parallel == bf16_plan.parallel and fp32_plan.placement == bf16_plan.placement
            and fp32_plan.train.model_copy(update={"precision": "bf16"}) == bf16_plan.train)
    if not same:
        raise RuntimeError(f"the bf16 ZeRO-1 plan differs from the fp32 one beyond its precision: "
                           f"{bf16_plan.parallel} {bf16_plan.placement} against {fp32_plan.parallel} "
                           f"{fp32_plan.placement}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each zplan/baseline pair (default 3)")
    parser.add_argument("--deepspeed-rounds", type=int, default=2, help="runs of each zplan/DeepSpeed pair")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (default 4; 3 more run untimed)")
    parser.add_argument("--skip-deepspeed", action="store_true", help="leave DeepSpeed out")
    parser.add_argument("--skip-bf16", action="store_true",
                        help="leave out the bf16 ZeRO-1 pair against DeepSpeed (run by default)")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3],
                        help="ZeRO stages to time (default all; DeepSpeed runs those of 1 and 2)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--plan-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from zplan.runtime import run_distributed

        run_distributed(lambda ctx: worker(args, ctx))
        return

    start, load_start = time.perf_counter(), load_average()
    with tempfile.TemporaryDirectory(prefix="zplan-overhead-") as tmp:
        plans = {z: compile_plan_files(SMALL_GPT, WORLD, Path(tmp) / f"zero{z}", global_batch=GLOBAL_BATCH,
                                       micro_batch=MICRO_BATCH, zero=z) for z in (0, 1, 2, 3)}
        bf16_wanted = not (args.skip_bf16 or args.skip_deepspeed) and 1 in args.stages
        bf16_plan = compile_bf16_plan(Path(tmp) / BF16_ZERO1) if bf16_wanted else None
        if bf16_plan is not None:
            _check_same_plan(plans[1], bf16_plan)
        forwarded = ["--plan-dir", tmp, "--rounds", str(args.rounds), "--steps", str(args.steps),
                     "--deepspeed-rounds", str(args.deepspeed_rounds), "--stages", *map(str, args.stages)]
        if args.skip_deepspeed:
            forwarded.append("--skip-deepspeed")
        if args.skip_bf16:
            forwarded.append("--skip-bf16")
        measured = run_workers(Path(__file__).resolve(), WORLD, forwarded, timeout_s=1200,
                               env={"DS_ACCELERATOR": "cpu"})
    rows, ds = measured["rows"], measured["deepspeed"]
    ds_fp32 = [r for r in ds["rows"] if r["precision"] == "fp32"]
    ds_bf16 = next((r for r in ds["rows"] if r["precision"] == "bf16"), None)
    plan = plans[0]
    result = {
        "model": str(SMALL_GPT.relative_to(SMALL_GPT.parents[1])), "params": plan.model.params,
        "world_size": WORLD, "global_batch": GLOBAL_BATCH, "micro_batch": plan.parallel.micro_batch,
        "num_micro_batches": plan.parallel.num_micro_batches, "seq_len": plan.train.seq_len, "precision": "fp32",
        "rounds": args.rounds, "rows": rows,
        "max_step_time_ratio": max(r["ratio"] for r in rows),
        "max_cpu_time_ratio": max(r["cpu_ratio"] for r in rows),
        "deepspeed": ds,
        "step_time_ratio_vs_deepspeed": max(r["ratio"] for r in ds_fp32) if ds["ran"] else None,
        "step_time_ratio_vs_deepspeed_by_stage": {str(r["zero_stage"]): r["ratio"] for r in ds_fp32},
        "cpu_time_ratio_vs_deepspeed": max(r["cpu_ratio"] for r in ds_fp32) if ds["ran"] else None,
        # zplan's ZeRO 1 compiled with --precision bf16 over DeepSpeed's stage 1 with bf16 enabled
        "zero1_bf16_vs_deepspeed": ds_bf16["ratio"] if ds_bf16 else None,
        "zero1_bf16_vs_deepspeed_cpu": ds_bf16["cpu_ratio"] if ds_bf16 else None,
        "torch": measured["torch"], "wall_s": time.perf_counter() - start,
        "load_average": [load_start, measured["load_average_end"]], "cores": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['model']}: {plan.model.params / 1e6:.1f}M parameters, {WORLD} processes (gloo), global batch "
          f"{GLOBAL_BATCH} = {WORLD} ranks x {result['num_micro_batches']} micro-batches x {result['micro_batch']}"
          f" x {result['seq_len']} tokens, fp32, medians of {rows[0]['steps_timed']} steps per side")
    for r in rows:
        spread = ", ".join(f"{x:.3f}" for x in r["round_ratios"])
        print(f"  ZeRO {r['zero_stage']}: zplan {r['zplan_step_s'] * 1e3:7.1f} ms  {r['baseline']:<36} "
              f"{r['baseline_step_s'] * 1e3:7.1f} ms  ratio {r['ratio']:.3f}  (per round {spread}; CPU time "
              f"{r['zplan_cpu_s'] * 1e3:.0f} / {r['baseline_cpu_s'] * 1e3:.0f} ms = {r['cpu_ratio']:.3f})")
    print(f"max_step_time_ratio {result['max_step_time_ratio']:.3f} (target <= 1.05); CPU time: "
          f"{result['max_cpu_time_ratio']:.3f}")
    if ds["ran"]:
        for r in ds_fp32:
            spread = ", ".join(f"{x:.3f}" for x in r["round_ratios"])
            print(f"  ZeRO {r['zero_stage']}: zplan {r['zplan_step_s'] * 1e3:7.1f} ms  DeepSpeed {ds['version']} "
                  f"{r['deepspeed_step_s'] * 1e3:7.1f} ms  zplan/DeepSpeed {r['ratio']:.3f}  (per round {spread}; "
                  f"CPU time {r['zplan_cpu_s'] * 1e3:.0f} / {r['deepspeed_cpu_s'] * 1e3:.0f} ms = "
                  f"{r['cpu_ratio']:.3f})")
        print(f"step_time_ratio_vs_deepspeed {result['step_time_ratio_vs_deepspeed']:.3f} (target <= 1.0); CPU time: "
              f"{result['cpu_time_ratio_vs_deepspeed']:.3f}")
    else:
        print(f"DeepSpeed did not run: {ds['error'] or 'skipped (--skip-deepspeed)'}")
    if ds_bf16:
        r = ds_bf16
        spread = ", ".join(f"{x:.3f}" for x in r["round_ratios"])
        print(f"  ZeRO 1 bf16: zplan {r['zplan_step_s'] * 1e3:7.1f} ms  DeepSpeed {ds['version']} "
              f"({ds['optimizer_by_precision'].get('bf16', '?')}) {r['deepspeed_step_s'] * 1e3:7.1f} ms  "
              f"zplan/DeepSpeed {r['ratio']:.3f}  (per round {spread}; CPU time {r['zplan_cpu_s'] * 1e3:.0f} / "
              f"{r['deepspeed_cpu_s'] * 1e3:.0f} ms = {r['cpu_ratio']:.3f}; first loss {r['first_loss_zplan']:.4f} / "
              f"{r['first_loss_deepspeed']:.4f})")
        print(f"zero1_bf16_vs_deepspeed {r['ratio']:.3f} (target <= 1.0); CPU time: {r['cpu_ratio']:.3f}")
    elif ds.get("bf16_error"):
        print(f"bf16 ZeRO 1 against DeepSpeed did not run: {ds['bf16_error']}")
    print(f"({result['wall_s']:.0f} s; load average {result['load_average'][0]:.1f} at the start, "
          f"{result['load_average'][1]:.1f} at the end, on {result['cores']} cores)")


if __name__ == "__main__":
    main()
