"""Family specs: closed-form counts against published numbers and against the traced examples."""

from pathlib import Path

import pytest

import zplan.examples
from zplan.errors import FamilySpecError, SpecError
from zplan.model_input import summarize_model, trace_model_file
from zplan.planner.family import FAMILY_EXAMPLES, family_summary, parse_family_spec

EXAMPLES = Path(zplan.examples.__file__).parent


def test_gpt3_175b_matches_published_counts():
    summary = family_summary(FAMILY_EXAMPLES["gpt"])
    layers, h, a, vocab, s = 96, 12288, 96, 51200, 2048
    narayanan = 12 * layers * h**2 * (1 + 13 / (12 * h) + (vocab + s) / (12 * layers * h))  # Narayanan 2021
    assert summary.params == round(narayanan) + 2 * h  # + the final LayerNorm the formula leaves out
    assert 174e9 < summary.params < 175e9  # "175B" (Brown 2020, Table 2.1)
    # Narayanan 2021 eq. 3 / 3 is the forward pass with attention in full; causal counting halves s/(6h)
    megatron_forward = 24 * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * h * layers))
    causal_forward = megatron_forward - 2 * s**2 * h * layers
    assert summary.fwd_flops_per_sample == pytest.approx(causal_forward, rel=1e-12)
    # Korthikanti 2022 Table 2, no parallelism: s*b*h*(34 + 5*a*s/h) bytes per block at 16-bit, with the unfused
    # attention core Megatron-LM ran; the flash kernel the examples run keeps an (a, s) fp32 log-sum-exp instead of
    # the 5*a*s^2 core, and the examples have no dropout masks (2sh)
    unfused = family_summary(FAMILY_EXAMPLES["gpt"] + ",unfused_attention=1").layers[1]
    assert unfused.act_bytes == s * h * (34 + 5 * a * s / h) and unfused.attention_core_bytes == 5 * a * s * s
    unfused_fp32 = family_summary(FAMILY_EXAMPLES["gpt"] + ",unfused_attention=1", precision="fp32").layers[1]
    assert unfused_fp32.act_bytes == 2 * unfused.act_bytes
    block = summary.layers[1]
    assert block.act_bytes == s * h * 32 + 4 * a * s and block.attention_core_bytes == 0
    assert (summary.source, summary.tracer, summary.num_blocks, summary.block_prefix) == \
        ("family", "closed-form", layers, "blocks")


def test_llama3_405b_matches_published_size():
    summary = family_summary(FAMILY_EXAMPLES["llama"])
    assert 405e9 < summary.params < 406e9  # Llama 3 405B (Dubey 2024, Table 3: 405.8B)
    assert (summary.heads, summary.kv_heads, summary.ffn_hidden, summary.seq_len) == (128, 8, 53248, 8192)
    assert len(summary.layers) == 126 + 2 and summary.block_prefix == "layers"


def test_defaults_and_sequence_override():
    gpt = parse_family_spec("gpt:layers=2,hidden=64,heads=4")
    assert (gpt.ffn, gpt.kv_heads, gpt.seq, gpt.vocab) == (256, 4, 2048, 51200)
    llama = parse_family_spec("llama:layers=32,hidden=4096,heads=32,kv_heads=8")
    assert llama.ffn == 11008  # Llama 2 7B's width: 256 * ceil(int(8 * 4096 / 3) / 256)
    short = family_summary("gpt:layers=2,hidden=64,heads=4,seq=1024", seq_len=256)
    assert short.seq_len == 256
    assert short.layers[0].params == 51200 * 64 + 1024 * 64  # the position table keeps the spec's seq rows
    assert short.layers[1].fwd_flops == 24 * 256 * 64**2 + 2 * 256**2 * 64



