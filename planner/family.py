"""Closed-form ModelSummary for model families too large to build, from their sizes alone.

  gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200
      GPT-3 (Brown 2020): learned position embedding, LayerNorm, 4h GELU MLP, biases, tied output head.
  llama:layers=126,hidden=16384,heads=128,kv_heads=8,ffn=53248,seq=8192,vocab=128256
      Llama (Touvron 2023, Dubey 2024): RMSNorm, SwiGLU, grouped-query attention, RoPE, no biases, untied head.

The counts match examples/gpt.py and examples/llama.py built with the same sizes exactly (parameters,
FLOPs), so a family spec plans the model those files would build. Per sample of s tokens, with h hidden,
a heads, f MLP width, V vocabulary, and h_kv = kv_heads * h / a:
  FLOPs    2 per multiply-add: every Linear weight costs 2*s FLOPs (Kaplan 2020, C_forward = 2N); the
           attention core QK^T and AV costs 2*s^2*h each in full and half that with causal masking, as the
           traced path counts it (Megatron's 24*s*h^2*(1 + s/(6h)), Narayanan 2021 eq. 3, counts it in full;
           ours is 24*s*h^2*(1 + s/(12h)) for GPT).
  act      bytes saved for backward at 16-bit, from Korthikanti 2022 Table 2 (no parallelism) as the example files
           run: s*h*(34 + 5*a*s/h) for a GPT block less its dropout masks (2sh; the examples have none) and with
           the flash kernel's (a, s) fp32 log-sum-exp for the 5*a*s^2 unfused attention core (softmax, dropout
           mask); its terms rederived below for f and for SwiGLU / GQA. fp32 doubles the 16-bit terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zplan.errors import FamilySpecError, SpecError
from zplan.schemas.model import LayerCost, ModelSummary, TensorParallelRule

FAMILY_EXAMPLES = {
    "gpt": "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200",
    "llama": "llama:layers=126,hidden=16384,heads=128,kv_heads=8,ffn=53248,seq=8192,vocab=128256",
}
REQUIRED_KEYS = ("layers", "hidden", "heads")
OPTIONAL_KEYS = {"gpt": ("seq", "vocab", "ffn", "unfused_attention"),
                 "llama": ("seq", "vocab", "ffn", "kv_heads", "unfused_attention")}
DEFAULT_SEQ = {"gpt": 2048, "llama": 8192}
DEFAULT_VOCAB = {"gpt": 51200, "llama": 128256}
BLOCK_PREFIX = {"gpt": "blocks", "llama": "layers"}  # as in examples/gpt.py and examples/llama.py
TP_RULES = {
    "gpt": [("attn.q", "colwise"), ("attn.k", "colwise"), ("attn.v", "colwise"), ("attn.o", "rowwise"),
            ("mlp.up", "colwise"), ("mlp.down", "rowwise")],
    "llama": [("attn.q", "colwise"), ("attn.k", "colwise"), ("attn.v", "colwise"), ("attn.o", "rowwise"),
              ("mlp.gate", "colwise"), ("mlp.up", "colwise"), ("mlp.down", "rowwise")],
}
FLOAT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FLASH_LSE_BYTES = 4.0  # the flash kernel's log-sum-exp per head and token, fp32
# Largest value of each key: far beyond any model built (Llama 3 405B: 126 layers, hidden 16384, vocab 128256), and
# small enough that a summary (one LayerCost per layer) is built in moments.
MAX_VALUE = {"layers": 10_000, "hidden": 1 << 20, "heads": 1 << 16, "kv_heads": 1 << 16, "ffn": 1 << 22,
             "seq": 1 << 24, "vocab": 1 << 24, "unfused_attention": 1}


@dataclass(frozen=True)
class FamilySpec:
    family: str  # 'gpt' or 'llama'
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int  # sequence length the model is made for (GPT: rows of the position table)
    vocab: int
    unfused_attention: bool = False  # Megatron-LM 2021's block (Korthikanti Table 2), not the examples' flash kernel


def is_family_spec(text: str) -> bool:
    return text.split(":", 1)[0].strip().lower() in FAMILY_EXAMPLES and ":" in text


def parse_family_spec(spec: str) -> FamilySpec:
    """'gpt:layers=96,hidden=12288,heads=96' -> FamilySpec, defaults filled; FamilySpecError if malformed."""
    family, sep, body = spec.partition(":")
    family = family.strip().lower()
    if not sep or family not in FAMILY_EXAMPLES:
        raise FamilySpecError(f"unknown model family {family!r} in {spec!r}: use one of "
                              f"{', '.join(FAMILY_EXAMPLES)}, e.g. {FAMILY_EXAMPLES['gpt']!r}.")
    example = FAMILY_EXAMPLES[family]
    allowed = REQUIRED_KEYS + OPTIONAL_KEYS[family]
    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, eq, text = (piece.strip() for piece in item.partition("="))
        if key not in allowed:
            raise FamilySpecError(f"unknown key {key!r} in {spec!r}: {family} takes {', '.join(allowed)}, "
                                  f"e.g. {example!r}.")
        if not eq or key in values:
            problem = "has no value" if not eq else "is given twice"
            raise FamilySpecError(f"key {key!r} {problem} in {spec!r}: write key=value once each, e.g. {example!r}.")
        try:
            values[key] = int(text)
        except ValueError:
            raise FamilySpecError(f"{key}={text!r} in {spec!r} is not a whole number: e.g. {example!r}.") from None
        if not 1 <= values[key] <= MAX_VALUE[key]:
            raise FamilySpecError(f"{key}={values[key]} in {spec!r} must be positive and at most {MAX_VALUE[key]:,}: "
                                  f"e.g. {example!r}.")
    missing = [key for key in REQUIRED_KEYS if key not in values]
    if missing:
        raise FamilySpecError(f"{spec!r} lacks {', '.join(missing)}: a {family} spec needs "
                              f"{', '.join(REQUIRED_KEYS)}, e.g. {example!r}.")
    hidden, heads = values["hidden"], values["heads"]
    kv_heads = values.get("kv_heads", heads)
    if hidden % heads or heads % kv_heads:
        raise FamilySpecError(f"{spec!r}: hidden must be a multiple of heads and heads a multiple of kv_heads "
                              f"(got hidden={hidden}, heads={heads}, kv_heads={kv_heads}), e.g. {example!r}.")
    if "ffn" in values:
        ffn = values["ffn"]
    elif family == "gpt":
        ffn = 4 * hidden
    else:  # Llama's SwiGLU width: 2/3 of 4h, rounded up to a multiple of 256 (Touvron 2023, model.py)
        ffn = 256 * math.ceil(int(8 * hidden / 3) / 256)
    return FamilySpec(family=family, layers=values["layers"], hidden=hidden, heads=heads, kv_heads=kv_heads,
                      ffn=ffn, seq=values.get("seq", DEFAULT_SEQ[family]),
                      vocab=values.get("vocab", DEFAULT_VOCAB[family]),
                      unfused_attention=bool(values.get("unfused_attention", 0)))


def block_params(spec: FamilySpec) -> int:
    h, f = spec.hidden, spec.ffn
    if spec.family == "gpt":
        # q, k, v, o weights 4h^2 + biases 4h; MLP 2hf + biases f + h; two LayerNorms 4h.
        # For f = 4h: 12h^2 + 13h, the per-layer terms of 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)) (Narayanan 2021).
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    h_kv = spec.kv_heads * h // spec.heads
    return 2 * h * h + 2 * h * h_kv + 3 * h * f + 2 * h  # q, o: h^2; k, v: h*h_kv; SwiGLU 3hf; two RMSNorms


def block_linear_weights(spec: FamilySpec) -> int:
    """Weights that multiply every token (the 2*s FLOPs each): the Linear weights of one block."""
    h, f = spec.hidden, spec.ffn
    if spec.family == "gpt":
        return 4 * h * h + 2 * h * f
    return 2 * h * h + 2 * h * (spec.kv_heads * h // spec.heads) + 3 * h * f


def block_fwd_flops(spec: FamilySpec, s: int) -> float:
    attention_core = 4.0 * s * s * spec.hidden / 2.0  # QK^T + AV: 2*s^2*h each in full, halved (causal)
    return 2.0 * s * block_linear_weights(spec) + attention_core


def block_act_bytes(spec: FamilySpec, s: int, scale: float = 1.0) -> float:
    """Bytes one block saves for backward per sample, its activations at 2 * scale bytes an element, as
    examples/gpt.py and examples/llama.py run on a GPU: no dropout, attention through scaled_dot_product_attention's
    flash kernel, which keeps its output and an (a, s) fp32 log-sum-exp (Dao 2023) where an unfused core keeps
    5*a*s^2 bytes (Korthikanti 2022 Table 2). Korthikanti's other GPT terms: attention QKV input 2sh, Q and K 4sh,
    V 2sh, projection input 2sh (the kernel's output); two LayerNorm inputs 4sh; MLP input 2sh, GELU input and
    output 4sf: 30sh at f = 4h (Table 2's 34 less its two dropout masks). unfused_attention: Table 2 as printed
    (Megatron-LM 2021: the masks and the unfused core; all scaled by the precision as before)."""
    h, f, a = spec.hidden, spec.ffn, spec.heads
    if spec.family == "gpt":
        sixteen_bit = s * (10 * h + 4 * h + 2 * h + 4 * f)
    else:  # Llama: attention QKV input 2sh + Q 2sh + K, V 2*s*h_kv each + projection input 2sh;
        # two RMSNorm inputs 4sh; SwiGLU input 2sh + gate and up outputs 4sf + SiLU output 2sf + product 2sf.
        h_kv = spec.kv_heads * h // spec.heads
        sixteen_bit = s * (6 * h + 4 * h_kv + 4 * h + 2 * h + 8 * f)
    if spec.unfused_attention:
        return (sixteen_bit + 2 * s * h + attention_core_bytes(spec, s)) * scale
    return sixteen_bit * scale + FLASH_LSE_BYTES * a * s  # the log-sum-exp is fp32 whatever the precision


def attention_core_bytes(spec: FamilySpec, s: int) -> float:
    """16-bit bytes an unfused attention core saves per sample: softmax output, dropout mask and its output over
    (a, s, s), 5*a*s^2 (Korthikanti 2022 Table 2); 0 for the flash kernel."""
    return 5.0 * spec.heads * s * s if spec.unfused_attention else 0.0


def block_gemm_out_bytes_16bit(spec: FamilySpec, s: int) -> float:
    """The block's projection outputs per sample at 16-bit (what selective recompute keeps): GPT q, k, v, o (4h)
    and the MLP's up (f) and down (h); Llama q and o (2h), k and v (2 h_kv), gate and up (2f), down (h)."""
    h, f = spec.hidden, spec.ffn
    if spec.family == "gpt":
        return 2.0 * s * (5 * h + f)
    h_kv = spec.kv_heads * h // spec.heads
    return 2.0 * s * (3 * h + 2 * h_kv + 2 * f)


def family_summary(spec: str, seq_len: int | None = None, precision: str = "bf16") -> ModelSummary:
    """ModelSummary of a family spec, counted at seq_len (default: the spec's seq) and `precision`."""
    parsed = parse_family_spec(spec)
    if precision not in FLOAT_BYTES:
        raise SpecError(f"unknown precision {precision!r}: use one of {', '.join(FLOAT_BYTES)}.")
    scale = FLOAT_BYTES[precision] / 2.0  # the 16-bit byte counts scale with the element size
    s = seq_len or parsed.seq
    h, V, L = parsed.hidden, parsed.vocab, parsed.layers
    if parsed.family == "gpt":
        embed_params = V * h + parsed.seq * h  # token and position tables
        head_params = 2 * h  # final LayerNorm; the output head is the token table (tied)
        embed_act = s * h * 1.0  # embedding dropout mask, 1 byte (Korthikanti 2022 section 4.3)
    else:
        embed_params = V * h
        head_params = h + V * h  # final RMSNorm and the untied output head
        embed_act = 0.0
    head_act = 4.0 * s * h * scale  # final norm input + output-projection input (Korthikanti 4.3)
    prefix = BLOCK_PREFIX[parsed.family]
    block = LayerCost(name=f"{prefix}.0", kind="block", params=block_params(parsed),
                      fwd_flops=block_fwd_flops(parsed, s), act_bytes=block_act_bytes(parsed, s, scale),
                      gemm_out_bytes=block_gemm_out_bytes_16bit(parsed, s) * scale,
                      attention_core_bytes=attention_core_bytes(parsed, s) * scale)
    layers = [LayerCost(name="embedding", kind="embedding", params=embed_params, fwd_flops=0.0, act_bytes=embed_act)]
    layers += [block.model_copy(update={"name": f"{prefix}.{i}"}) for i in range(L)]
    tied = V * h if parsed.family == "gpt" else 0  # a pipeline's last stage holds its own copy of the token table
    layers.append(LayerCost(name="head", kind="head", params=head_params, shared_params=tied, fwd_flops=2.0 * s * h * V,
                            act_bytes=head_act))
    return ModelSummary(
        name=spec, source="family", tracer="closed-form", num_blocks=L, hidden=h, heads=parsed.heads,
        kv_heads=parsed.kv_heads, ffn_hidden=parsed.ffn, vocab=V, seq_len=s,
        params=embed_params + L * block_params(parsed) + head_params, layers=layers, block_prefix=prefix,
        tp_rules=[TensorParallelRule(module=m, style=style) for m, style in TP_RULES[parsed.family]],
    )
