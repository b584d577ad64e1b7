"""Tiny Hugging Face models, built from their configs (nothing is downloaded), as zplan model files."""

from pathlib import Path

COMMON = "vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4"

DECODER = '''"""A tiny Hugging Face {name}, built from its config{setup_doc}."""
from transformers import AutoModelForCausalLM, {config}

VOCAB_SIZE = 128
SEQ_LEN = 32


def build_model():
    return AutoModelForCausalLM.from_config({config}({args}){setup})
'''

# Each decoder as a training script sets it up: no KV cache, an explicit attention implementation (half of the
# families eager, half sdpa). deterministic_decoder_sources keeps transformers' defaults instead, so the suite
# runs both configurations.
ATTENTION = {"llama": "sdpa", "qwen2": "eager", "mistral": "sdpa", "gemma2": "eager", "phi3": "eager",
             "mixtral": "sdpa", "gpt2": "eager"}


def _training_setup(name: str) -> dict[str, str]:
    return {"setup_doc": f", set up for training (use_cache=False, {ATTENTION[name]} attention)",
            "setup": f", attn_implementation={ATTENTION[name]!r}", "cache": ", use_cache=False"}


DECODERS = {
    "llama": ("LlamaConfig", COMMON + ", num_key_value_heads=2, max_position_embeddings=64"),
    "qwen2": ("Qwen2Config", COMMON + ", num_key_value_heads=2, max_position_embeddings=64"),
    "mistral": ("MistralConfig", COMMON + ", num_key_value_heads=2, max_position_embeddings=64"),
    "gemma2": ("Gemma2Config", COMMON + ", num_key_value_heads=2, head_dim=8, max_position_embeddings=64"),
    "phi3": ("Phi3Config", COMMON + ", num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, "
             "bos_token_id=1, eos_token_id=2"),
    "mixtral": ("MixtralConfig", COMMON + ", num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, "
                "num_experts_per_tok=2"),
    "gpt2": ("GPT2Config", "vocab_size=VOCAB_SIZE, n_embd=32, n_layer=2, n_head=4, n_positions=64"),
}

# Mixtures of experts run under expert parallel (tests/distributed/test_hf_parallel.py) beside Mixtral: Qwen3-MoE and
# DeepSeek-V3 (its shared expert, multi-head latent attention, a dense first block and group-limited routing)
MOE_DECODERS = {
    "qwen3_moe": ("Qwen3MoeConfig", COMMON + ", num_key_value_heads=2, head_dim=8, max_position_embeddings=64, "
                  "moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, "
                  "mlp_only_layers=[], tie_word_embeddings=False"),
    "deepseek_v3": ("DeepseekV3Config", COMMON + ", num_key_value_heads=4, max_position_embeddings=64, "
                    "moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, "
                    "first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4, "
                    "qk_nope_head_dim=4, v_head_dim=8, n_group=2, topk_group=2, tie_word_embeddings=False"),
}

# Every dropout of each decoder's config, set to 0 (explicitly, whatever the config's default): runs of the same
# model under different plans then compute the same function, so their losses and weights can be compared.
DROPOUT_FREE = {
    "llama": "attention_dropout=0.0",
    "qwen2": "attention_dropout=0.0",
    "mistral": "attention_dropout=0.0",
    "gemma2": "attention_dropout=0.0",
    "phi3": "attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0",
    "mixtral": "attention_dropout=0.0, router_jitter_noise=0.0",
    "gpt2": "resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0",
    "qwen3_moe": "attention_dropout=0.0",
    "deepseek_v3": "attention_dropout=0.0",
}

BERT = '''"""A tiny Hugging Face BERT (masked LM), built from its config."""
from transformers import BertConfig, BertForMaskedLM

VOCAB_SIZE = 128
SEQ_LEN = 32


def build_model():
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64))
'''

