"""Mixture-of-experts models traced on meta: parameters and training FLOPs per token against hand counts from the
published configurations, and the experts found in each transformers MoE family."""

from pathlib import Path

import pytest
import torch

import zplan.examples
from zplan.model.experts import find_expert_layers
from zplan.model_input import trace_module

transformers = pytest.importorskip("transformers")

S = 4096  # tokens per sample the FLOPs are counted at
EXAMPLES = Path(zplan.examples.__file__).parent


def build(config):
    config.use_cache = False
    attention = "eager" if config.model_type == "gpt_oss" else "sdpa"  # GPT-OSS has no sdpa path (attention sinks)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)


def trace(model, seq_len=S):
    with torch.device("meta"):
        ids = torch.zeros(1, seq_len, dtype=torch.long)
    return trace_module(model, ids, seq_len, "bf16")[1]


# Published configurations (the models' config.json on the Hugging Face hub), as transformers' config classes.
def mixtral_8x7b():
    return transformers.MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                      num_experts_per_tok=2)


def qwen3_30b_a3b():
    return transformers.Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                       moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                       num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                       decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)


def deepseek_v3():
    return transformers.DeepseekV3Config(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                                         moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                                         num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                                         num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536,
                                         kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                         v_head_dim=128, n_group=8, topk_group=4)


def hand_count(c, s):
    """(total parameters, active parameters, training FLOPs per token) written out from the configuration alone:
    every weight matrix read once per token (2 FLOPs a multiply-add; routed experts k of E, shared experts and dense
    MLPs whole), the attention core QK^T + AV over a causal square (2*s*heads*(d_qk + d_v) per token, halved), the
    logits; training = 3x forward (backward twice the forward). Norms and biases: parameters only."""
    h, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    heads = c.num_attention_heads
    if hasattr(c, "kv_lora_rank"):  # DeepSeek-V3's multi-head latent attention
        d_qk, d_v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        attention = (h * c.q_lora_rank + c.q_lora_rank * heads * d_qk + h * (c.kv_lora_rank + c.qk_rope_head_dim)
                     + c.kv_lora_rank * heads * (c.qk_nope_head_dim + d_v) + heads * d_v * h)
        attention_norms = c.q_lora_rank + c.kv_lora_rank
    else:
        d = getattr(c, "head_dim", None) or h // heads
        d_qk = d_v = d
        kv = c.num_key_value_heads
        attention = h * heads * d + 2 * h * kv * d + heads * d * h
        attention_norms = 2 * d if c.model_type == "qwen3_moe" else 0  # q_norm, k_norm
    experts = getattr(c, "num_local_experts", None) or getattr(c, "n_routed_experts", None) or c.num_experts
    expert_width = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    shared = getattr(c, "n_shared_experts", 0) or 0
    dense_layers = getattr(c, "first_k_dense_replace", 0) or 0
    expert = 3 * h * expert_width  # gate, up, down
    router = h * experts
    moe_layer_total = router + experts * expert + shared * expert
    moe_layer_active = router + c.num_experts_per_tok * expert + shared * expert
    dense_layer = 3 * h * c.intermediate_size
    norms = 2 * h + attention_norms
    layer_common = attention + norms
    moe_layers = layers - dense_layers
    embeddings = vocab * h * (1 if c.tie_word_embeddings else 2)
    total = layers * layer_common + dense_layers * dense_layer + moe_layers * moe_layer_total + embeddings + h
    active = total - moe_layers * (moe_layer_total - moe_layer_active)
    core = 2 * s * heads * (d_qk + d_v) / 2  # per token per layer: QK^T and AV, causal half
    forward = 2 * (layers * attention + dense_layers * dense_layer + moe_layers * moe_layer_active + vocab * h) \
        + layers * core
    return total, active, 3 * forward


@pytest.mark.parametrize("make", [mixtral_8x7b, qwen3_30b_a3b, deepseek_v3])
def test_total_active_and_training_flops_match_hand_counts(make):
    config = make()
    summary = trace(build(config))
    total, active, training_per_token = hand_count(config, S)
    assert summary.params == total  # the traced model holds exactly the weights the configuration describes
    assert summary.experts is not None and summary.experts.active_params == active
    traced = 3 * summary.fwd_flops_per_sample / S  # backward = 2x forward in the cost model
    assert traced == pytest.approx(training_per_token, rel=0.03)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "n_routed_experts", None) \
        or config.num_experts
    assert (summary.experts.num_experts, summary.experts.top_k) == (experts, config.num_experts_per_tok)
    assert summary.experts.moe_blocks == config.num_hidden_layers - (getattr(config, "first_k_dense_replace", 0) or 0)


