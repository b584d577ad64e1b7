"""GPT-OSS's architecture from transformers' GptOssConfig, for zplan to trace on the meta device: attention with
sinks (eager: transformers gives it no sdpa path) alternating a 128-token sliding window with full attention, head_dim
64, every layer a MoE layer of clamped-SwiGLU experts with biases. The defaults are GPT-OSS-120B's public config.json
(36 layers, hidden 2880, 64 heads, 8 KV heads, 128 experts, top-4, expert FFN 2880, vocabulary 201088);
benchmarks/reference_runs.py passes each MoE row's sizes."""

import transformers

SEQ_LEN = 4096
ATTENTION = "eager"  # transformers gives GPT-OSS no sdpa path (attention sinks)


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