T5 = '''"""A tiny Hugging Face T5, built from its config: the decoder reads the input shifted right."""
import torch
import torch.nn.functional as F
from transformers import T5Config, T5ForConditionalGeneration

VOCAB_SIZE = 128
SEQ_LEN = 32


def build_model():
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB_SIZE, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_heads=4, decoder_start_token_id=0, pad_token_id=0))


def _batch(ids):
    decoder = torch.cat([torch.zeros_like(ids[:, :1]), ids[:, :-1]], dim=1)
    return {"input_ids": ids, "decoder_input_ids": decoder}


def example_inputs(batch_size, seq_len):
    return _batch(torch.zeros(batch_size, seq_len, dtype=torch.long))


def train_data(batch_size, seq_len, seed=0):
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield _batch(torch.randint(0, VOCAB_SIZE, (batch_size, seq_len), generator=generator))


def loss_fn(outputs, batch):
    return F.cross_entropy(outputs.logits.reshape(-1, VOCAB_SIZE), batch["input_ids"].reshape(-1))
'''

VIT = '''"""A tiny Hugging Face ViT image classifier, built from its config, on random 32x32 images."""
import torch
from transformers import ViTConfig, ViTForImageClassification

CLASSES = 10


def build_model():
    return ViTForImageClassification(ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, image_size=32, patch_size=8,
                                               num_labels=CLASSES))


def example_inputs(batch_size, seq_len):
    return {"pixel_values": torch.zeros(batch_size, 3, 32, 32)}


def train_data(batch_size, seq_len, seed=0):
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield {"pixel_values": torch.randn(batch_size, 3, 32, 32, generator=generator),
               "labels": torch.randint(0, CLASSES, (batch_size,), generator=generator)}


def loss_fn(outputs, batch):
    return outputs.loss  # the model's own, from the batch's labels
'''

LLAMA_HOOKS = '''"""A tiny Hugging Face Llama from a config.json saved beside this file (hf_zoo.save_llama_config),
with a training script's own hooks: batches of input_ids, attention_mask and labels, the model's own loss."""
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

SEQ_LEN = 32
CONFIG = AutoConfig.from_pretrained(Path(__file__).parent / "llama_config")


def build_model():
    return AutoModelForCausalLM.from_config(CONFIG, attn_implementation="sdpa")


def _batch(ids):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def example_inputs(batch_size, seq_len):
    return _batch(torch.zeros(batch_size, seq_len, dtype=torch.long))


def train_data(batch_size, seq_len, seed=0):
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield _batch(torch.randint(0, CONFIG.vocab_size, (batch_size, seq_len), generator=generator))


def loss_fn(outputs, batch):
    return outputs.loss  # transformers' shifted next-token cross-entropy from the labels
'''


def model_sources() -> dict[str, str]:
    """Each family's model file, the decoders set up for training (ATTENTION), and a Llama with its own hooks."""
    sources = {}
    for name, (config, args) in DECODERS.items():
        setup = _training_setup(name)
        sources[name] = DECODER.format(name=name, config=config, args=args + setup.pop("cache"), **setup)
    sources.update(bert=BERT, t5=T5, vit=VIT, llama_hooks=LLAMA_HOOKS)
    return sources


def deterministic_decoder_sources(moe: bool = False) -> dict[str, str]:
    """The model files of DECODERS (and MOE_DECODERS with `moe`) with every dropout 0 (DROPOUT_FREE), same names and
    sizes, transformers' defaults otherwise (the KV cache on, the default attention)."""
    decoders = {**DECODERS, **(MOE_DECODERS if moe else {})}
    return {name: DECODER.format(name=name, config=config, args=f"{args}, {DROPOUT_FREE[name]}", setup_doc="",
                                 setup="")
            for name, (config, args) in decoders.items()}


def save_llama_config(folder: Path) -> Path:
    """LLAMA_HOOKS's config.json, as save_pretrained writes it, in folder/llama_config."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    config.save_pretrained(folder / "llama_config")
    return folder / "llama_config"


def write_model_files(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    save_llama_config(folder)
    paths = {}
    for name, source in model_sources().items():
        paths[name] = folder / f"hf_{name}.py"
        paths[name].write_text(source)
    return paths
