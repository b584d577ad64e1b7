"""`zplan dryrun OUT/`: run a compiled plan's program at its full world size on fake tensors and measure its memory.

For each kind of rank (one per pipeline stage: the first holds the embedding, the last the head and the loss;
within a stage every dp and tp rank holds the same), the dry run becomes that rank of a fake world of the plan's
size (runtime.dryrun.fake_world) and makes the same runtime calls train.py makes, with train.py's own settings (its
MODEL_FILE, LR, WEIGHT_DECAY, GRAD_CLIP): plan_mesh, build_meta_model, parallelize (tensor parallel, recompute,
pipeline stage and schedule, FSDP2 / DDP / ZeRO-1, offload), plan_optimizer, then `steps` optimizer steps of
runtime.training.step.optimizer_step on synthetic batches. runtime.dryrun.live_memory counts every storage the steps
hold (the model states made before the first step included) and its peak by category.

What it proves: the program runs at this world size on this rank (every shape, mesh, shard and schedule is
built), and the bytes it allocates at its peak, as torch.cuda.max_memory_allocated would count them. What it
cannot see: the caching allocator's reserve and fragmentation, the CUDA context and NCCL's own buffers (the
plan's framework reserve stands for them), kernel workspaces (cuBLAS, flash attention), values and timings. The
dry run runs on the CPU: scaled_dot_product_attention takes the CPU's flash kernel, which saves the output and
the log-sum-exp as the GPU's flash and memory-efficient kernels do (O(s*h) per layer, no (s, s) scores).
"""

from __future__ import annotations

import ast
import dataclasses
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from zplan.api import compile_plan, write_outputs
from zplan.errors import PlanMismatchError, ZplanError
from zplan.runtime.dryrun.dry_run import TrainSettings, dry_run_rank
from zplan.runtime.dryrun.fake_world import MAILBOX
from zplan.runtime.plan.check import check_plan, load_plan
from zplan.runtime.plan.origin import check_plan_origin
from zplan.schemas.plan import RankVerification, Verification
from zplan.schemas.spec import Pins

DRYRUN_STEPS = 2  # optimizer steps: the first makes the optimizer's states, the second runs with them


class DryRunError(Exception):
    """The program failed on a fake rank: it would fail on the cluster too (the message says where)."""


class DryRunUnsupported(ZplanError):
    """A plan the dry run cannot run on fake tensors (the message says why)."""


def unsupported_reason(plan) -> str | None:
    """Why the dry run cannot run `plan`, or None. The NVMe swap engine writes tensor bytes to files and reads them
    back, which fake tensors do not have (zplan's CPU Adam runs on them: it allocates nothing, so it is skipped)."""
    if plan.parallel.offload == "nvme":
        return ("the plan offloads the optimizer to NVMe: its swap engine writes and reads tensor bytes, which the dry "
                "run's fake tensors do not have (not built)")
    return None


@dataclass
class RankMemory:
    """One kind of rank: what the dry run measured and what the plan predicted, bytes per GPU."""

    rank: int
    stage: int
    role: str  # e.g. "stage 0 of 2 (embedding)"
    measured_peak_bytes: int  # allocated bytes at the peak of the steps
    predicted_peak_bytes: float  # the plan's total minus its framework reserve (allocated bytes, like the measure),
    # for its most loaded stage: the same figure on every rank
    capacity_bytes: float  # the device's memory minus the plan's framework reserve
    by_category: dict  # measured, near the peak (runtime.dryrun.live_memory)
    predicted_by_category: dict
    host_peak_bytes: int  # offloaded states this rank holds in host memory
    predicted_host_bytes: float  # the plan's CPU bytes per node / GPUs per node
    seconds: float

    @property
    def fits(self) -> bool:
        return self.measured_peak_bytes <= self.capacity_bytes


@dataclass
class DryRunResult:
    world_size: int
    steps: int
    ranks: list[RankMemory] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def max_rel_error(self) -> float:
        """|predicted - measured| / measured on the most loaded rank: the plan prices the most loaded stage."""
        top = max(self.ranks, key=lambda r: r.measured_peak_bytes)
        return abs(top.predicted_peak_bytes - top.measured_peak_bytes) / max(1, top.measured_peak_bytes)

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    def to_json(self) -> dict:
        ranks = [{**asdict(r), "fits": r.fits} for r in self.ranks]
        return {"world_size": self.world_size, "steps": self.steps, "ranks": ranks,
                "max_rel_error": self.max_rel_error, "fits": self.fits, "seconds": self.seconds,
                "measures": "allocated bytes (no allocator reserve, fragmentation, CUDA context or NCCL buffers)"}


# ---- the program ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Program:
    """What OUT/train.py runs: its plan and model file and its hyper-parameters."""

    plan: object  # schemas.plan.Plan
    model_path: Path
    settings: object  # runtime.dryrun.dry_run.TrainSettings


