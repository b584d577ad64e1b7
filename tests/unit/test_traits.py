"""The tracer finds the traits that decide what the runtime can run (planner/traits.py), on small models written
here that each have one, on zplan's examples (none) and on Hugging Face models built from their configs."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zplan.examples
from zplan.model_input import trace_model_file, trace_module

EXAMPLES = Path(zplan.examples.__file__).parent
H, HEADS, T, V = 32, 4, 16, 64


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H))

    def forward(self, x):
        return x * self.weight


class Attention(nn.Module):
    """q/k/v -> attention -> o; fused: one qkv Linear chunked in three ("partial": sliced, with features left
    over, so its parts cannot be told; "viewed": viewed as (3, heads, head_dim) and cut); q_norm: a norm beside
    the split Linears; explicit_heads: the heads reshaped with the model's head count, which one tensor-parallel
    rank's features do not have."""

    def __init__(self, fused=False, q_norm=False, explicit_heads=False):
        super().__init__()
        self.fused, self.heads = fused, HEADS if explicit_heads else -1
        if fused:
            self.qkv = nn.Linear(H, 3 * H + (HEADS if fused == "partial" else 0))
        else:
            self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)
        self.q_norm = nn.LayerNorm(H // HEADS) if q_norm else None
        self.o = nn.Linear(H, H)

    def forward(self, x):  # (B, T, H)
        b, t, _ = x.shape
        if self.fused == "partial":
            qkv = self.qkv(x)
            q, k, v = qkv[..., :H], qkv[..., H:2 * H], qkv[..., 2 * H:3 * H]
        elif self.fused == "viewed":  # cut after a view into (3, heads, head_dim): a rank's slice would mix them
            q, k, v = self.qkv(x).view(b, t, 3, HEADS, -1).unbind(2)
        else:
            q, k, v = self.qkv(x).chunk(3, dim=-1) if self.fused else (self.q(x), self.k(x), self.v(x))
        q, k, v = (y.view(b, t, self.heads, H // HEADS).transpose(1, 2) for y in (q, k, v))
        if self.q_norm is not None:
            q = self.q_norm(q)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, sandwich=False, router=False, **attention):
        super().__init__()
        self.norm = Norm()
        self.attn = Attention(**attention)
        self.post = nn.LayerNorm(H) if sandwich else None
        self.router = Norm() if router else None  # parameters that are not a norm's (the class name says)
        if router:
            self.router.__class__ = type("Router", (Norm,), {})
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x, mask=None):
        y = self.attn(self.norm(x))
        if self.post is not None:
            y = self.post(y)
        x = x + y
        if self.router is not None:
            x = self.router(x)
        return x + self.down(F.gelu(self.up(x)))


class Decoder(nn.Module):
    def __init__(self, layers=2, nested=False, second_stack=False, mask=False, keyword_call=False, **block):
        super().__init__()
        self.mask, self.keyword_call = mask, keyword_call
        self.embed = nn.Embedding(V, H)
        blocks = nn.ModuleList(Block(**block) for _ in range(layers))
        if nested:
            self.inner = nn.Module()
            self.inner.blocks = blocks
        else:
            self.blocks = blocks
        self.encoder = nn.ModuleList(Block(**block) for _ in range(layers)) if second_stack else None
        self.head = nn.Linear(H, V)

    def forward(self, idx, position_ids=None):  # no positions: the blocks see none (context parallel passes them)
        x = self.embed(idx)
        if self.encoder is not None:
            for block in self.encoder:
                x = block(x)
        blocks = self.inner.blocks if hasattr(self, "inner") else self.blocks
        mask = torch.ones(idx.shape, device=idx.device) if self.mask else None
        for block in blocks:
            if self.keyword_call:  # a stage cannot tell which keyword is the hidden state
                x = block(x=x)
            else:
                x = block(x, mask) if self.mask else block(x)
        return self.head(x)


def summary_of(**options):
    with torch.device("meta"):
        model = Decoder(**options)
        tokens = torch.zeros(1, T, dtype=torch.long)
    return trace_module(model, tokens, T, "fp32")[1]


def traits_of(**options) -> set[tuple[str, str]]:
    return {(t.kind, t.module) for t in summary_of(**options).traits}


def test_a_plain_decoder_has_none():
    assert traits_of() == set()


def test_blocks_in_a_submodule_and_called_with_a_mask_still_pipeline():
    """Every stage runs the model's forward (runtime/parallel/pipeline.py), so neither nesting nor extra inputs
    matter."""
    assert traits_of(nested=True, mask=True) == set()


def test_a_fused_projection_is_planned_by_its_parts():
    """chunk(3) of a 3H-wide qkv: three parts of H, in H groups (no head_dim attribute: features), no trait."""
    summary = summary_of(fused=True)
    rules = {rule.module: rule for rule in summary.tp_rules}
    assert summary.traits == [] and (rules["attn.qkv"].parts, rules["attn.qkv"].groups) == ([H, H, H], H)
    assert rules["attn.o"].parts == [] and rules["attn.o"].style == "rowwise"


@pytest.mark.parametrize("options, expected", [
    ({"fused": "partial"}, {("fused_projection", "blocks.0.attn.qkv")}),
    ({"fused": "viewed"}, {("fused_projection", "blocks.0.attn.qkv")}),
    ({"q_norm": True}, {("parameters_beside_split_linears", "blocks.0.attn.q_norm")}),
    ({"sandwich": True}, {("parameters_outside_split_linears", "blocks.0.attn.o")}),
    ({"router": True}, {("parameters_outside_split_linears", "blocks.0.router")}),
    ({"keyword_call": True}, {("forward_not_split_by_stages", "")}),
    ({"explicit_heads": True}, {("forward_not_split_by_heads", "blocks.0")}),
])
def test_each_trait_is_found_where_it_is(options, expected):
    """(With a q norm the tracer pairs q with no Linear, so q stays whole beside the split k, v: also found.)"""
    found = traits_of(**options)
    assert expected <= found and {kind for kind, _ in found} == {kind for kind, _ in expected}, found


def test_a_second_stack_of_blocks():
    """Also: the encoder's Linears of V outputs outside the decoder's blocks leave more than one candidate head, so
    the vocabulary is not split."""
    found = traits_of(second_stack=True)
    assert found and {kind for kind, _ in found} == {"several_block_stacks", "vocab_not_split"}


@pytest.mark.parametrize("example", ["tiny.py", "gpt.py", "llama.py"])
def test_the_examples_run_every_parallelism(example):
    _, summary = trace_model_file(EXAMPLES / example, 32, "fp32")
    assert summary.traits == [] and summary.block_tokens == 32


def test_hugging_face_models():
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=HEADS,
                  num_key_value_heads=2, max_position_embeddings=64)
    found, parts, styles = {}, {}, {}
    for name, config in (("llama", transformers.LlamaConfig(**common)),
                         ("phi3", transformers.Phi3Config(**common, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
                         ("gpt2", transformers.GPT2Config(vocab_size=V, n_embd=H, n_layer=2, n_head=HEADS))):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        _, summary = trace_module(model, torch.zeros(1, T, dtype=torch.long, device="meta"), T, "fp32")
        found[name] = {(t.kind, t.module) for t in summary.traits}
        parts[name] = {rule.module: (rule.parts, rule.groups) for rule in summary.tp_rules if rule.parts}
        styles[name] = {rule.module: rule.style for rule in summary.tp_rules}
    # GPT-2's Conv1D projections are not nn.Linear: nothing for fp8 or nvfp4 training to convert (it splits like
    # Linears)
    # Phi-3's embedding has a padding_idx (pad_token_id 0), whose zeroed gradient row a vocabulary split would misplace
    assert found == {"llama": set(), "phi3": {("vocab_not_split", "")},
                     "gpt2": {("no_fp8_linears", "transformer.h.0"), ("no_nvfp4_linears", "transformer.h.0")}}
    # fused projections: q (4 heads of 8), k and v (2 kv heads each) in 2 kv-head groups; gate and up; GPT-2's Conv1D
    assert parts["phi3"] == {"self_attn.qkv_proj": ([H, 16, 16], 2), "mlp.gate_up_proj": ([2 * H, 2 * H], 2 * H)}
    assert parts["gpt2"] == {"attn.c_attn": ([H, H, H], HEADS)}
    assert styles["gpt2"] == {"attn.c_attn": "colwise", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise",
                              "mlp.c_proj": "rowwise"}


def test_context_parallel_needs_positions_causal_sdpa_and_the_default_loss(tmp_path):
    """runtime/parallel/context_parallel.py passes position_ids, gathers K/V inside F.scaled_dot_product_attention
    under a causal mask of global positions, and splits the default next-token loss: each missing piece is a trait."""
    transformers = pytest.importorskip("transformers")

    class NoPositions(Decoder):
        def forward(self, idx):
            return super().forward(idx)

    with torch.device("meta"):
        model = NoPositions()
    tokens = torch.zeros(1, T, dtype=torch.long, device="meta")
    assert {t.kind for t in trace_module(model, tokens, T, "fp32")[1].traits} == {"no_position_ids"}
    common = dict(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=HEADS,
                  num_key_value_heads=2, max_position_embeddings=64)
    found = {}
    for name, config, options in (
            ("eager", transformers.LlamaConfig(**common), {"attn_implementation": "eager"}),
            ("mistral", transformers.MistralConfig(**common, sliding_window=16), {}),
            ("bert", transformers.BertConfig(**common), {})):
        with torch.device("meta"):
            built = (transformers.AutoModelForMaskedLM if name == "bert" else transformers.AutoModelForCausalLM
                     ).from_config(config, **options)
        _, summary = trace_module(built, torch.zeros(1, T, dtype=torch.long, device="meta"), T, "fp32")
        found[name] = {t.kind for t in summary.traits if t.kind in
                       ("no_position_ids", "attention_not_sdpa", "attention_not_causal")}
    assert found == {"eager": {"attention_not_sdpa"}, "mistral": {"attention_not_causal"},
                     "bert": {"attention_not_causal"}}
    own_loss = tmp_path / "own_loss.py"
    own_loss.write_text((EXAMPLES / "tiny.py").read_text() + "\n\ndef loss_fn(outputs, batch):\n"
                        "    return outputs.float().mean()\n")
    assert {t.kind for t in trace_model_file(own_loss, 32, "fp32")[1].traits} == {"own_loss"}
    from zplan.api import prepare
    from zplan.errors import SpecError
    from zplan.schemas.spec import Pins

    with pytest.raises(SpecError, match=r"--cp: the runtime cannot run context parallel on this model: \(the model "
                                        r"file defines loss_fn\).*use --cp 1"):
        prepare(str(own_loss), 2, "cpu-local", 8, 32, "fp32", Pins(cp=2))
