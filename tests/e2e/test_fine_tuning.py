"""End to end: the walk-through of docs/fine-tuning.md, command for command, on a tiny Hugging Face Llama folder
(config, weights and a trained tokenizer, as save_pretrained writes them): `zplan data prepare` -> `zplan compile
HF_FOLDER` -> launch/torchrun.sh on 2 gloo processes from the folder's weights, with validation, checkpoints, a JSON
log and TensorBoard -> a resume -> `zplan export --hf` -> transformers' from_pretrained and generate.

The references are independent of zplan: transformers' own loss on the first global batch (read from the token file
in the order runtime/data/packing.py documents), torch.distributed.checkpoint's own converter for the checkpoint's
weights, TensorBoard's event reader.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.test_export_hf import CORPUS, source_folder

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STEPS, MORE_STEPS = 8, 10


def zplan(*args: str, cwd: Path) -> str:
    """One walk-through command (the zplan CLI or the emitted launch script) in `cwd`; its output."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")  # launch/torchrun.sh runs `python`
    command = ["bash", *args] if args[0].endswith(".sh") else [str(BIN / "zplan"), *args]
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, (command, result.stdout[-3000:], result.stderr[-3000:])
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def walk(tmp_path_factory) -> dict:
    """Every command of the walk-through, run once in a fresh folder; what each printed."""
    here = tmp_path_factory.mktemp("fine-tuning")
    source_folder(here / "llama", tie=False)  # the "pretrained" folder: weights, config, tokenizer
    (here / "train.txt").write_text("\n".join(CORPUS) + "\n")  # a repetitive text: its loss can fall in a few steps
    (here / "val.txt").write_text("\n".join(reversed(CORPUS)) + "\n")
    printed = {
        "prepare": zplan("data", "prepare", "train.txt", "--tokenizer", "llama", "-o", "tokens.bin", cwd=here),
        "prepare-val": zplan("data", "prepare", "val.txt", "--tokenizer", "llama", "-o", "val.bin", cwd=here),
        "compile": zplan("compile", "llama", "--gpus", "2", "--cluster", "cpu-local", "--precision", "fp32",
                         "--global-batch", "8", "--seq", "32", "-o", "out", cwd=here),
        "train": zplan("out/launch/torchrun.sh", "--data", "tokens.bin", "--val-data", "val.bin", "--eval-every", "4",
                       "--eval-batches", "1", "--steps", str(STEPS), "--lr", "3e-3", "--checkpoint-dir", "ckpt",
                       "--checkpoint-every", "4", "--log-json", "log.jsonl", "--tensorboard", "tb", cwd=here),
    }
    printed["resume"] = zplan("out/launch/torchrun.sh", "--data", "tokens.bin", "--steps", str(MORE_STEPS), "--lr",
                              "3e-3", "--checkpoint-dir", "ckpt", "--resume", "--log-json", "log.jsonl", cwd=here)
    printed["export"] = zplan("export", "ckpt", "--to", "exported", "--hf", cwd=here)
    return {"dir": here, "printed": printed, "log": [json.loads(line) for line in
                                                      (here / "log.jsonl").read_text().splitlines()]}


def token_ids(path: Path) -> np.ndarray:
    """A token file read with numpy alone: ids back to back in the sidecar's dtype."""
    return np.fromfile(path, dtype=json.loads(Path(f"{path}.json").read_text())["dtype"]).astype(np.int64)


def global_batch(tokens: np.ndarray, seq_len: int, size: int, seed: int | None) -> torch.Tensor:
    """The first global batch in the order runtime/data/packing.py documents: sequences of seq_len tokens sharing one
    token (sequence i starts at i * (seq_len - 1)), shuffled by numpy's PCG64 seeded with (seed, epoch 0), or in file
    order (seed None: validation)."""
    count = (len(tokens) - 1) // (seq_len - 1)
    order = np.arange(count) if seed is None else np.random.Generator(np.random.PCG64([seed, 0])).permutation(count)
    return torch.from_numpy(np.stack([tokens[i * (seq_len - 1):i * (seq_len - 1) + seq_len] for i in order[:size]]))


