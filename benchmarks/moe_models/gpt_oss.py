"""GPT-OSS's architecture from transformers' GptOssConfig, for zplan to trace on the meta device: attention with
sinks (fused, as Megatron-Core runs it: fused_attention_with_sinks) alternating a 128-token sliding window with full
attention, head_dim
64, every layer a MoE layer of clamped-SwiGLU experts with biases. The defaults are GPT-OSS-120B's public config.json
(36 layers, hidden 2880, 64 heads, 8 KV heads, 128 experts, top-4, expert FFN 2880, vocabulary 201088);
benchmarks/reference_runs.py passes each MoE row's sizes."""

import torch
import transformers

SEQ_LEN = 4096
ATTENTION = "fused_with_sinks"


def fused_attention_with_sinks(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention core as Megatron-Core runs GPT-OSS, one fused kernel (Transformer Engine's cuDNN attention, which
    takes the sinks): traced as torch's SDPA, causal, its K/V heads grouped. transformers' own path for GPT-OSS is eager
    (no sdpa path: the sinks), which would price the (s, s) scores through HBM. Not priced: each head's sink (one more
    logit in every softmax denominator) and the sliding layers' shorter window (priced as full causal layers)."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register(ATTENTION, fused_attention_with_sinks)


def build_model(layers=36, dense_layers=0, hidden=2880, heads=64, kv_heads=8, dense_ffn=None, routed_experts=128,
                shared_experts=0, top_k=4, expert_ffn=2880, vocab=201088, head_dim=64, sliding_window=128):
    if dense_layers or shared_experts or dense_ffn not in (None, expert_ffn):
        raise ValueError("GPT-OSS has no dense layers and no shared experts")
    config = transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=expert_ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, num_local_experts=routed_experts,
        num_experts_per_tok=top_k, sliding_window=sliding_window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        tie_word_embeddings=False, use_cache=False)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION)
