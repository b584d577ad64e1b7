"""Training starts from a Hugging Face folder's weights under tensor parallel, pipeline parallel, ZeRO-3 and ZeRO-1
with bf16 (2 gloo processes each, one launch for all).

A tiny Llama (random weights of its own seed, not the run's) is saved with save_pretrained as sharded safetensors
(model.safetensors.index.json), compiled from the folder itself (`zplan compile FOLDER`), and each train.py runs one
step with its default --init-from (the folder's weights, recorded in plan.json). The step-0 loss must equal
transformers' own loss of from_pretrained(FOLDER) on the same batch (fp32, 1e-5), and the saved weights
(--save-weights: fp32, the masters under bf16) the file's values after one step of a learning rate of 1e-9 (1e-6).
Then a zplan checkpoint of the tp 2 run starts a ZeRO-3 run (two more launches of train.py itself).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import Ranks, read_log
from zplan.runtime.training.data import synthetic_token_batch
from zplan.schemas import Pins

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

WORLD, GLOBAL_BATCH, SEQ_LEN, VOCAB, SEED = 2, 8, 32, 128, 7
LR = 1e-9  # the weights after one step are the loaded ones to ~1e-9
PLANS = {"tp2": (Pins(tp=2), "fp32"), "pp2": (Pins(pp=2), "fp32"), "zero3": (Pins(zero=3, dp=2), "fp32"),
         "zero1-bf16": (Pins(zero=1, dp=2), "bf16")}
WORKER = Path(__file__).with_name("hf_parallel_worker.py")


def save_llama(folder: Path) -> Path:
    """A tiny Llama with weights of seed 123, saved as 20 KB safetensors shards with their index."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(123)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.0, use_cache=False)
    AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(
        folder, safe_serialization=True, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def file_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for shard in sorted(folder.glob("*.safetensors")) for k, v in load_file(shard).items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(folder, {plan name: its out folder}) after one launch of the worker over every plan."""
    from zplan.api import compile_plan, prepare, write_outputs

    root = tmp_path_factory.mktemp("init_from")
    folder = save_llama(root / "llama")
    outs = {}
    for name, (pins, precision) in PLANS.items():
        plan = compile_plan(prepare(str(folder), WORLD, "cpu-local", GLOBAL_BATCH, SEQ_LEN, precision, pins))
        assert plan.fingerprint.init_from == "model.safetensors.index.json"
        outs[name] = root / name
        write_outputs(plan, outs[name], str(folder))
    ranks = Ranks([str(WORKER), "--steps", "1", "--seed", str(SEED), "--lr", str(LR), *map(str, outs.values())],
                  WORLD, root / "logs")
    output = ranks.wait_ok()
    assert "weights from" in output, output[-4000:]
    return folder, outs


def transformers_loss(folder: Path) -> float:
    """transformers' loss of the saved model on train.py's first global batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32)
    tokens = synthetic_token_batch(VOCAB, SEQ_LEN, GLOBAL_BATCH, SEED, 0)  # (B, T), train.py's step 0
    with torch.no_grad():
        return model(tokens, labels=tokens).loss.item()


@pytest.mark.parametrize("name", [n for n in PLANS if PLANS[n][1] == "fp32"])
def test_step0_loss_equals_transformers(runs, name):
    folder, outs = runs
    loss = read_log(outs[name] / "log.jsonl")[0]["loss"]
    assert abs(loss - transformers_loss(folder)) < 1e-5, (name, loss)


@pytest.mark.parametrize("name", list(PLANS))
def test_weights_are_the_files(runs, name):
    """Every rank read its own slices (tp's columns and rows, pp's stages, ZeRO-3's shards) and, under bf16, the
    fp32 masters hold the file's values, not their bf16 rounding (which differs by up to ~4e-3 here)."""
    folder, outs = runs
    saved = torch.load(outs[name] / "weights.pt", map_location="cpu")
    expected = file_weights(folder)
    assert set(saved) == set(expected)
    worst = max((saved[k].float() - v.float()).abs().max().item() for k, v in expected.items())
    assert worst < 1e-6, (name, worst)


def test_from_a_zplan_checkpoint_of_another_layout(runs, tmp_path):
    """--init-from step-N: the weights a tp 2 run saved, read under ZeRO-3 (DCP reshards them; the optimizer states
    and the step are not loaded): its step-0 loss is transformers' loss of those weights."""
    from transformers import AutoModelForCausalLM

    folder, outs = runs
    checkpoints, weights, log = tmp_path / "ckpt", tmp_path / "w.pt", tmp_path / "log.jsonl"
    Ranks([str(outs["tp2"] / "train.py"), "--steps", "1", "--seed", str(SEED), "--lr", "1e-2", "--checkpoint-dir",
           str(checkpoints), "--save-weights", str(weights)], WORLD, tmp_path / "logs-tp2").wait_ok()
    output = Ranks([str(outs["zero3"] / "train.py"), "--steps", "1", "--seed", str(SEED), "--init-from",
                    str(checkpoints / "step-000001"), "--log-json", str(log)], WORLD, tmp_path / "logs-z3").wait_ok()
    assert "optimizer states and step not loaded" in output
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32)
    model.load_state_dict(torch.load(weights, map_location="cpu"))
    tokens = synthetic_token_batch(VOCAB, SEQ_LEN, GLOBAL_BATCH, SEED, 0)
    with torch.no_grad():
        expected = model(tokens, labels=tokens).loss.item()
    assert abs(read_log(log)[0]["loss"] - expected) < 1e-5
