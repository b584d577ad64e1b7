"""Tracing on meta: totals against closed-form GPT formulas, structure, tensor-parallel pairs, fallbacks."""

import textwrap
from pathlib import Path

import pytest
import torch

import zplan.examples
from zplan.errors import TraceError
from zplan.model_input import summarize_model, trace_model_file, trace_module

EXAMPLES = Path(zplan.examples.__file__).parent
L, H, A, V, S = 4, 256, 4, 1000, 128  # layers, hidden, heads, vocabulary, sequence
GPT_SIZES = dict(num_layers=L, hidden=H, heads=A, vocab_size=V, max_seq_len=S)
LLAMA_SIZES = dict(num_layers=L, hidden=H, heads=8, kv_heads=2, ffn_hidden=512, vocab_size=V)


@pytest.fixture(scope="module")
def gpt():
    return trace_model_file(EXAMPLES / "gpt.py", S, "bf16", build_overrides=GPT_SIZES)


@pytest.fixture(scope="module")
def llama():
    return trace_model_file(EXAMPLES / "llama.py", S, "bf16", build_overrides=LLAMA_SIZES)


def narayanan_params(layers, h, vocab, seq):
    """Narayanan 2021: 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)), plus the final LayerNorm (2h) it omits."""
    return round(12 * layers * h**2 * (1 + 13 / (12 * h) + (vocab + seq) / (12 * layers * h))) + 2 * h


def gpt_forward_flops(layers, h, vocab, s):
    """Narayanan 2021 eq. 3 divided by 3 (forward only), with the attention core s/(6h) halved (causal):
    24*s*l*h^2*(1 + s/(12h) + V/(12*l*h)) per sample."""
    return 24 * s * layers * h**2 * (1 + s / (12 * h) + vocab / (12 * layers * h))


def test_gpt_totals_match_closed_forms(gpt):
    graph, summary = gpt
    model = zplan.model.model_file.load_model_file(EXAMPLES / "gpt.py").build("meta", **GPT_SIZES)
    assert summary.params == sum(p.numel() for p in model.parameters())  # tied head counted once
    assert summary.params == narayanan_params(L, H, V, S)
    assert summary.params == sum(layer.params for layer in summary.layers)
    assert summary.fwd_flops_per_sample == pytest.approx(gpt_forward_flops(L, H, V, S), rel=1e-12)
    assert graph.total("bwd_flops") == pytest.approx(2 * graph.total("fwd_flops"))
    assert graph.total("fwd_flops") == pytest.approx(summary.fwd_flops_per_sample)


def test_gpt_structure_dimensions_and_units(gpt):
    graph, summary = gpt
    assert summary.tracer == "fx" and summary.source == "file" and summary.name == "gpt"
    assert (summary.num_blocks, summary.block_prefix) == (L, "blocks")
    assert (summary.hidden, summary.heads, summary.kv_heads, summary.ffn_hidden, summary.vocab, summary.seq_len) \
        == (H, A, A, 4 * H, V, S)
    assert [(u.name, u.kind) for u in summary.layers] == \
        [("embedding", "embedding")] + [(f"blocks.{i}", "block") for i in range(L)] + [("head", "head")]
    embedding, block, head = summary.layers[0], summary.layers[1], summary.layers[-1]
    assert embedding.params == V * H + S * H and head.params == 2 * H  # wte + wpe; ln_f (lm_head is tied)
    assert head.shared_params == V * H and embedding.shared_params == block.shared_params == 0  # the tied table
    assert block.fwd_flops == 24 * S * H**2 + 2 * S**2 * H  # dense + causal attention core
    assert head.fwd_flops == 2 * S * H * V
    assert graph.units() == [u.name for u in summary.layers]
    assert graph.unit_totals("params") == {u.name: u.params for u in summary.layers}


def test_gpt_activation_bytes_follow_korthikanti_without_dropout_and_with_flash_attention(gpt):
    _, summary = gpt
    # Korthikanti 2022 Table 2: 34*s*h + 5*a*s^2 bytes at 16-bit. This model has no dropout (-2sh for the
    # two masks) and attention is a flash kernel (no 5as^2 scores), which keeps a fp32 logsumexp (4*a*s);
    # the two LayerNorms keep fp32 mean and rstd per token (2 * 8 * s).
    block = summary.layers[1]
    assert block.act_bytes == (34 - 2) * S * H + 4 * A * S + 2 * 8 * S
    assert summary.layers[-1].act_bytes == 4 * S * H + 8 * S  # ln_f input, lm_head input, ln_f statistics
    assert summary.layers[0].act_bytes == 8 * S + 8 * S  # int64 token ids and positions
    _, fp32 = trace_model_file(EXAMPLES / "gpt.py", S, "fp32", build_overrides=GPT_SIZES)
    assert fp32.layers[1].act_bytes == 2 * 32 * S * H + 4 * A * S + 2 * 8 * S