def load_program(out_dir: Path, model: Path | None = None) -> Program:
    """OUT/plan.json and the settings of OUT/train.py, checked as train.py checks them (plan_origin, check_plan):
    PlanMismatchError on a folder that is not a compiled training plan or a model file that changed."""
    out_dir = Path(out_dir)
    script = out_dir / "train.py"
    if not (out_dir / "plan.json").is_file() or not script.is_file():
        raise PlanMismatchError(f"{out_dir} is not a folder `zplan compile` wrote for training (it needs plan.json and "
                                "train.py): compile a model first, e.g. `zplan compile model.py --gpus 8 -o OUT`")
    plan = load_plan(out_dir / "plan.json")
    if plan.model.source == "family":
        raise PlanMismatchError(f"{out_dir} was compiled from a family spec: there is no model code to run. Compile a "
                                "model file to dry-run it")
    try:  # read as data, never run: the only code zplan runs is the model file
        constants = train_script_constants(script)
        model_file = constants["MODEL_FILE"]
        planned_for, digest = constants["PLANNED_FOR"], constants["PLAN_DIGEST"]
        settings = (float(constants["LR"]), float(constants["WEIGHT_DECAY"]), float(constants["GRAD_CLIP"]))
    except (KeyError, TypeError, ValueError, SyntaxError, OSError) as error:  # an edited or foreign train.py
        raise PlanMismatchError(f"{script} is not a train.py `zplan compile` wrote ({type(error).__name__}: "
                                f"{error}): recompile the model") from error
    model_path = Path(model) if model else (script.parent / model_file)
    check_plan_origin(plan, planned_for, digest, model_path)
    world = plan.parallel.tp * plan.parallel.pp * plan.parallel.dp * plan.parallel.cp
    check_plan(plan, model_path, world)

    return Program(plan, model_path, TrainSettings(*settings))


TRAIN_SCRIPT_CONSTANTS = ("MODEL_FILE", "PLANNED_FOR", "PLAN_DIGEST", "LR", "WEIGHT_DECAY", "GRAD_CLIP")


def train_script_constants(script: Path) -> dict:
    """TRAIN_SCRIPT_CONSTANTS as an emitted train.py assigns them at its top level, parsed with ast (literals
    only: ValueError otherwise); a missing one is absent from the result."""
    constants = {}
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in TRAIN_SCRIPT_CONSTANTS:
                constants[node.targets[0].id] = ast.literal_eval(node.value)
    return constants


def representative_ranks(plan) -> list[tuple[int, int, str]]:
    """(global rank, stage, role) of one rank per pipeline stage: dp rank 0, cp rank 0, tp rank 0 (the mesh is
    (pp, dp, cp, tp), tp innermost: runtime.parallel.mesh)."""
    p = plan.parallel
    roles = []
    for stage in range(p.pp):
        parts = [name for name, at in (("embedding", 0), ("head and loss", p.pp - 1)) if stage == at]
        role = f"stage {stage} of {p.pp}" + (f" ({', '.join(parts)})" if parts else "")
        roles.append((stage * p.dp * p.cp * p.tp, stage, role))
    return roles


def predicted_memory(plan) -> tuple[float, dict, float, float]:
    """(peak, by category, capacity, host per GPU) as the plan predicts them, allocated bytes (module docstring)."""
    memory, cluster = plan.prediction.memory, plan.cluster
    by_category = {"parameters": memory.parameters, "gradients": memory.gradients, "optimizer": memory.optimizer,
                   "activations": memory.activations, "comm_buffers": memory.comm_buffers}
    return (memory.total - memory.reserve, by_category, memory.capacity - memory.reserve,
            memory.cpu_bytes_per_node / cluster.gpus_per_node)


def dry_run(program: Program, *, steps: int = DRYRUN_STEPS, stages: list[int] | None = None,
            say: Callable[[str], None] = print) -> DryRunResult:
    """Dry-run every kind of rank of the program (load_program) (module docstring), or those of the pipeline stages
    in `stages` (a stage whose predecessor was not run receives the shapes the last stage run sent:
    runtime.dryrun.fake_world). DryRunError when the program fails on a rank."""
    reason = unsupported_reason(program.plan)
    if reason:
        raise DryRunUnsupported(f"cannot dry-run this plan: {reason}")
    MAILBOX.clear()  # what earlier stages send later ones (runtime.dryrun.fake_world): the stages run in order
    start = time.perf_counter()
    plan = program.plan
    predicted, predicted_by_category, capacity, host = predicted_memory(plan)
    world = plan.parallel.tp * plan.parallel.pp * plan.parallel.dp * plan.parallel.cp
    result = DryRunResult(world_size=world, steps=steps)
    for rank, stage, role in representative_ranks(plan):
        if stages is not None and stage not in stages:
            continue
        say(f"dry run: rank {rank} of {world}, {role}")
        try:
            measured = dry_run_rank(plan, program.model_path, rank, program.settings, steps, say)
        except ZplanError:
            raise
        except Exception as error:
            raise DryRunError(f"the program fails on rank {rank} of {world} ({role}): {type(error).__name__}: "
                              f"{error}") from error
        result.ranks.append(RankMemory(
            rank=rank, stage=stage, role=role, measured_peak_bytes=measured.peak_bytes, predicted_peak_bytes=predicted,
            capacity_bytes=capacity, by_category=measured.by_category, predicted_by_category=predicted_by_category,
            host_peak_bytes=measured.host_peak_bytes, predicted_host_bytes=host, seconds=measured.seconds))
    result.seconds = time.perf_counter() - start
    return result


