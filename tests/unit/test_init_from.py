"""Starting from pretrained weights in one process: a Hugging Face folder compiled as the model, its weights read
into the model (the file's values, cast, ties and prefixes), slices read run by run, and bad inputs refused with one
message naming the file and the fix (runtime/checkpoint/pretrained.py, safetensors_read.py, model/hf_folder.py)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from zplan.errors import CheckpointError, ModelLoadError, ZplanError
from zplan.model.model_file import load_model_file
from zplan.runtime.checkpoint.pretrained import init_from_path, load_pretrained, open_pretrained
from zplan.runtime.checkpoint.safetensors_read import read_slice, weights_of

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

INDEX = "model.safetensors.index.json"


def llama_config(**changes):
    from transformers import LlamaConfig

    return LlamaConfig(**{**dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 use_cache=False), **changes})


def save_hf(folder: Path, config, seed: int = 123, **kwargs) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(
        folder, safe_serialization=True, **kwargs)
    return folder


def file_weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for shard in sorted(folder.glob("*.safetensors"))
            for k, v in safetensors_torch.load_file(shard).items()}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return save_hf(tmp_path_factory.mktemp("hf") / "llama", llama_config(), max_shard_size="20KB")


def loaded_model(folder: Path, source: Path | None = None) -> torch.nn.Module:
    """The folder's model built on the CPU from another seed, then --init-from `source` (default: its weights)."""
    model_file = load_model_file(folder)
    pretrained = open_pretrained(source or folder, model_file)
    torch.manual_seed(0)
    model = model_file.build("cpu")
    load_pretrained(pretrained, model, ctx=None)
    return model


def test_hf_folder_compiles_and_records_its_weights(sharded, tmp_path):
    from zplan.api import compile_plan, prepare, write_outputs
    from zplan.runtime.plan.check import check_plan
    from zplan.schemas import Pins

    plan = compile_plan(prepare(str(sharded), 1, "cpu-local", 8, 32, "fp32", Pins()))
    assert plan.fingerprint.init_from == INDEX
    assert plan.fingerprint.model_sha256 == hashlib.sha256((sharded / "config.json").read_bytes()).hexdigest()
    assert plan.model.name == "llama" and plan.model.vocab == 128
    check_plan(plan, sharded, 1)  # the folder is the model the plan was made for
    write_outputs(plan, tmp_path / "out", str(sharded))
    relative = os.path.relpath(sharded.resolve(), (tmp_path / "out").resolve())
    assert f'MODEL_FILE = "{relative}"' in (tmp_path / "out" / "train.py").read_text()  # the folder, from train.py
    assert init_from_path(None, plan.fingerprint.init_from, sharded) == sharded / INDEX
    assert init_from_path("none", plan.fingerprint.init_from, sharded) is None
    assert init_from_path("w.safetensors", None, sharded) == Path("w.safetensors")


def test_weights_equal_the_files_and_transformers_loss(sharded):
    from transformers import AutoModelForCausalLM

    model = loaded_model(sharded)
    expected = file_weights(sharded)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    reference = AutoModelForCausalLM.from_pretrained(sharded, attn_implementation="sdpa", dtype=torch.float32)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert abs(model(tokens, labels=tokens).loss.item() - reference(tokens, labels=tokens).loss.item()) < 1e-6


def test_single_file_without_prefix_in_bf16_is_cast(sharded, tmp_path):
    weights = {k.removeprefix("model."): v.bfloat16() for k, v in file_weights(sharded).items()}
    safetensors_torch.save_file(weights, tmp_path / "bare.safetensors")
    model = loaded_model(sharded, tmp_path / "bare.safetensors")
    for name, value in model.state_dict().items():
        if name.removeprefix("model.") in weights:
            assert value.dtype == torch.float32
            assert torch.equal(value, weights[name.removeprefix("model.")].float()), name


def test_tied_embedding_read_from_its_one_name(tmp_path):
    from transformers import GPT2Config

    folder = save_hf(tmp_path / "gpt2", GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                   use_cache=False))
    assert "lm_head.weight" not in weights_of(folder)  # save_pretrained writes a tied weight once
    model = loaded_model(folder)
    wte = file_weights(folder)["transformer.wte.weight"]
    assert torch.equal(model.lm_head.weight, wte) and model.lm_head.weight is model.transformer.wte.weight


def test_slices_read_run_by_run(tmp_path):
    full = torch.randn(6, 10)
    safetensors_torch.save_file({"w": full}, tmp_path / "w.safetensors")
    entry = weights_of(tmp_path / "w.safetensors")["w"]
    rows, cols = torch.tensor([4, 5, 0, 1]), torch.tensor([2, 3, 7, 9])
    assert torch.equal(read_slice(entry, "w", [rows, cols]), full[rows][:, cols])
    assert torch.equal(read_slice(entry, "w", [torch.arange(2, 4), torch.arange(10)]), full[2:4])


# ---- bad input: one message naming the file and the fix ---------------------------------------------------


def refused(folder: Path, source: Path) -> str:
    with pytest.raises(CheckpointError) as error:
        open_pretrained(source, load_model_file(folder))
    assert isinstance(error.value, ZplanError)
    return str(error.value)


def test_wrong_shapes_and_dtypes_are_listed(sharded, tmp_path):
    weights = file_weights(sharded)
    weights["model.norm.weight"] = torch.ones(32, dtype=torch.int64)
    weights["lm_head.weight"] = torch.zeros(128, 16)
    del weights["model.layers.0.mlp.up_proj.weight"]
    weights["model.extra.weight"] = torch.zeros(2)
    safetensors_torch.save_file(weights, tmp_path / "bad.safetensors")
    message = refused(sharded, tmp_path / "bad.safetensors")
    for part in ("bad.safetensors", "missing 1", "model.layers.0.mlp.up_proj.weight", "1 unexpected",
                 "model.extra.weight", "lm_head.weight [128, 16]", "model.norm.weight torch.int64",
                 "--init-from none"):
        assert part in message, (part, message)


def test_index_naming_a_missing_shard(sharded, tmp_path):
    folder = tmp_path / "copy"
    folder.mkdir()
    for path in sharded.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    shard = sorted(json.loads((folder / INDEX).read_text())["weight_map"].values())[0]
    (folder / shard).unlink()
    message = refused(sharded, folder)
    assert INDEX in message and shard in message and "copy every shard" in message


def test_not_a_hugging_face_folder(sharded, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    assert "holds neither" in refused(sharded, tmp_path)
    with pytest.raises(ModelLoadError, match="without config.json, not a Hugging Face checkpoint"):
        load_model_file(tmp_path)


def test_truncated_header(sharded, tmp_path):
    single = save_hf(tmp_path / "single", llama_config())
    data = (single / "model.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:100])
    message = refused(sharded, tmp_path / "cut.safetensors")
    assert "cut.safetensors" in message and "truncated header" in message
    (tmp_path / "short.safetensors").write_bytes(data[:5])
    assert "shorter than the 8-byte header length" in refused(sharded, tmp_path / "short.safetensors")