def test_graph_nodes_carry_every_attribute(gpt):
    graph, _ = gpt
    q = next(name for name, data in graph.iter_nodes(module="blocks.2.attn.q"))
    data = graph[q]
    assert (data["op"], data["block"], data["unit"], data["tp_style"]) == ("linear", 2, "blocks.2", "colwise")
    assert data["shape"] == (1, S, H) and data["dtype"] == "torch.float32"
    assert data["fwd_flops"] == 2 * S * H * H and data["bwd_flops"] == 2 * data["fwd_flops"]
    assert data["params"] == H * H + H and data["param_bytes"] == 2 * data["params"]
    assert data["act_bytes"] == 2 * S * H  # ln1's output, saved by q, k and v, is charged once, to q
    k = next(name for name, data in graph.iter_nodes(module="blocks.2.attn.k"))
    assert graph[k]["act_bytes"] == 0
    assert graph.graph.out_degree(q) == 1  # q -> view
    attention = [n for n, d in graph.iter_nodes(op="scaled_dot_product_attention", block=0)]
    assert len(attention) == 1 and graph[attention[0]]["fwd_flops"] == 2 * S * S * H
    assert len(graph.nodes_of_block(0)) == len(graph.nodes_of_block(L - 1))


def test_tensor_parallel_pairs(gpt, llama):
    gpt_rules = {rule.module: rule.style for rule in gpt[1].tp_rules}
    assert gpt_rules == {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
                         "mlp.up": "colwise", "mlp.down": "rowwise"}
    llama_rules = {rule.module: rule.style for rule in llama[1].tp_rules}
    assert llama_rules == {**gpt_rules, "mlp.gate": "colwise"}
    assert gpt[0].tp_styles(L - 1) == {f"blocks.{L - 1}.{m}": s for m, s in gpt_rules.items()}


def test_llama_dimensions_and_counts(llama):
    _, summary = llama
    h, kv_width, f = H, 2 * H // 8, 512
    assert (summary.block_prefix, summary.heads, summary.kv_heads, summary.ffn_hidden) == ("layers", 8, 2, f)
    block = summary.layers[1]
    assert block.params == 2 * h * h + 2 * h * kv_width + 3 * h * f + 2 * h  # q, o; k, v; SwiGLU; 2 RMSNorm
    assert block.fwd_flops == 2 * S * (2 * h * h + 2 * h * kv_width + 3 * h * f) + 2 * S**2 * h
    assert summary.layers[-1].params == h + V * h  # final norm and the untied head
    assert summary.params == sum(layer.params for layer in summary.layers)


MODEL_TEMPLATE = """
import torch
import torch.nn.functional as F
from torch import nn

class Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)  # fused q, k, v
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x):
        batch, seq, width = x.shape
        {guard}
        q, k, v = self.qkv(x).split(width, dim=-1)  # (B, T, h) each
        q = q.view(batch, seq, self.heads, -1).transpose(1, 2)  # (B, a, T, d)
        k = k.view(batch, seq, self.heads, -1).transpose(1, 2)
        v = v.view(batch, seq, self.heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal={causal})
        return x + self.o(y.transpose(1, 2).reshape(batch, seq, width))

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.blocks = nn.ModuleList(Block(64, 4) for _ in range(3))
        self.head = nn.Linear(64, 100, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

def build_model():
    return Model()
"""


def write_model(tmp_path, name, causal=True, guard="pass"):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(MODEL_TEMPLATE.format(causal=causal, guard=guard)))
    return path


def test_causal_masking_halves_attention_flops(tmp_path):
    s, h, layers = 32, 64, 3
    _, causal = trace_model_file(write_model(tmp_path, "causal", causal=True), s, "bf16")
    _, full = trace_model_file(write_model(tmp_path, "full", causal=False), s, "bf16")
    full_attention = 4 * s * s * h  # QK^T and AV, 2*s^2*h each
    assert full.fwd_flops_per_sample - causal.fwd_flops_per_sample == layers * full_attention / 2
    dense = 2 * s * (4 * h * h) * layers + 2 * s * h * 100
    assert causal.fwd_flops_per_sample == dense + layers * full_attention / 2
    # a fused qkv Linear is one colwise Linear feeding attention
    assert {r.module: r.style for r in causal.tp_rules} == {"qkv": "colwise", "o": "rowwise"}


def test_shape_dependent_control_flow_falls_back_to_hooks(tmp_path):
    path = write_model(tmp_path, "branchy", guard="if seq > 1:  # fx cannot branch on a traced shape\n"
                       "            x = x * 1.0")
    with pytest.raises(Exception, match="control flow"):
        torch.fx.symbolic_trace(zplan.model.model_file.load_model_file(path).build("meta"))
    _, summary = trace_model_file(path, 32, "bf16")
    _, reference = trace_model_file(write_model(tmp_path, "plain"), 32, "bf16")
    assert summary.tracer == "hooks" and reference.tracer == "fx"
    assert summary.params == reference.params
    assert summary.fwd_flops_per_sample == reference.fwd_flops_per_sample
    assert summary.tp_rules == reference.tp_rules


