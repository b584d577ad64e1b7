"""`zplan export CKPT --to DIR --hf`: a Hugging Face model folder from a checkpoint, which `from_pretrained` loads.

    DIR/config.json                         the source folder's, its dtype set to the exported one
    DIR/generation_config.json              copied when the source folder has one
    DIR/tokenizer.json, tokenizer_config.json, special_tokens_map.json, vocab/merges, ...   copied (those present)
    DIR/model-00001-of-0000N.safetensors    the weights in shards of at most max_shard_bytes (a bigger tensor alone)
    DIR/model.safetensors.index.json        {"metadata": {"total_size", "total_parameters"}, "weight_map": {...}}

(one shard: DIR/model.safetensors and no index, as transformers' save_pretrained writes them). The source folder is
--config-from, else the folder the run was compiled from (the model_ref of the checkpoint's train_state.json, when it
is a folder with a config.json). The names written are those transformers' model of that config.json has in its
state dict, built on the meta device (no memory): each must be in the checkpoint with its shape, the checkpoint may
hold nothing else, and a tied weight (lm_head.weight under tie_word_embeddings) is written once, under the name
save_pretrained keeps. The folder is rendered beside DIR and renamed into place: a failure leaves DIR as it was.
The weights stream from the checkpoint a chunk at a time (zplan/export.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from zplan.errors import ExportError
from zplan.export import (
    DEFAULT_MAX_CHUNK_BYTES,
    DTYPES,
    Checkpoint,
    open_checkpoint,
    stream_tensors,
    write_shard,
)
from zplan.model.safetensors_format import nbytes
from zplan.runtime.checkpoint.save import read_train_state
from zplan.safe_files import UnsafeFileError, read_capped

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# What transformers' save_pretrained writes beside the weights (tokenizer, generation and chat settings), copied
# from the source folder when present: tokenization_utils_base.py and the slow tokenizers' vocab_files_names.
COPIED_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
)
MAX_COPIED_BYTES = 1 << 30  # a tokenizer.json of a 256k vocabulary is about 35 MB
MAX_CONFIG_BYTES = 16 << 20
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' max_shard_size default, "5GB"
CONFIG_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
              "GIB": 2**30, "TIB": 2**40}  # as transformers' convert_file_size_to_int reads them


def parse_size(text: str) -> int:
    """Bytes of a size such as '5GB', '500MB', '2GiB' or '1000000' (transformers' units: KB = 1000 bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not match or match.group(2) not in SIZE_UNITS or float(match.group(1)) * SIZE_UNITS[match.group(2)] < 1:
        raise ExportError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB, 2GiB or a number of bytes")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2)])


def source_folder(ckpt: Checkpoint, config_from: str | Path | None) -> Path:
    """The Hugging Face folder whose config.json and tokenizer files go with the weights: `config_from`, else the
    folder the run was compiled from (train_state.json's model_ref). ExportError naming --config-from otherwise."""
    if config_from is not None:
        folder = Path(config_from)
        if not (folder / CONFIG_FILE).is_file():
            raise ExportError(f"--config-from {folder}: {folder / CONFIG_FILE} does not exist: pass the Hugging Face "
                              "folder the model was built from (save_pretrained writes its config.json)")
        return folder
    model_ref = read_train_state(ckpt.folder).get("model_ref")
    if isinstance(model_ref, str) and model_ref and (Path(model_ref) / CONFIG_FILE).is_file():
        return Path(model_ref)
    compiled_from = f" (the run was compiled from {model_ref}, not a Hugging Face folder)" if model_ref else ""
    raise ExportError(f"--hf needs the model's config.json and tokenizer{compiled_from}: pass --config-from HF_DIR, "
                      f"the Hugging Face folder the model was built from (as save_pretrained writes it)")


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(read_capped(path, MAX_CONFIG_BYTES, what))
    except (OSError, UnsafeFileError, ValueError) as error:
        raise ExportError(f"cannot read {what} {path}: {getattr(error, 'strerror', None) or error}") from error
    if not isinstance(data, dict):
        raise ExportError(f"{what} {path} is not a JSON object: pass a folder save_pretrained wrote")
    return data


def expected_tensors(source: Path) -> tuple[dict[str, torch.Size], dict[str, list[str]]]:
    """({name: shape} that transformers' model of source/config.json keeps in a saved folder, {kept name: every name
    of that tensor, tied ones included}), from the model built on the meta device."""
    import transformers  # optional dependency: only --hf needs it

    config_path = source / CONFIG_FILE
    try:
        config = transformers.AutoConfig.from_pretrained(source)
        architectures = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, architectures[0], None) if architectures else None
        with torch.device("meta"):
            model = (model_class._from_config(config) if model_class is not None
                     else transformers.AutoModelForCausalLM.from_config(config))
    except Exception as error:  # transformers raises ValueError, KeyError, OSError... for a config it cannot build
        raise ExportError(f"transformers cannot build a model from {config_path}: {type(error).__name__}: "
                          f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}") from error
    tied_targets = set(getattr(model, "_tied_weights_keys", None) or ())  # {target: source}: save_pretrained drops
    groups: dict[int, tuple[torch.Tensor, list[str]]] = {}  # tied names share one tensor
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), (tensor, []))[1].append(name)
    shapes, aliases = {}, {}
    for tensor, names in groups.values():
        kept = next((name for name in names if name not in tied_targets), names[0])
        shapes[kept], aliases[kept] = tensor.shape, names
    return shapes, aliases