def checkpoint_model(checkpoint: Path, config_folder: Path) -> torch.nn.Module:
    """transformers' model of the folder's config holding the checkpoint's weights, read by torch's own DCP
    converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoConfig, AutoModelForCausalLM

    whole = checkpoint.parent.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, whole)
    state = torch.load(whole, weights_only=False)["model"]
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_folder), attn_implementation="sdpa")
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.mark.slow
def test_step_one_loss_is_transformers_loss_on_the_pretrained_weights(walk):
    from transformers import AutoModelForCausalLM

    here = walk["dir"]
    plan = json.loads((here / "out" / "plan.json").read_text())
    assert plan["fingerprint"]["init_from"] == "model.safetensors" and plan["parallel"]["dp"] == 2
    assert "weights from" in walk["printed"]["train"] and "model.safetensors" in walk["printed"]["train"]
    batch = global_batch(token_ids(here / "tokens.bin"), plan["train"]["seq_len"], plan["train"]["global_batch"],
                         seed=0)  # train.py's default --seed
    pretrained = AutoModelForCausalLM.from_pretrained(here / "llama", attn_implementation="sdpa",
                                                      dtype=torch.float32).eval()
    with torch.no_grad():
        expected = pretrained(input_ids=batch, labels=batch).loss.item()
    assert walk["log"][0]["step"] == 1 and abs(walk["log"][0]["loss"] - expected) < 1e-5


@pytest.mark.slow
def test_loss_falls_validation_is_logged_and_tensorboard_has_the_log(walk):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = walk["log"]
    assert [entry["step"] for entry in log] == list(range(1, MORE_STEPS + 1))  # the resume went on after step 8
    losses = [entry["loss"] for entry in log]
    assert losses[STEPS - 1] < losses[0] - 0.5 and losses[-1] < losses[STEPS - 1]
    assert {entry["step"] for entry in log if "val_loss" in entry} == {4, 8}
    events = EventAccumulator(str(walk["dir"] / "tb"))
    events.Reload()
    logged = {event.step: event.value for event in events.Scalars("train/loss")}
    assert all(abs(logged[entry["step"]] - entry["loss"]) < 1e-6 for entry in log[:STEPS])
    assert sorted(event.step for event in events.Scalars("val/loss")) == [4, 8]

    # the last validation loss is transformers' loss, on the step-8 checkpoint's weights, of val.bin's first global
    # batch in file order
    here = walk["dir"]
    plan = json.loads((here / "out" / "plan.json").read_text())
    batch = global_batch(token_ids(here / "val.bin"), plan["train"]["seq_len"], plan["train"]["global_batch"],
                         seed=None)
    model = checkpoint_model(here / "ckpt" / f"step-{STEPS:06d}", here / "llama")
    with torch.no_grad():
        expected = model(input_ids=batch, labels=batch).loss.item()
    assert abs(log[STEPS - 1]["val_loss"] - expected) < 1e-5


@pytest.mark.slow
def test_resume_goes_on_from_the_newest_checkpoint(walk):
    here = walk["dir"]
    assert f"resumed from ckpt/step-{STEPS:06d}" in walk["printed"]["resume"]
    state = json.loads((here / "ckpt" / f"step-{MORE_STEPS:06d}" / "train_state.json").read_text())
    assert state["step"] == MORE_STEPS and state["data"]["sequences_consumed"] == MORE_STEPS * 8


@pytest.mark.slow
def test_exported_folder_loads_and_generates(walk):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    here = walk["dir"]
    exported, info = AutoModelForCausalLM.from_pretrained(here / "exported", output_loading_info=True,
                                                          attn_implementation="sdpa")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    reference = checkpoint_model(here / "ckpt" / f"step-{MORE_STEPS:06d}", here / "llama")  # export takes the newest
    ids = torch.randint(0, exported.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0,
                                   atol=1e-5)

    tokenizer = AutoTokenizer.from_pretrained(here / "exported")
    prompt = tokenizer("hello world,", return_tensors="pt")
    generated = exported.generate(**prompt, max_new_tokens=8, do_sample=False)
    width = prompt["input_ids"].shape[1]
    assert torch.equal(generated[:, :width], prompt["input_ids"]) and generated.shape[1] > width
    assert int(generated.min()) >= 0 and int(generated.max()) < exported.config.vocab_size
