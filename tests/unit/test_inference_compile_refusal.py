"""One contract for serving: `zplan compile MODEL --mode inference` refuses, with the engine's own reason, exit status
2 and nothing written, the models the inference engine would refuse when the server starts (runtime/inference/
decoder_spec.py recognise, asked on the meta model at compile: runtime/plan/model_checks.py inference_traits), and
recognise gives the same answer on a meta model as on a materialised one.

Tiny Hugging Face folders built from their configs (nothing is downloaded), saved with a tokenizer as a user's folder
is: Llama and GPT-2 compile; Mixtral, Qwen3-MoE and DeepSeek-V3 (mixtures of experts), OLMo2 (q_norm / k_norm
over all heads at once) and GPT-2 with options the engine does not run are refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from tests.unit.test_export_hf import VOCAB, save_tokenizer  # noqa: E402
from zplan.cli import app  # noqa: E402
from zplan.examples import gpt, llama, tiny  # noqa: E402
from zplan.model_input import trace_module  # noqa: E402
from zplan.runtime.inference.decoder_spec import UnsupportedExpertsError, UnsupportedModelError, recognise  # noqa: E402
from zplan.runtime.plan.model_checks import inference_traits  # noqa: E402
from zplan.schemas.capability import allows  # noqa: E402

SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GPT2 = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
SERVED = {  # the families the engine runs (tests/e2e/test_hf_serving.py serves them), and two variants
    "llama": lambda: transformers.LlamaConfig(**SIZES),
    "gpt2": lambda: transformers.GPT2Config(**GPT2),
    "qwen2": lambda: transformers.Qwen2Config(**SIZES),
    "mistral": lambda: transformers.MistralConfig(**SIZES, sliding_window=5),
    "gemma": lambda: transformers.GemmaConfig(**SIZES, head_dim=8),
    "gemma2": lambda: transformers.Gemma2Config(**SIZES, head_dim=8, sliding_window=5, query_pre_attn_scalar=16,
                                                attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "phi3": lambda: transformers.Phi3Config(**SIZES, partial_rotary_factor=0.5),
    "qwen3": lambda: transformers.Qwen3Config(**SIZES, head_dim=8),
    "llama3_rope": lambda: transformers.LlamaConfig(**SIZES, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "gpt2_gelu": lambda: transformers.GPT2Config(**GPT2, activation_function="gelu"),
}
EXPERTS = {  # name -> (config, the first experts module)
    "mixtral": (lambda: transformers.MixtralConfig(**SIZES, **MOE), "model.layers.0.mlp.experts"),
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(**SIZES, head_dim=8, moe_intermediate_size=32, num_experts=4,
                                                      num_experts_per_tok=2, decoder_sparse_step=1,
                                                      mlp_only_layers=[]), "model.layers.0.mlp.experts"),
    "deepseek_v3": (lambda: transformers.DeepseekV3Config(
        **{**SIZES, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, n_group=2, topk_group=2), "model.layers.1.mlp.experts"),  # block 0 dense
}
OTHERS = {  # name -> (config, what the refusal names)
    "olmo2": (lambda: transformers.Olmo2Config(**SIZES), r"self_attn\.q_norm \(Olmo2RMSNorm\)"),  # over all heads
    "gpt2_relu": (lambda: transformers.GPT2Config(**GPT2, activation_function="relu"),
                  r"transformer\.h\.0\.mlp\.act \(ReLU\) is none of those the inference engine runs"),
    "gpt2_layer_scaled": (lambda: transformers.GPT2Config(**GPT2, scale_attn_by_inverse_layer_idx=True),
                          "scale_attn_by_inverse_layer_idx"),
    "gpt2_cross_attention": (lambda: transformers.GPT2Config(**GPT2, add_cross_attention=True), "ln_cross_attn"),
}


def save_folder(folder: Path, config) -> Path:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def compile_inference(model: Path, out: Path):
    return CliRunner().invoke(app, ["compile", str(model), "--mode", "inference", "--gpus", "1", "--cluster",
                                    "cpu-local", "--precision", "fp32", "-o", str(out)])


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_models_the_engine_runs_compile(tmp_path, name):
    result = compile_inference(save_folder(tmp_path / name, SERVED[name]()), tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "plan.json").is_file() and (tmp_path / "out" / "serve.py").is_file()


@pytest.mark.parametrize("name", list(EXPERTS))
def test_a_mixture_of_experts_is_refused_at_compile_naming_its_experts(tmp_path, name):
    config, experts = EXPERTS[name]
    result = compile_inference(save_folder(tmp_path / name, config()), tmp_path / "out")
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())  # the console wraps long lines
    assert "--mode inference: the inference engine cannot serve this model" in message
    assert f"{experts} (" in message and "4 routed experts, 2 per token" in message
    assert "the inference engine does not run expert layers yet" in message
    assert "use --mode training" in message
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("name", list(OTHERS))
def test_blocks_the_engine_does_not_run_are_refused_at_compile(tmp_path, name):
    config, named = OTHERS[name]
    result = compile_inference(save_folder(tmp_path / name, config()), tmp_path / "out")
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "--mode inference: the inference engine cannot serve this model" in message
    assert re.search(named, message), message
    assert not (tmp_path / "out").exists()


def test_training_compiles_do_not_ask_the_engine():
    """Only --mode inference asks: a training summary of a mixture of experts holds no serving trait."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(EXPERTS["mixtral"][0]())
    tokens = torch.zeros(1, 16, dtype=torch.long, device="meta")
    training = trace_module(model, tokens, 16, "fp32")[1]
    assert allows(training.traits, "inference")
    serving = trace_module(model, tokens, 16, "fp32", serving=True)[1]
    assert [(t.kind, t.module) for t in serving.traits if not allows([t], "inference")] == [
        ("experts_not_served", "model.layers.0.mlp.experts")]