def match_names(ckpt: Checkpoint, shapes: dict[str, torch.Size], aliases: dict[str, list[str]],
                config_path: Path) -> dict[str, str]:
    """{name to write: checkpoint name holding it}; ExportError naming what is missing, shaped otherwise or extra."""
    chosen, missing, wrong = {}, [], []
    for kept, names in aliases.items():
        found = next((name for name in names if name in ckpt.tensors), None)
        if found is None:
            missing.append(kept)
        elif tuple(ckpt.tensors[found][1]) != tuple(shapes[kept]):
            wrong.append(f"{found} {tuple(ckpt.tensors[found][1])} (the config's: {tuple(shapes[kept])})")
        else:
            chosen[kept] = found
    known = {name for names in aliases.values() for name in names}
    extra = sorted(name for name in ckpt.tensors if name not in known)
    problems = [f"{what}: {', '.join(items[:4])}" + (f" and {len(items) - 4} more" if len(items) > 4 else "")
                for what, items in (("missing from the checkpoint", missing), ("shaped otherwise", wrong),
                                    ("not in the config's model", extra)) if items]
    if problems:
        raise ExportError(f"checkpoint {ckpt.folder} does not match the model of {config_path} "
                          f"({'; '.join(problems)}): pass --config-from the Hugging Face folder the model was built "
                          "from")
    return chosen


def check_tied(ckpt: Checkpoint, aliases: dict[str, list[str]], config_path: Path, max_chunk_bytes: int) -> None:
    """ExportError when the config ties tensors (one kept name, several names) that the checkpoint holds with other
    values: the run trained them untied, and writing one of them would lose the other."""
    for names in aliases.values():
        present = [name for name in names if name in ckpt.tensors]
        if len(present) < 2:
            continue
        first, *others = (tensor for _, tensor in stream_tensors(ckpt, present, max_chunk_bytes=max_chunk_bytes))
        if not all(torch.equal(first, other) for other in others):
            raise ExportError(f"{config_path} ties {', '.join(present)} (one tensor), but checkpoint {ckpt.folder} "
                              f"holds them with different values (trained untied): pass --config-from the folder "
                              "the model was built from (tie_word_embeddings false)")


