"""Qwen3's mixture-of-experts architecture (Qwen3-30B-A3B, Qwen3-235B-A22B) from transformers' Qwen3MoeConfig, for
zplan to trace on the meta device: every layer a MoE layer (decoder_sparse_step 1, no mlp_only_layers), head_dim 128,
q/k norms, untied embeddings. The defaults are Qwen3-30B-A3B's public config.json; benchmarks/reference_runs.py
passes each MoE row's sizes."""

import transformers

SEQ_LEN = 4096


def build_model(layers=48, dense_layers=0, hidden=2048, heads=32, kv_heads=4, dense_ffn=6144, routed_experts=128,
                shared_experts=0, top_k=8, expert_ffn=768, vocab=151936, head_dim=128):
    if dense_layers or shared_experts:
        raise ValueError("Qwen3 MoE has no dense layers and no shared experts")
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=dense_ffn, moe_intermediate_size=expert_ffn,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        num_experts=routed_experts, num_experts_per_tok=top_k, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False, use_cache=False)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
