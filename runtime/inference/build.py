"""Build the inference engine an InferencePlan describes: what the emitted generate.py and serve.py call first.

    settings = EngineSettings.from_plan(plan)       # or the script's constants (they state the plan)
    engine, tokenizer, ctx = engine_from_plan(plan, model_path, settings=settings, weights=..., seed=...)

In order: join torch.distributed (runtime.launch.distributed: torchrun's environment, else a world of one), refuse a
plan made for another model file or world size before any collective (as train.py does), build the whole
model on the CPU on every rank (the engine shards it for tensor parallelism), load the weights (a
.safetensors file or a Hugging Face folder from `zplan export`, or train.py --save-weights' file; without one,
the seeded random init, with a warning that the text will be noise), and make the engine on a 1-D "tp"
DeviceMesh when tp > 1. Without CUDA the engine runs on the CPU in fp32, whatever the plan's dtype.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from pydantic import ValidationError
from torch import nn

from zplan.errors import ModelLoadError, PlanMismatchError, SpecError, validation_message
from zplan.model.model_file import load_model_file
from zplan.model.safetensors_format import read_safetensors
from zplan.runtime.inference.engine import InferenceEngine
from zplan.runtime.inference.tokenizer import load_tokenizer
from zplan.runtime.launch.distributed import RunContext, init_distributed
from zplan.runtime.plan.check import model_file_problems, raise_mismatch
from zplan.runtime.training.materialize import build_model
from zplan.safe_files import UnreadableFileError, UnsafeFileError, inside, read_json_capped
from zplan.schemas.inference import INFERENCE_PLAN_SCHEMA_VERSION, InferencePlan, WeightPrecision, WeightTier

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INDEX_FILE = "model.safetensors.index.json"  # a sharded Hugging Face folder: {"weight_map": {name: shard file}}
SINGLE_FILE = "model.safetensors"  # an unsharded one
MAX_INDEX_BYTES = 64 << 20  # an index names each tensor once: a few MB for the largest models


@dataclass(frozen=True)
class EngineSettings:
    """The plan's engine choices (InferencePlan.parallel); the emitted scripts state them as constants."""

    tp: int  # tensor-parallel degree: processes of this replica
    weight_precision: WeightPrecision  # fp32 | bf16 | fp16 | int8 | int4 | fp8 (block Linears' weights; fp8: W8A8)
    group_size: int  # input features per quantization scale (int8/int4)
    compute_dtype: str  # fp32 | bf16 | fp16 (activations, KV cache)
    weight_tier: WeightTier  # gpu (resident) | cpu | nvme (streamed layer by layer)
    prefetch_layers: int  # layers streamed ahead of the one computing
    max_batch: int  # sequences in flight at most (generate.py: per batch; serve.py: decoded together each step)
    max_seq_len: int  # prompt + generated tokens per sequence
    kv_blocks: int | None = None  # serve.py's paged KV cache in blocks of 16 tokens (None, plans before it: what
    # max_batch sequences of max_seq_len fill)

    @classmethod
    def from_plan(cls, plan: InferencePlan) -> EngineSettings:
        p = plan.parallel
        return cls(tp=p.tp, weight_precision=p.weight_precision, group_size=p.quant_group_size,
                   compute_dtype=p.compute_dtype, weight_tier=p.weight_tier, prefetch_layers=p.prefetch_layers,
                   max_batch=p.max_batch, max_seq_len=p.max_seq_len, kv_blocks=p.kv_blocks)


