"""Read plan.json and refuse a run it was not made for, before any collective (docs/design.md decision 1).

Every rank runs the same check on the same inputs, so a mismatch stops all ranks with the same
message instead of hanging one of them in a collective.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from pydantic import ValidationError

from zplan.errors import PlanMismatchError, validation_message
from zplan.model.hf_folder import is_hf_folder, source_sha256
from zplan.safe_files import UnsafeFileError, read_capped
from zplan.schemas import legality
from zplan.schemas.capability import capability_problems
from zplan.schemas.cluster import CPU_PROCESS_GPU, ClusterSpec
from zplan.schemas.plan import MAX_PLAN_FILE_BYTES, PLAN_SCHEMA_VERSION, Plan

# How far the device memory torch reports may be from the profile's before the GPU counts as another one: torch
# reports about 6 % more bytes than the data sheets' GB (an A100 80GB: 79.2 GiB = 85.0 GB; an H200 141GB: 139.7 GiB
# = 150 GB, the total capacity torch's out-of-memory errors name), while one GPU model comes with memories a factor
# 2 apart (A100 40GB and 80GB).
DEVICE_MEMORY_TOLERANCE = 0.15


def load_plan(path: str | Path) -> Plan:
    """The Plan in a plan.json file; PlanMismatchError when it is missing or not a valid plan."""
    path = Path(path)
    try:
        text = read_capped(path, MAX_PLAN_FILE_BYTES, "the plan").decode()
    except (UnsafeFileError, UnicodeDecodeError) as exc:
        raise PlanMismatchError(f"cannot read the plan {path}: {exc}. Pass the plan.json `zplan compile` "
                                "wrote.") from None
    except OSError as exc:
        raise PlanMismatchError(
            f"cannot read the plan {path}: {exc.strerror}. train.py expects plan.json beside it, as "
            "`zplan compile` writes them."
        ) from exc
    try:
        return Plan.model_validate_json(text)
    except ValidationError as exc:
        raise PlanMismatchError(
            f"{path} is not a plan this zplan can read (it reads plan schema version "
            f"{PLAN_SCHEMA_VERSION}): {exc.error_count()} validation error(s): {validation_message(exc)}. "
            "Recompile the model with this zplan."
        ) from exc


def model_file_sha256(path: str | Path) -> str:
    """SHA-256 (hex) of the model file's bytes (a Hugging Face folder's config.json), as the plan's fingerprint
    records it."""
    return source_sha256(path)


def _has(module_name: str, attribute: str) -> bool:
    try:
        return hasattr(importlib.import_module(module_name), attribute)
    except ImportError:
        return False


def missing_torch_features(plan: Plan) -> list[str]:
    """torch.distributed APIs the plan needs that this torch lacks (docs/design.md decision 4)."""
    p = plan.parallel
    needed = [("torch.distributed.device_mesh", "init_device_mesh")]
    if p.zero_stage == 1:
        needed += [("torch.distributed.tensor", "DTensor"), ("torch.distributed", "all_gather_into_tensor")]
    if p.zero_stage in (2, 3):
        needed += [("torch.distributed.fsdp", "fully_shard"),
                   ("torch.distributed.fsdp", "MixedPrecisionPolicy")]
        if p.offload in ("cpu", "nvme"):
            needed.append(("torch.distributed.fsdp", "CPUOffloadPolicy"))
    if p.tp > 1:
        needed.append(("torch.distributed.tensor.parallel", "parallelize_module"))
    if p.pp > 1:
        needed.append(("torch.distributed.pipelining", "pipeline"))
    if p.recompute == "selective":
        needed.append(("torch.utils.checkpoint", "create_selective_checkpoint_contexts"))
    return [f"{module}.{attr}" for module, attr in needed if not _has(module, attr)]


def plan_values(plan: Plan) -> dict[str, int]:
    """The plan's choices as schemas.legality's fields. Of where the model states live only the parameters' tier:
    the runtime reads it (FSDP2's CPUOffloadPolicy, parameter swapping); the gradients and the optimizer follow the
    offload tier."""
    p = plan.parallel
    return legality.config(zero=p.zero_stage, offload=p.offload, delayed_update=p.delayed_update, tp=p.tp, pp=p.pp,
                           cp=p.cp, ep=p.ep, interleave=p.interleave, sequence_parallel=p.sequence_parallel,
                           precision=plan.train.precision, parameters=plan.placement.parameters,
                           **p.compression.model_dump())


def runtime_gaps(plan: Plan) -> list[str]:
    """What in the plan zplan's runtime cannot run, each with what to pin instead (empty: it runs): the rules of
    schemas.legality it breaks.

    The planner may still choose these when nothing else fits, so that the report shows the way to
    fit; the emitted train.py refuses them before any collective.
    """
    values = plan_values(plan)
    return [f"{legality.describe(rule, values)} ({rule.reason}): {rule.fix}" for rule in legality.violations(values)]


def context_parallel_problems(plan: Plan, model_path: str | Path | None) -> list[str]:
    """What in a plan with cp > 1 the runtime cannot run on this model and these sequences
    (runtime/parallel/context_parallel.py), each with the fix; empty for cp = 1 (what cp runs with is
    schemas.legality's, runtime_gaps). The model file is read as text (its top-level names), not run."""
    p = plan.parallel
    if p.cp == 1:
        return []
    problems, seq = [], plan.train.seq_len
    if seq % (2 * p.cp):
        problems.append(f"context parallel over cp={p.cp} with sequences of {seq} tokens: each sequence is cut into "
                        f"2*cp = {2 * p.cp} equal chunks, so seq_len must be a multiple of {2 * p.cp}")
    elif p.sequence_parallel and (seq // p.cp) % p.tp:
        problems.append(f"sequence parallel over tp={p.tp} of the {seq // p.cp} tokens a cp rank holds (seq_len / cp): "
                        f"it must be a multiple of tp")
    if model_path is not None and Path(model_path).is_file() and "loss_fn" in _top_level_names(Path(model_path)):
        problems.append(f"context parallel (cp={p.cp}) splits each sequence over ranks and computes the next-token "
                        f"loss on each part; {Path(model_path).name} defines its own loss_fn, which cannot be split "
                        "so: remove loss_fn (the default is next-token cross-entropy) or recompile with --cp 1")
    return problems


def _top_level_names(path: Path) -> set[str]:
    """Names a Python file defines or assigns at module level (parsed, not run)."""
    import ast

    try:
        tree = ast.parse(path.read_text())
    except (SyntaxError, UnicodeDecodeError):
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def model_file_problems(source: str, fp, model_path: str | Path | None, compile_example: str, emitted: str
                        ) -> list[str]:
    """What is wrong with the model file of this run against the plan's fingerprint `fp` (an empty list: nothing).
    A plan made for a family spec (`source` 'family') has no model code to run: PlanMismatchError at once."""
    if source == "family":
        raise PlanMismatchError(
            f"this plan was made for the family spec '{fp.model_ref}', which has no model code to run: family specs "
            f"are for planning only. Compile a model file instead, e.g. {compile_example}, and run {emitted}.")
    if model_path is None:
        return [f"no model file given; the plan was made for {fp.model_ref} (pass --model PATH)"]
    if not Path(model_path).is_file() and not is_hf_folder(model_path):
        return [f"model file {model_path} does not exist (the plan was made for {fp.model_ref})"]
    if model_file_sha256(model_path) != fp.model_sha256:
        digests = (f"sha256 of {model_path} is {model_file_sha256(model_path)[:12]}..., the plan's fingerprint says "
                   f"{fp.model_sha256[:12]}...")
        if Path(model_path).name != Path(fp.model_ref).name:  # not the file the plan was compiled from
            return [f"this plan was made for another model file, {fp.model_ref}, not {model_path}: compile "
                    f"{model_path} for its own plan ({digests})"]
        return [f"model file edited since the plan was made: recompile ({digests})"]
    return []


def raise_mismatch(problems: list[str]) -> None:
    """PlanMismatchError listing `problems`, if any."""
    if len(problems) == 1:
        raise PlanMismatchError(f"plan does not match this run: {problems[0]}.")
    if problems:
        raise PlanMismatchError("plan does not match this run:\n" + "\n".join(f"  - {p}" for p in problems))


def device_mismatch(cluster: ClusterSpec, device_type: str, device_name: str = "", device_bytes: int = 0
                    ) -> str | None:
    """Why this run's devices are not those `cluster` (the plan's profile) describes, in one line, or None.

    device_type is the run's ("cuda" with NCCL, "cpu" with gloo: runtime.launch.distributed), device_name and
    device_bytes the GPU's name and memory as torch reports them. A CPU-process profile (cpu-local, zplan probe's) is
    for "cpu"; a GPU profile is for "cuda" with a device whose name holds the profile's model (A100-SXM4-80GB: "A100")
    and whose memory is within DEVICE_MEMORY_TOLERANCE of the profile's. The run still runs; its predictions do not
    hold."""
    planned_gpu = cluster.gpu.name
    wrong = "its predicted time and memory do not hold here"
    on_gpu = "recompile with the --cluster of this GPU (see `zplan clusters`)"
    if planned_gpu == CPU_PROCESS_GPU:
        if device_type == "cpu":
            return None
        return f"the plan is for CPU processes ({cluster.name}) but this run is on {device_name}: {wrong}; {on_gpu}"
    planned = f"{cluster.name} ({planned_gpu}, {cluster.gpu.hbm_bytes / 1e9:.0f} GB)"
    if device_type != "cuda":
        return (f"the plan is for {planned} but this run has no GPU (CPU processes, gloo): {wrong}; recompile with "
                "--cluster cpu-local, or a profile of this machine from `zplan probe`")
    model = (planned_gpu.replace("-", " ").split() or [""])[0]  # "A100" of "A100-SXM4-80GB"
    other_model = model.lower() not in device_name.lower()
    other_memory = abs(device_bytes / cluster.gpu.hbm_bytes - 1) > DEVICE_MEMORY_TOLERANCE
    if other_model or other_memory:
        return (f"the plan is for {planned} but this run is on {device_name} ({device_bytes / 1e9:.0f} GB): {wrong}; "
                f"{on_gpu}")
    return None


def check_plan(plan: Plan, model_path: str | Path | None, world_size: int) -> None:
    """Raise PlanMismatchError naming every way this run differs from what the plan was made for.

    Checks: the model is a file (family specs cannot be built), the model file's SHA-256 against the
    fingerprint, the world size against the fingerprint and tp * pp * dp * cp, what the runtime cannot run
    yet (runtime_gaps, context_parallel_problems), and the torch features the plan needs. Touches no process group.
    """
    fp = plan.fingerprint
    problems = model_file_problems(plan.model.source, fp, model_path, "`zplan compile model.py --gpus N`",
                                   "the train.py it writes")
    if world_size != fp.world_size:
        problems.append(
            f"world size: this run has {world_size} process(es), the plan was made for {fp.world_size}; "
            f"launch with launch/torchrun.sh or recompile with --gpus {world_size}"
        )
    p = plan.parallel
    if p.tp * p.pp * p.dp * p.cp != fp.world_size:
        problems.append(
            f"the plan is inconsistent: tp*pp*dp*cp = {p.tp * p.pp * p.dp * p.cp} != its world size {fp.world_size}"
        )
    problems += [f"the runtime does not run {gap}" for gap in runtime_gaps(plan)]
    problems += context_parallel_problems(plan, model_path)
    problems += capability_problems(plan.model.traits, p.tp, p.pp, p.sequence_parallel,
                                    block_tokens=plan.model.block_tokens, fp8=plan.train.precision == "fp8",
                                    nvfp4=plan.train.precision == "nvfp4", cp=p.cp, ep=p.ep,
                                    vocab_split=p.vocab_parallel)
    if p.vocab_parallel and (p.tp == 1 or p.cp > 1):
        problems.append("the plan is inconsistent: parallel.vocab_parallel needs tp > 1 and cp = 1")
    missing = missing_torch_features(plan)
    if missing:
        import torch

        problems.append(
            f"torch {torch.__version__} lacks {', '.join(missing)}, which the plan needs "
            f"(ZeRO {p.zero_stage}, tp={p.tp}, pp={p.pp}, recompute={p.recompute}); install a newer torch"
        )
    raise_mismatch(problems)