def test_mixtral_figures_the_report_prints():
    """Mixtral-8x7B: 46.7B parameters of which 12.9B active (Mistral AI's announcement), about 80 GFLOP of training a
    token at 4k (the hand count above), the expert width 14336 as its FFN, and every block's experts costed."""
    summary = trace(build(mixtral_8x7b()))
    assert summary.params / 1e9 == pytest.approx(46.70, abs=0.01)
    assert summary.experts.active_params / 1e9 == pytest.approx(12.88, abs=0.01)
    assert summary.ffn_hidden == 14336 and summary.experts.ffn_hidden == 14336
    blocks = [u for u in summary.layers if u.kind == "block"]
    assert all(u.expert_params == 8 * 3 * 4096 * 14336 for u in blocks)
    assert all(u.expert_fwd_flops == 2 * S * 2 * 3 * 4096 * 14336 for u in blocks)


TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("name, config", [
    ("mixtral", lambda: transformers.MixtralConfig(**TINY, intermediate_size=96, num_local_experts=4,
                                                   num_experts_per_tok=2)),
    ("qwen2_moe", lambda: transformers.Qwen2MoeConfig(**TINY, intermediate_size=96, moe_intermediate_size=48,
                                                      shared_expert_intermediate_size=80, num_experts=4,
                                                      num_experts_per_tok=2)),
    ("olmoe", lambda: transformers.OlmoeConfig(**{**TINY, "num_key_value_heads": 4}, intermediate_size=96,
                                               num_experts=4, num_experts_per_tok=2)),
    ("gpt_oss", lambda: transformers.GptOssConfig(**TINY, intermediate_size=96, num_local_experts=4,
                                                  num_experts_per_tok=2, head_dim=16)),
])
def test_each_family_finds_its_experts_router_and_width(name, config):
    model = build(config())
    layers = find_expert_layers(model)
    assert [layer.path for layer in layers] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    first = layers[0]
    assert (first.num_experts, first.top_k, first.hidden) == (4, 2, 64)
    assert first.router in (f"model.layers.0.mlp.{n}" for n in ("gate", "router"))
    assert first.ffn_hidden == (48 if name == "qwen2_moe" else 96)
    summary = trace(model, 32)
    blocks = [u for u in summary.layers if u.kind == "block"]
    per_token = 2 * 2 * first.matrix_params  # k = 2 experts a token, 2 FLOPs a multiply-add
    assert all(u.expert_fwd_flops == 32 * per_token for u in blocks)


def test_stacked_parameters_without_a_router_or_routing_call_are_not_routed_experts():
    """Stacked (E, ...) parameters without a router beside them, or called without the routing (transformers' Llama 4
    runs every expert on every token), are traced as the model computes them: densely."""
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Parameter(torch.empty(4, 16, 8))
            self.down = torch.nn.Parameter(torch.empty(4, 8, 16))

        def forward(self, hidden, index, weights):
            return hidden

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Experts()

    assert find_expert_layers(torch.nn.Sequential(Block())) == []
    llama4 = build(transformers.Llama4TextConfig(**TINY, intermediate_size=96, intermediate_size_mlp=128,
                                                 num_local_experts=4, num_experts_per_tok=1, head_dim=16))
    assert find_expert_layers(llama4) == []
    summary = trace(llama4, 32)
    assert summary.experts is None and summary.params == sum(p.numel() for p in llama4.parameters())


def test_the_plain_example_traces_as_the_mixtral_it_copies():
    """examples/moe.py at its defaults has Mixtral-8x7B's shapes: the same parameters, active parameters and FLOPs
    as the hand count from Mixtral's configuration (its experts are found by their shapes, not by transformers)."""
    from zplan.model_input import trace_model_file

    summary = trace_model_file(EXAMPLES / "moe.py", S, "bf16")[1]
    total, active, training_per_token = hand_count(mixtral_8x7b(), S)
    assert (summary.params, summary.experts.active_params) == (total, active)
    assert 3 * summary.fwd_flops_per_sample / S == pytest.approx(training_per_token, rel=0.03)