def load_inference_plan(path: str | Path) -> InferencePlan:
    """The InferencePlan in a plan.json; PlanMismatchError when it is missing, a training plan or invalid."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanMismatchError(f"cannot read the plan {path}: {exc.strerror}. generate.py and serve.py expect "
                                "plan.json beside them, as `zplan compile --mode inference` writes them.") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanMismatchError(f"{path} is not JSON ({exc.msg} at line {exc.lineno}): recompile.") from exc
    if isinstance(data, dict) and data.get("mode") != "inference":
        raise PlanMismatchError(f"{path} is a training plan: compile with `zplan compile MODEL --mode inference` "
                                "to get generate.py and serve.py.")
    try:
        return InferencePlan.model_validate(data)
    except ValidationError as exc:
        raise PlanMismatchError(
            f"{path} is not an inference plan this zplan can read (it reads inference plan schema version "
            f"{INFERENCE_PLAN_SCHEMA_VERSION}): {exc.error_count()} validation error(s): {validation_message(exc)}. "
            "Recompile the model with this zplan."
        ) from exc


def check_inference_plan(plan: InferencePlan, model_path: str | Path | None, world_size: int, tp: int) -> None:
    """Raise PlanMismatchError naming every way this run differs from what the plan was made for.

    Checks: the model is a file (family specs have no code to run), the file's SHA-256 against the
    fingerprint, and this run's processes against tp (one replica; the plan's world size counts all
    replicas). Touches no process group, so every rank stops with the same message."""
    problems = model_file_problems(plan.model.source, plan.fingerprint, model_path,
                                   "`zplan compile model.py --mode inference --gpus N`",
                                   "the generate.py / serve.py it writes")
    if world_size != tp:
        problems.append(f"world size: this run has {world_size} process(es), one replica of the plan needs tp = "
                        f"{tp}; launch with launch/generate.sh or launch/serve.sh (torchrun --nproc-per-node {tp})")
    raise_mismatch(problems)


# ---- weights ----------------------------------------------------------------------------------------------


def _folder_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder (`zplan export --hf`, save_pretrained): the shards its
    model.safetensors.index.json names, else its model.safetensors."""
    index = folder / INDEX_FILE
    if not index.exists():
        if (folder / SINGLE_FILE).is_file():
            return [folder / SINGLE_FILE]
        raise ModelLoadError(f"weights folder {folder} has neither {INDEX_FILE} nor {SINGLE_FILE}: pass the folder "
                             "`zplan export --to DIR --hf` wrote (or a Hugging Face folder saved with safetensors)")
    try:
        weight_map = read_json_capped(index, MAX_INDEX_BYTES, "the weights index")[0]["weight_map"]
        shards = sorted(set(weight_map.values()))
        files = [inside(folder, str(shard), str(index)) for shard in shards]
    except (KeyError, TypeError, AttributeError, UnreadableFileError, UnsafeFileError) as exc:
        raise ModelLoadError(f"cannot read the shard list of {index}: {exc}; is the folder complete?") from exc
    lost = [str(file) for file in files if not file.is_file()]
    if lost:
        raise ModelLoadError(f"{index} names {', '.join(lost[:3])}, which {'is' if len(lost) == 1 else 'are'} not "
                             "there: copy the whole folder")
    return files


def _load_failure(error: Exception) -> str:
    """torch.load's reason in one line: its weights-only refusal is a page that ends in advice to load the file
    unsafely (weights_only=False runs the code a file holds), of which the unpickler's own line is the reason."""
    text = str(error)
    marker = "WeightsUnpickler error:"
    if marker in text:
        reason = text.split(marker, 1)[1].strip().split("\n", 1)[0].split(". ", 1)[0]  # not its advice
        return f"the weights-only unpickler refused it ({reason or 'no reason given'})"
    return f"{type(error).__name__}: {text.strip().splitlines()[0]}" if text.strip() else type(error).__name__


def weight_files(path: str | Path) -> list[Path]:
    """The files of `path`: itself when it is a file, a Hugging Face folder's shards when it is one."""
    path = Path(path)
    if path.is_dir():
        return _folder_files(path)
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "does not exist"  # a FIFO
        raise ModelLoadError(f"weights file {path} {what}: pass the .safetensors file or the folder `zplan export` "
                             "wrote, or the file train.py --save-weights wrote.")
    return [path]


