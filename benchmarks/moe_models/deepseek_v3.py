"""DeepSeek-V3's architecture (and Kimi K2's, which is DeepSeek-V3's with 384 routed experts, one dense layer and
64 heads) from transformers' DeepseekV3Config, for zplan to trace on the meta device. The defaults are DeepSeek-V3's
public config.json (61 layers of which the first 3 dense, hidden 7168, multi-head latent attention with q_lora 1536,
kv_lora 512, qk_nope 128, qk_rope 64, v 128; 256 routed experts + 1 shared, top-8, expert FFN 2048); the multi-token
prediction module is not part of transformers' model. benchmarks/reference_runs.py passes each MoE row's sizes."""

import transformers

SEQ_LEN = 4096


def build_model(layers=61, dense_layers=3, hidden=7168, heads=128, kv_heads=128, dense_ffn=18432, routed_experts=256,
                shared_experts=1, top_k=8, expert_ffn=2048, vocab=129280, q_lora_rank=1536, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4):
    config = transformers.DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=dense_ffn, moe_intermediate_size=expert_ffn,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        n_shared_experts=shared_experts, n_routed_experts=routed_experts, num_experts_per_tok=top_k,
        first_k_dense_replace=dense_layers, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
        n_group=n_group, topk_group=topk_group, tie_word_embeddings=False, use_cache=False)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