def plan_shards(names: list[str], sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """`names` in order, cut into shards of at most max_shard_bytes (a bigger tensor makes a shard alone)."""
    shards: list[list[str]] = [[]]
    total = 0
    for name in names:
        if shards[-1] and total + sizes[name] > max_shard_bytes:
            shards.append([])
            total = 0
        shards[-1].append(name)
        total += sizes[name]
    return shards


def _export_dtype(dtype: str | None, config: dict, config_path: Path) -> torch.dtype:
    """--dtype, else the config's (transformers 5 writes 'dtype', earlier ones 'torch_dtype'), else fp32."""
    if dtype is not None:
        if dtype not in DTYPES:
            raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    named = config.get("dtype", config.get("torch_dtype"))
    by_name = {name: torch_dtype for torch_dtype, name in CONFIG_DTYPE_NAMES.items()}
    if named is not None and named not in by_name and named != "auto":
        raise ExportError(f"{config_path} says dtype {named!r}: pass --dtype {' | '.join(DTYPES)}")
    return by_name.get(named, torch.float32)


def _check_target(out_dir: Path, force: bool) -> None:
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise ExportError(f"--to {out_dir} is {'a link' if out_dir.is_symlink() else 'a file'}: --hf writes a "
                          "folder; give a new or empty folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ExportError(f"--to {out_dir} is a folder that is not empty: give a new or empty folder, or --force to "
                          "replace it (everything in it is removed)")


def _swap_in(tmp: Path, out_dir: Path) -> None:
    """The rendered folder `tmp` becomes `out_dir`; an existing `out_dir` is moved aside first and removed last."""
    aside = None
    if out_dir.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
        os.replace(out_dir, aside / out_dir.name)
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if aside is not None:
            os.replace(aside / out_dir.name, out_dir)
        raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def _render(tmp: Path, ckpt: Checkpoint, source: Path, config: dict, chosen: dict[str, str], dtype: torch.dtype,
            max_shard_bytes: int, max_chunk_bytes: int) -> None:
    names = list(chosen)
    sizes = {name: nbytes(dtype if ckpt.tensors[chosen[name]][0].is_floating_point else ckpt.tensors[chosen[name]][0],
                          ckpt.tensors[chosen[name]][1]) for name in names}
    shards = plan_shards(names, sizes, max_shard_bytes)
    files = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, shard in zip(files, shards, strict=True):
        write_shard(tmp / file, ckpt, [chosen[name] for name in shard], max_chunk_bytes=max_chunk_bytes,
                    dtype=dtype, file_names=shard)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values()),
                              "total_parameters": sum(ckpt.tensors[chosen[n]][1].numel() for n in names)},
                 "weight_map": {name: file for file, shard in zip(files, shards, strict=True) for name in shard}}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    dtype_key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
    (tmp / CONFIG_FILE).write_text(json.dumps({**config, dtype_key: CONFIG_DTYPE_NAMES[dtype]}, indent=2,
                                              sort_keys=True) + "\n")
    for name in COPIED_FILES:
        if (source / name).exists():
            try:
                (tmp / name).write_bytes(read_capped(source / name, MAX_COPIED_BYTES, "the tokenizer file"))
            except UnsafeFileError as error:
                raise ExportError(f"cannot copy {source / name}: {error}") from error


def export_hf_folder(ckpt_dir: Path, out_dir: Path, *, config_from: str | Path | None = None,
                     dtype: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, force: bool = False,
                     allow_unverified: bool = False, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> Path:
    """Write checkpoint `ckpt_dir` as the Hugging Face folder `out_dir` (see the module's docstring); return it.

    dtype: fp32 | bf16 | fp16 for the floating-point tensors (default the config's, else fp32); force: replace a
    non-empty `out_dir`. ExportError / CheckpointError (ZplanError) before anything is written when the source
    folder, the names and shapes, or `out_dir` do not do; `out_dir` is untouched when writing fails."""
    out_dir = Path(out_dir).absolute()
    _check_target(out_dir, force)
    ckpt = open_checkpoint(ckpt_dir, allow_unverified=allow_unverified)
    source = source_folder(ckpt, config_from)
    config = _read_json(source / CONFIG_FILE, "the model config")
    export_dtype = _export_dtype(dtype, config, source / CONFIG_FILE)
    shapes, aliases = expected_tensors(source)
    chosen = match_names(ckpt, shapes, aliases, source / CONFIG_FILE)
    check_tied(ckpt, aliases, source / CONFIG_FILE, max_chunk_bytes)
    tmp = None
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
        _render(tmp, ckpt, source, config, chosen, export_dtype, max_shard_bytes, max_chunk_bytes)
        tmp.chmod(0o755)  # as mkdir makes a folder (mkdtemp's is private)
        _swap_in(tmp, out_dir)
    except OSError as error:
        raise ExportError(f"cannot write {out_dir}: {error.strerror or error}; it is unchanged") from error
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp)  # left only when the export failed
    return out_dir
