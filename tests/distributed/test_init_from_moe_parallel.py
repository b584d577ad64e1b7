"""Training starts from a Hugging Face mixture of experts' own folder under expert parallel 2 (fp32, and bf16 with
ZeRO-1's fp32 masters) and ZeRO-3 (2 gloo processes each, one launch for all).

A tiny Mixtral and a tiny Qwen3-MoE (random weights of their own seed) are saved with save_pretrained, which writes
one tensor per expert (Mixtral's block_sparse_moe.experts.K.w1/w3/w2, Qwen3-MoE's mlp.experts.K.gate_proj/up_proj/
down_proj) where the model stacks them (mlp.experts.gate_up_proj (E, 2F, h), down_proj (E, h, F)); each is compiled
from the folder itself and each train.py runs one step with its default --init-from (the folder's weights, joined as
transformers joins them: runtime/checkpoint/expert_weights.py), each rank reading its experts' (ep) or its shards'
(ZeRO-3) pieces only. The step-0 loss must equal transformers' own loss of from_pretrained(FOLDER) on the same batch
(fp32, 1e-5), and the saved weights (--save-weights: fp32, the masters under bf16) from_pretrained's after one step
of a learning rate of 1e-9 (1e-6).
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
PLANS = {"ep2": ("mixtral", Pins(ep=2), "fp32"), "ep2-zero1-bf16": ("mixtral", Pins(ep=2, zero=1), "bf16"),
         "zero3": ("mixtral", Pins(zero=3, dp=2), "fp32"), "qwen3-ep2": ("qwen3_moe", Pins(ep=2), "fp32")}
WORKER = Path(__file__).with_name("hf_parallel_worker.py")


def save_moe(folder: Path, family: str) -> Path:
    """A tiny Mixtral or Qwen3-MoE of 4 experts with weights of seed 123, as save_pretrained writes it."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    sizes = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 num_experts_per_tok=2, max_position_embeddings=64, attention_dropout=0.0, use_cache=False)
    config = (MixtralConfig(**sizes, intermediate_size=48, num_local_experts=4) if family == "mixtral" else
              Qwen3MoeConfig(**sizes, moe_intermediate_size=24, num_experts=4, decoder_sparse_step=1,
                             mlp_only_layers=[]))
    torch.manual_seed(123)
    AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """({family: from_pretrained(its folder)}, {plan name: its out folder}) after one launch of the worker over every
    plan."""
    from transformers import AutoModelForCausalLM

    from zplan.api import compile_plan, prepare, write_outputs

    root = tmp_path_factory.mktemp("init_from_moe")
    folders = {family: save_moe(root / family, family) for family in {family for family, _, _ in PLANS.values()}}
    outs = {}
    for name, (family, pins, precision) in PLANS.items():
        folder = folders[family]
        plan = compile_plan(prepare(str(folder), WORLD, "cpu-local", GLOBAL_BATCH, SEQ_LEN, precision, pins))
        assert plan.fingerprint.init_from == "model.safetensors"
        assert plan.parallel.ep == (pins.ep or 1) and plan.parallel.zero_stage == (pins.zero or 0), name
        outs[name] = root / name
        write_outputs(plan, outs[name], str(folder))
    ranks = Ranks([str(WORKER), "--steps", "1", "--seed", str(SEED), "--lr", str(LR), *map(str, outs.values())],
                  WORLD, root / "logs")
    output = ranks.wait_ok()
    assert output.count("4 of them joined from per-expert tensors") == len(PLANS), output[-4000:]
    references = {family: AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32)
                  for family, folder in folders.items()}
    return references, outs


@pytest.mark.parametrize("name", [n for n in PLANS if PLANS[n][2] == "fp32"])
def test_step0_loss_equals_transformers(runs, name):
    references, outs = runs
    reference = references[PLANS[name][0]]
    tokens = synthetic_token_batch(VOCAB, SEQ_LEN, GLOBAL_BATCH, SEED, 0)  # (B, T), train.py's step 0
    with torch.no_grad():
        expected = reference(tokens, labels=tokens).loss.item()
    loss = read_log(outs[name] / "log.jsonl")[0]["loss"]
    assert abs(loss - expected) < 1e-5, (name, loss, expected)


@pytest.mark.parametrize("name", list(PLANS))
def test_weights_are_from_pretrained(runs, name):
    """Every rank read its own experts' pieces (ep: E/2 experts each; ZeRO-3: its shards' rows) and, under bf16,
    the fp32 masters hold the file's values, not their bf16 rounding."""
    references, outs = runs
    saved = torch.load(outs[name] / "weights.pt", map_location="cpu")
    expected = references[PLANS[name][0]].state_dict()
    assert set(saved) == set(expected)
    worst = max((saved[k].float() - v.float()).abs().max().item() for k, v in expected.items())
    assert worst < 1e-6, (name, worst)