def _materialised_and_meta(build):
    torch.manual_seed(0)
    real = build()
    with torch.no_grad():  # weights off their init (norms too), so that a value read from them would show
        generator = torch.Generator().manual_seed(1)
        for parameter in real.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    with torch.device("meta"):
        meta = build()
    summary = trace_module(meta, torch.zeros(1, 16, dtype=torch.long, device="meta"), 16, "fp32")[1]
    return real, meta, summary


@pytest.mark.parametrize("name", list(SERVED))
def test_recognise_answers_alike_on_meta_and_materialised_models(name):
    """Rotary frequencies (from the config on meta), Gemma's 1 + weight norms (probed with stand-in weights), tied
    heads (by identity), embedding scales: the same DecoderSpec either way."""
    real, meta, summary = _materialised_and_meta(lambda: transformers.AutoModelForCausalLM.from_config(
        SERVED[name]()))
    spec = recognise(real, summary)
    assert recognise(meta, summary) == spec
    assert inference_traits(meta, summary) == []
    if name.startswith("gemma"):
        assert spec.norm1.offset == 1.0 and spec.embed_scale == pytest.approx(32 ** 0.5)
    if name == "qwen3":
        assert spec.head_norm is not None and spec.paths["q_norm"] == "self_attn.q_norm"
    if name in ("llama", "phi3", "llama3_rope"):
        assert len(spec.rope_inv_freq) == (2 if name == "phi3" else 4)  # head_dim 8; Phi-3 rotates half of it


@pytest.mark.parametrize("module, kwargs", [
    (gpt, dict(num_layers=2, hidden=64, heads=4, vocab_size=300, max_seq_len=64)),
    (llama, dict(num_layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab_size=300)),
    (tiny, {}),
])
def test_model_files_are_recognised_alike_on_meta(module, kwargs):
    real, meta, summary = _materialised_and_meta(lambda: module.build_model(**kwargs))
    assert recognise(meta, summary) == recognise(real, summary)


@pytest.mark.parametrize("name", list(EXPERTS))
def test_the_engine_refuses_the_same_way_when_it_starts(name):
    """The runtime's refusal (recognise on the materialised model, what InferenceEngine.from_model runs first) is the
    one compile gives."""
    config, experts = EXPERTS[name]
    real, meta, summary = _materialised_and_meta(lambda: transformers.AutoModelForCausalLM.from_config(config()))
    with pytest.raises(UnsupportedExpertsError, match="the inference engine does not run expert layers yet") as error:
        recognise(real, summary)
    assert error.value.module == experts and isinstance(error.value, UnsupportedModelError)
    assert [t.module for t in inference_traits(meta, summary)] == [experts]


def test_a_model_file_mixture_of_experts_is_refused_too(tmp_path):
    """examples/moe.py: routed experts in a model file, found as transformers' are (model/experts.py)."""
    from zplan import examples

    result = compile_inference(Path(examples.__file__).parent / "moe.py", tmp_path / "out")
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "layers.0.mlp.experts (Experts: 8 routed experts, 2 per token" in message
    assert "the inference engine does not run expert layers yet" in message and not (tmp_path / "out").exists()