# ---- zplan compile --verify ----------------------------------------------------------------------------------

VERIFY_METHOD = ("zplan dryrun: the emitted program's runtime calls on fake tensors (FakeTensorMode) under a fake "
                 "process group of the plan's world size, the pipeline's end stages, every storage counted "
                 "(allocated bytes; no allocator reserve, fragmentation, CUDA context or NCCL buffers)")


def verification_of(result: DryRunResult):
    """The plan.json record (schemas.plan.Verification) of a dry run."""
    ranks = [RankVerification(rank=r.rank, stage=r.stage, role=r.role, measured_peak_bytes=r.measured_peak_bytes,
                              predicted_peak_bytes=r.predicted_peak_bytes, capacity_bytes=r.capacity_bytes,
                              by_category={k: int(v) for k, v in r.by_category.items()},
                              host_peak_bytes=r.host_peak_bytes) for r in result.ranks]
    return Verification(method=VERIFY_METHOD, torch_version=torch.__version__, steps=result.steps, ranks=ranks,
                        max_rel_error=result.max_rel_error, fits=result.fits, seconds=result.seconds)


def dry_run_plan(plan, model_ref: str, say: Callable[[str], None] = print) -> DryRunResult:
    """Dry-run the end stages of a plan not written yet: its outputs go to a temporary folder first."""
    with tempfile.TemporaryDirectory(prefix="zplan-verify-") as folder:
        out = Path(folder) / "out"
        write_outputs(plan, out, model_ref)
        program = load_program(out, Path(model_ref))
        pp = plan.parallel.pp
        return dry_run(program, say=say, stages=sorted({0, pp - 1}))


def pins_of(parallel):
    """The Pins that compile exactly `parallel` (a schemas.plan.ParallelConfig), and their command-line flags."""
    p = parallel
    pins = Pins(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, zero=p.zero_stage, offload=p.offload, micro_batch=p.micro_batch,
                recompute=p.recompute, sequence_parallel=p.sequence_parallel, interleave=p.interleave)
    return pins, p.pin_flags()


def verify(plan, request, model_ref: str, say: Callable[[str], None], *, alternatives, tries: int = 3):
    """`zplan compile --verify`: (the plan with its Verification, None) when the dry run shows it fits, (the plan as it
    is, None) when the dry run cannot run it (unsupported_reason, said through `say`); else (None, why): the measured
    numbers and the first of the next `tries` of `alternatives` (the search's, schemas.alternatives.Alternatives)
    that the dry run shows fits (each compiled with its pins and dry-run), or that none did."""
    reason = unsupported_reason(plan)
    if reason:
        say(f"verify: not verified, {reason}")
        return plan, None
    result = dry_run_plan(plan, model_ref, say)
    if result.fits:
        return plan.model_copy(update={"verification": verification_of(result)}), None
    worst = max(result.ranks, key=lambda r: r.measured_peak_bytes)
    gib = 2**30
    why = (f"the dry run shows the plan does not fit: rank {worst.rank} ({worst.role}) allocates "
           f"{worst.measured_peak_bytes / gib:.2f} GiB at its peak (planned {worst.predicted_peak_bytes / gib:.2f}) "
           f"of {worst.capacity_bytes / gib:.2f} GiB")
    tried = 0
    for alternative in alternatives.alternatives:
        if tried == tries:
            break
        if not alternative.feasible or alternative.parallel == plan.parallel or alternative.parallel.offload != "none":
            continue
        tried += 1
        pins, flags = pins_of(alternative.parallel)
        say(f"verify: dry run of the next plan, {flags}")
        other = compile_plan(dataclasses.replace(request, pins=pins))
        other_result = dry_run_plan(other, model_ref, say)
        if other_result.fits:
            top = max(other_result.ranks, key=lambda r: r.measured_peak_bytes)
            return None, (f"{why}. The dry run shows this plan fits ({top.measured_peak_bytes / 2**30:.2f} GiB of "
                          f"{top.capacity_bytes / 2**30:.2f}): compile with {flags}")
    return None, f"{why}, nor do the next {tried} plans the planner ranks: pin recompute, offload or more GPUs"