@pytest.mark.parametrize("family, spec, file, overrides", [
    ("gpt", "gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1000", "gpt.py",
     dict(num_layers=4, hidden=256, heads=4, vocab_size=1000, max_seq_len=128)),
    ("llama", "llama:layers=4,hidden=256,heads=8,kv_heads=2,ffn=512,seq=128,vocab=1000", "llama.py",
     dict(num_layers=4, hidden=256, heads=8, kv_heads=2, ffn_hidden=512, vocab_size=1000)),
])
def test_family_agrees_with_the_traced_example(family, spec, file, overrides):
    formula = family_summary(spec)
    _, traced = trace_model_file(EXAMPLES / file, 128, "bf16", build_overrides=overrides)
    assert formula.params == traced.params
    assert [u.params for u in formula.layers] == [u.params for u in traced.layers]
    assert formula.fwd_flops_per_sample == pytest.approx(traced.fwd_flops_per_sample, rel=0.01)
    for ours, theirs in zip(formula.layers, traced.layers, strict=True):
        assert (ours.name, ours.kind) == (theirs.name, theirs.kind)
        assert ours.fwd_flops == pytest.approx(theirs.fwd_flops, rel=0.01)
        if ours.kind == "block":  # the saved bytes as the traced flash kernel saves them (Llama: + RoPE's 1.8 %)
            assert ours.act_bytes == pytest.approx(theirs.act_bytes, rel=0.02)
    same = ("num_blocks", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len", "block_prefix",
            "tp_rules")
    assert formula.model_dump(include=set(same)) == traced.model_dump(include=set(same))


@pytest.mark.parametrize("spec, words", [
    ("gpt:layers=4,hidden=256,heads=4,depth=3", ["'depth'", "layers, hidden, heads"]),
    ("gpt:layers=4,heads=4", ["lacks hidden"]),
    ("gpt:layers=four,hidden=256,heads=4", ["layers='four'", "whole number"]),
    ("gpt:layers=0,hidden=256,heads=4", ["layers=0", "positive"]),
    ("gpt:layers=4,layers=5,hidden=256,heads=4", ["'layers'", "twice"]),
    ("gpt:layers=4,hidden,heads=4", ["'hidden'", "no value"]),
    ("gpt:layers=4,hidden=250,heads=4", ["multiple of heads"]),
    ("llama:layers=4,hidden=256,heads=8,kv_heads=3", ["multiple of kv_heads"]),
    ("gpt:layers=4,hidden=256,heads=4,kv_heads=2", ["'kv_heads'"]),  # GPT-3 has no grouped-query attention
    ("bert:layers=4,hidden=256,heads=4", ["unknown model family 'bert'", "gpt, llama"]),
])
def test_malformed_specs_name_the_problem_and_show_an_example(spec, words):
    with pytest.raises(FamilySpecError) as caught:
        family_summary(spec)
    message = str(caught.value)
    for word in words:
        assert word in message, (word, message)
    assert "e.g. 'gpt:" in message or "e.g. 'llama:" in message


def test_unknown_precision_is_a_spec_error():
    with pytest.raises(SpecError, match="bf16"):
        family_summary("gpt:layers=2,hidden=64,heads=4", precision="int3")


def test_summarize_model_tells_specs_from_files(tmp_path):
    graph, summary = summarize_model("gpt:layers=2,hidden=64,heads=4,seq=64,vocab=256", None, "bf16")
    assert graph is None and summary.source == "family"
    graph, summary = summarize_model(str(EXAMPLES / "tiny.py"), None, "bf16")
    assert graph is not None and summary.source == "file" and summary.seq_len == 64
    # same sizes as tiny.py: the family formula and the traced file agree
    assert family_summary("gpt:layers=2,hidden=64,heads=4,seq=64,vocab=256").params == summary.params
    odd = tmp_path / "a:b.py"  # an existing file whose name has a colon is a file, not a spec
    odd.write_text((EXAMPLES / "tiny.py").read_text())
    assert summarize_model(str(odd), 32, "bf16")[1].source == "file"