def read_weights_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from a .safetensors file (zplan export, train.py --save-weights FILE.safetensors) or a
    torch.save'd dict of tensors (train.py --save-weights FILE.pt), on the CPU."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelLoadError(f"{path} cannot be read as a torch.save state dict: {_load_failure(exc)}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"{path} is not a state dict (a dict of tensors, as train.py --save-weights writes).")
    return state


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Load `path` (a weights file, or a Hugging Face folder: one shard at a time) into `model` in place. Every
    parameter and buffer must be in it, except a tied weight stored under one of its names only; names the model
    lacks are an error. A tensor of another dtype (a bf16 export) is converted to the model's."""
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in weight_files(path):
        state = read_weights_file(file)
        try:
            result = model.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # shapes differ
            raise ModelLoadError(f"weights {file} do not fit the model: {str(exc).strip()}") from exc
        loaded |= set(state)
        unexpected += result.unexpected_keys
        del state  # one shard in memory at a time
    missing = [name for name in model.state_dict() if name not in loaded]
    aliases: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), set()).add(name)
    really_missing = [name for name in missing
                      if not any(alias in loaded for alias in aliases.get(id(_get(model, name)), ()))]
    if really_missing or unexpected:
        parts = []
        if really_missing:
            parts.append(f"missing {', '.join(really_missing[:5])}" + (" ..." if len(really_missing) > 5 else ""))
        if unexpected:
            parts.append(f"not in the model: {', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else ""))
        raise ModelLoadError(f"weights {path} do not fit the model ({'; '.join(parts)}): pass the weights of the "
                             "model file the plan was made for.")


def _get(model: nn.Module, name: str) -> torch.Tensor | None:
    module_path, _, attribute = name.rpartition(".")
    try:
        return getattr(model.get_submodule(module_path) if module_path else model, attribute)
    except AttributeError:
        return None


# ---- device, dtype and the engine -------------------------------------------------------------------------


def _info(ctx: RunContext, message: str) -> None:
    if ctx.is_main:
        print(f"zplan: {message}", file=sys.stderr, flush=True)


def runnable_settings(settings: EngineSettings, device: torch.device) -> tuple[EngineSettings, str | None]:
    """The settings this device can run, and a note when they differ from the plan's: without CUDA, fp32
    activations and weights (bf16/fp16 matmuls on a CPU are slow or missing); int8/int4 and fp8 weights stay (fp8
    on torch's CPU _scaled_mm, fp32 out)."""
    if device.type == "cuda" or settings.compute_dtype == "fp32":
        return settings, None
    weights = "fp32" if settings.weight_precision in ("bf16", "fp16") else settings.weight_precision
    note = (f"no CUDA device: running on the CPU in fp32 (the plan asked for {settings.compute_dtype} compute"
            f"{f' and {settings.weight_precision} weights' if weights != settings.weight_precision else ''})")
    return replace(settings, compute_dtype="fp32", weight_precision=weights), note


def engine_from_plan(plan: InferencePlan, model_file: str | Path | None, *, weights: str | Path | None = None,
                     seed: int = 0, nvme_dir: str | Path | None = None, settings: EngineSettings | None = None):
    """(engine, tokenizer, run context) for this process of one replica of `plan`.

    model_file: the model's .py file or Hugging Face folder (the plan's fingerprint must match it); weights: a
    .safetensors or torch.save state dict or a Hugging Face folder (None: a model folder's own weights when it has
    them, else `torch.manual_seed(seed); build_model()`, noise); nvme_dir: folder for the
    streamed weights' files (weight tier nvme); settings: the engine's choices, default the plan's."""
    from torch.distributed.device_mesh import init_device_mesh

    settings = settings or EngineSettings.from_plan(plan)
    ctx = init_distributed()
    check_inference_plan(plan, model_file, ctx.world_size, settings.tp)  # before any collective
    if settings.weight_tier == "nvme" and nvme_dir is None:
        raise SpecError("the plan streams the weights from NVMe: pass --nvme-path DIR, a folder on a local "
                        "NVMe drive with room for the model's weights.")
    settings, note = runnable_settings(settings, ctx.device)
    if note:
        _info(ctx, note)

    loaded = load_model_file(model_file)
    model = build_model(loaded.build_model, seed, "cpu")  # the whole model on every rank; the engine shards it
    if weights is None and model_file is not None and _has_folder_weights(Path(model_file)):
        weights = model_file  # a Hugging Face folder with its weights: those
        _info(ctx, f"no --weights given: reading the weights of the Hugging Face folder {model_file}")
    if weights is not None:
        load_weights(model, weights)
    else:
        _info(ctx, f"warning: no --weights given: the model has its random initialisation (seed {seed}), so the "
                   "text will be noise. Pass --weights PATH (a .safetensors file or a Hugging Face folder from "
                   "`zplan export`, or train.py --save-weights' file).")
    model.eval()

    tp_mesh = init_device_mesh(ctx.device.type, (settings.tp,), mesh_dim_names=("tp",)) if settings.tp > 1 else None
    engine = InferenceEngine.from_model(
        model, plan.model, compute_dtype=COMPUTE_DTYPES[settings.compute_dtype], device=ctx.device,
        max_batch=settings.max_batch, max_seq_len=settings.max_seq_len, weight_precision=settings.weight_precision,
        group_size=settings.group_size, weight_tier=settings.weight_tier,
        nvme_dir=Path(nvme_dir) if nvme_dir is not None else None, prefetch_layers=settings.prefetch_layers,
        tp_mesh=tp_mesh)
    # a Hugging Face folder's own tokenizer when it has one, else the byte tokenizer
    return engine, load_tokenizer(model_file, engine.vocab_size), ctx


def _has_folder_weights(path: Path) -> bool:
    """A Hugging Face folder (the model given as one) holding weights files."""
    return path.is_dir() and ((path / INDEX_FILE).is_file() or (path / SINGLE_FILE).is_file())