def test_value_dependent_control_flow_fails_with_cause_and_fix(tmp_path):
    path = write_model(tmp_path, "valued", guard="if x.sum() > 0:\n            x = x * 1.0")
    with pytest.raises(TraceError) as caught:
        trace_model_file(path, 16, "bf16")
    message = str(caught.value)
    assert "fx:" in message and "hooks:" in message and "export:" in message
    assert "meta device" in message and ".item()" in message


def test_model_without_repeated_blocks_is_refused(tmp_path):
    path = tmp_path / "flat.py"
    path.write_text("from torch import nn\n\ndef build_model():\n    return nn.Linear(4, 4)\n")
    with pytest.raises(TraceError, match="nn.ModuleList"):
        trace_model_file(path, 8, "bf16")


@pytest.mark.parametrize("tracer", ["hooks", "export"])
def test_every_tracer_agrees_with_fx(tracer):
    _, fx = trace_model_file(EXAMPLES / "tiny.py", None, "bf16", tracers=("fx",))
    _, other = trace_model_file(EXAMPLES / "tiny.py", None, "bf16", tracers=(tracer,))
    assert other.tracer == tracer and fx.seq_len == 64  # tiny.py's SEQ_LEN
    assert other.model_dump(exclude={"tracer"}) == fx.model_dump(exclude={"tracer"})


def test_default_sequence_length_for_files(tmp_path):
    path = tmp_path / "no_seq.py"
    path.write_text((EXAMPLES / "tiny.py").read_text().replace("SEQ_LEN = 64", "MAX_POSITIONS = 64")
                    .replace("max_seq_len: int = SEQ_LEN", "max_seq_len: int = 4096"))
    graph, summary = summarize_model(str(path), None, "bf16")
    assert summary.seq_len == 2048 and graph is not None and graph.seq_len == 2048
    assert summarize_model(str(EXAMPLES / "tiny.py"), None, "fp32")[1].seq_len == 64


def test_gpt3_175b_example_traces_on_meta():
    graph, summary = trace_model_file(EXAMPLES / "gpt.py", None, "bf16")
    layers, h, vocab, s = 96, 12288, 51200, 2048
    assert (summary.tracer, summary.num_blocks, summary.hidden, summary.heads) == ("fx", layers, h, 96)
    assert summary.params == narayanan_params(layers, h, vocab, s) == 174_615_846_912
    assert summary.fwd_flops_per_sample == pytest.approx(gpt_forward_flops(layers, h, vocab, s), rel=1e-12)
    assert len(graph.nodes_of_block(95)) == len(graph.nodes_of_block(0))


def test_hugging_face_models_trace_through_the_fallback(llama):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=L, hidden_size=H, num_attention_heads=8,
                                      num_key_value_heads=2, intermediate_size=512, vocab_size=V)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
        inputs = torch.zeros(1, S, dtype=torch.long)
    _, summary = trace_module(model, inputs, S, "bf16", name="hf-llama")
    ours = llama[1]
    assert summary.tracer == "hooks" and summary.block_prefix == "model.layers"
    assert summary.params == sum(p.numel() for p in model.parameters()) == ours.params
    assert summary.fwd_flops_per_sample == ours.fwd_flops_per_sample  # an independent implementation
    assert (summary.heads, summary.kv_heads, summary.ffn_hidden, summary.vocab) == (8, 2, 512, V)
    assert {r.module: r.style for r in summary.tp_rules} == {
        "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise"}

    _, by_keyword = trace_module(model, {"input_ids": inputs}, S, "bf16")  # fx replays positional inputs only
    assert by_keyword.tracer == "hooks" and by_keyword.fwd_flops_per_sample == summary.fwd_flops_per_sample

    gpt2_config = transformers.GPT2Config(n_layer=L, n_embd=H, n_head=A, vocab_size=V, n_positions=S,
                                          bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        gpt2 = transformers.GPT2LMHeadModel(gpt2_config)
    _, summary = trace_module(gpt2, inputs, S, "bf16", name="hf-gpt2")
    assert summary.params == sum(p.numel() for p in gpt2.parameters()) == narayanan_params(L, H, V, S)
    assert summary.fwd_flops_per_sample == pytest.approx(gpt_forward_flops(L, H, V, S), rel=1e-12)
    # GPT-2's Conv1D layers split like Linears; c_attn is q, k, v fused, in one group per head
    assert {(r.module, r.style, tuple(r.parts), r.groups) for r in summary.tp_rules} == {
        ("attn.c_attn", "colwise", (H, H, H), A), ("attn.c_proj", "rowwise", (), 1),
        ("mlp.c_fc", "colwise", (), 1), ("mlp.c_proj", "rowwise", (), 1)}
