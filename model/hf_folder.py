"""A Hugging Face checkpoint folder (config.json, the weights beside it) as a model: what `zplan compile FOLDER`
traces and train.py builds, with no model file to write.

    folder = read_hf_folder(path)      # ModelLoadError when the folder is not a Hugging Face checkpoint
    folder.build_model()               # AutoModelForCausalLM.from_config(config.json), fp32, sdpa, use_cache=False
    weights_in_folder(path)            # 'model.safetensors.index.json', 'model.safetensors' or None

The model is built from its config alone (model.model_file calls build_model under the meta device), so its
module tree and state-dict names are those of the weights files; train.py then reads the weights into the
parallelized model (runtime.checkpoint.pretrained). The plan's fingerprint of a folder is the SHA-256 of its
config.json (source_sha256): the architecture the plan was made for, not the values of the weights.
"""

from __future__ import annotations

import copy
import hashlib
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from zplan.errors import ModelLoadError
from zplan.safe_files import UnreadableFileError, read_json_capped

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"  # sharded weights: {"weight_map": {tensor name: shard file}}
SINGLE_FILE = "model.safetensors"
CONFIG_CAP_BYTES = 16 << 20  # a config.json is a few KiB
MAX_DEFAULT_SEQ_LEN = 2048  # SEQ_LEN of a folder: max_position_embeddings when no longer than this


def is_hf_folder(path: str | Path) -> bool:
    """A folder with a config.json (what save_pretrained writes)."""
    return Path(path).is_dir() and (Path(path) / CONFIG_FILE).is_file()


def weights_in_folder(path: str | Path) -> str | None:
    """The weights file of a Hugging Face folder, relative to it: the index of sharded weights, else the single
    model.safetensors; None when it holds neither (a config alone: training starts from the initialisation)."""
    for name in (INDEX_FILE, SINGLE_FILE):
        if (Path(path) / name).is_file():
            return name
    return None


def source_sha256(path: str | Path) -> str:
    """SHA-256 (hex) of what a plan is made for: a model file's bytes, or a Hugging Face folder's config.json."""
    path = Path(path)
    return hashlib.sha256((path / CONFIG_FILE if path.is_dir() else path).read_bytes()).hexdigest()


@dataclass
class HfFolder:
    """A Hugging Face folder read as a model: its config (as a dict) and how to build the model from it."""

    path: Path
    sha256: str  # of config.json
    config: dict
    build_model: Callable[[], nn.Module]
    module: types.ModuleType  # stands for a model file's module: build_model and CONFIG
    vocab_size: int | None
    seq_len: int | None


def read_hf_folder(path: str | Path) -> HfFolder:
    """The model of the Hugging Face folder `path`: config.json checked, the model class known to transformers."""
    folder = Path(path)
    if not (folder / CONFIG_FILE).is_file():
        raise ModelLoadError(
            f"{folder} is a folder without {CONFIG_FILE}, not a Hugging Face checkpoint: pass a folder written by "
            "save_pretrained (config.json and model.safetensors or model.safetensors.index.json beside it), or a "
            "model file (.py) that defines build_model()")
    config_path = folder / CONFIG_FILE
    try:
        config, data = read_json_capped(config_path, CONFIG_CAP_BYTES, "the Hugging Face config")
    except UnreadableFileError as error:
        raise ModelLoadError(f"{config_path} cannot be read as JSON ({error}): put back the config.json "
                             "save_pretrained wrote") from error
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelLoadError(f"{config_path} has no \"model_type\": it is not a transformers config; put back the "
                             "config.json save_pretrained wrote")
    hf_config = _transformers_config(config_path)
    vocab = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else None
    positions = config.get("max_position_embeddings")
    seq_len = positions if isinstance(positions, int) and 0 < positions <= MAX_DEFAULT_SEQ_LEN else None

    def build_model() -> nn.Module:
        # transformers: an optional dependency, needed only for a Hugging Face folder
        from transformers import AutoModelForCausalLM

        # fp32 parameters whatever the config's dtype: the plan's precision decides what the run computes in;
        # torch's fused attention where the class has it, else its own (Gemma-2 and GPT-OSS have no sdpa path)
        try:
            return AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), attn_implementation="sdpa",
                                                    dtype=torch.float32)
        except ValueError:
            return AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), attn_implementation="eager",
                                                    dtype=torch.float32)

    sha256 = hashlib.sha256(data).hexdigest()
    module = types.ModuleType(f"zplan_hf_folder_{sha256[:12]}", f"the Hugging Face model of {folder}")
    module.build_model, module.CONFIG = build_model, config
    return HfFolder(folder, sha256, config, build_model, module, vocab, seq_len)


def _transformers_config(config_path: Path):
    """transformers' config of config.json (read from this file alone, nothing downloaded), set up for training."""
    try:
        # transformers: an optional dependency, needed only for a Hugging Face folder
        from transformers import AutoConfig
    except ImportError as error:
        raise ModelLoadError(f"{config_path.parent} is a Hugging Face folder, and transformers is not installed: "
                             "pip install transformers") from error
    try:
        config = AutoConfig.from_pretrained(str(config_path.parent), local_files_only=True)
    except Exception as error:  # an unknown model_type, a config that needs remote code, a bad value
        line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ModelLoadError(f"transformers cannot read {config_path} ({type(error).__name__}: {line}): use a "
                             "config.json of a model class this transformers has, or write a model file") from error
    config.use_cache = False  # training: no generation cache
    return config
