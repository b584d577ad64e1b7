"""The engine's own decoder: pack the weights of the transformer decoder_spec.py recognised in a model's module tree
into flat per-layer dicts, and run one block with a KV cache.

A user's model file has forward(idx) without a KV cache, so the engine reuses the model's weights in its own
block code. Supported: pre-norm residual blocks

    x = x + o(attention(rope?(q(n1(x))), rope?(k(n1(x))), v(n1(x))))      n1, n2: LayerNorm or RMSNorm
    x = x + down(gelu_tanh(up(n2(x))))   or   x + down(silu(gate(n2(x))) * up(n2(x)))   (SwiGLU, Shazeer 2020)

with separate q/k/v/o Linears (grouped-query attention when k/v have fewer heads), learned position embeddings
(an Embedding outside the blocks besides the token table) or rotary embeddings (the frequencies of the model's rotary
module, partial rotation included, or the attention module's `rope_theta`; rotate-half as in examples/llama.py), a
final norm and a tied or untied output head. The engine
checks its own forward against model(idx) when it is built, so a model that only looks like this is refused
there (engine.py), not silently mis-run.

Packed layer (a flat dict, the unit a WeightStore moves): names below, each Linear either "<name>.weight"
(out, in) -- or oneDNN-packed on the CPU -- or "<name>.qweight" + "<name>.scales" (weight-only int8/int4,
zplan.cuda.weight_quant layout), or "<name>.fp8_weight" + "<name>.fp8_scale" (fp8 W8A8: e4m3 (out, in) and one
fp32 scale per output row, runtime/inference/fp8.py), plus "<name>.bias" when it has one:

    norm1.weight [norm1.bias]  qkv (q, k, v rows stacked)  o  norm2.weight [norm2.bias]  up | gate_up  down
    [q_norm.weight k_norm.weight]  (Qwen3: RMSNorms of each head's q and k before RoPE, head_dim weights)

Under tensor parallelism (Megatron-LM, Shoeybi et al. 2019) q/k/v/up/gate keep this rank's output rows (its
heads/tp query and kv_heads/tp key/value heads), o/down this rank's input columns; their biases are added once,
after the all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zplan.cuda.fused_norm_rope import apply_rotary, rms_norm
from zplan.cuda.weight_only_matmul import weight_only_linear
from zplan.cuda.weight_quant import QuantizedWeight, quantize_groupwise
from zplan.errors import ZplanError
from zplan.runtime.inference import fp8
from zplan.runtime.inference.decoder_spec import DecoderSpec, Norm, UnsupportedModelError

QUANT_BITS = {"int8": 8, "int4": 4}


# ---- packing ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shards:
    """Which slice of each split tensor this rank keeps: tp ranks (1 without TP) of the 1-D `mesh`."""

    tp: int = 1
    mesh: object = None  # the 1-D DeviceMesh when tp > 1

    def colwise(self, w: torch.Tensor) -> torch.Tensor:
        return self._shard(w, 0)

    def rowwise(self, w: torch.Tensor) -> torch.Tensor:
        return self._shard(w, 1)

    def _shard(self, w: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp == 1:
            return w.detach()
        from torch.distributed.tensor import Shard, distribute_tensor

        # src_data_rank=None: every rank holds the same full tensor, so each keeps its slice without sending
        return distribute_tensor(w.detach(), self.mesh, [Shard(dim)], src_data_rank=None).to_local()


def check_split(spec: DecoderSpec, tp: int) -> None:
    if spec.heads % tp or spec.kv_heads % tp or spec.ffn_hidden % tp:
        raise UnsupportedModelError(f"tp={tp} must divide heads={spec.heads}, kv_heads={spec.kv_heads} and "
                                    f"ffn_hidden={spec.ffn_hidden}: choose a tp that divides all three")


def pack_layer(block: nn.Module, spec: DecoderSpec, shards: Shards, weight_dtype: torch.dtype,
               dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One block's tensors as a flat dict (this rank's shards) on the CPU: Linear weights (out, in) in
    `weight_dtype`, biases and norms in `dtype`."""
    p = spec.paths
    mod = block.get_submodule
    out: dict[str, torch.Tensor] = {}

    def put(name: str, tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            out[name] = tensor.detach().to(weight_dtype if name.endswith(".weight") and "norm" not in name
                                           else dtype).contiguous()

    def fused(name: str, roles: tuple[str, ...]) -> None:  # colwise Linears stacked on output rows
        parts = [role_weight(block, spec, r) for r in roles]  # (out, in), (out,) or None each
        put(f"{name}.weight", torch.cat([shards.colwise(w) for w, _ in parts]))
        if any(b is not None for _, b in parts):
            put(f"{name}.bias", torch.cat([shards.colwise(b) if b is not None
                                           else torch.zeros(w.shape[0] // shards.tp) for w, b in parts]))

    def rowwise(name: str, role: str) -> None:
        weight, bias = role_weight(block, spec, role)
        put(f"{name}.weight", shards.rowwise(weight))
        put(f"{name}.bias", bias)  # replicated, added once after the all-reduce

    norms = {"norm1": spec.norm1, "norm2": spec.norm2}
    if spec.head_norm is not None:  # (head_dim,) weights: every tp rank keeps them whole
        norms.update(q_norm=spec.head_norm, k_norm=spec.head_norm)
    if spec.sandwich:
        norms.update(post_attn_norm=spec.norm1, post_mlp_norm=spec.norm2)  # the same kind of norm as the block's others
    for norm, kind in norms.items():
        put(f"{norm}.weight", mod(p[norm]).weight.detach().float() + kind.offset)
        put(f"{norm}.bias", getattr(mod(p[norm]), "bias", None))
    fused("qkv", ("q", "k", "v"))
    rowwise("o", "o")
    gated = spec.mlp in ("swiglu", "geglu")
    fused("gate_up" if gated else "up", ("gate", "up") if gated else ("up",))
    rowwise("down", "down")
    return out


def role_weight(block: nn.Module, spec: DecoderSpec, role: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (out, in) weight and the bias (or None) of a block's Linear `role`: its rows of a fused Linear
    (spec.slices), transposed from a Conv1D's (in, out)."""
    module = block.get_submodule(spec.paths[role])
    weight, bias = module.weight.detach(), getattr(module, "bias", None)
    bias = None if bias is None else bias.detach()
    if role in spec.transposed:
        weight = weight.t()
    if spec.slices and role in spec.slices:
        first, end = spec.slices[role]
        weight, bias = weight[first:end], None if bias is None else bias[first:end]
    return weight.contiguous(), bias if bias is None else bias.contiguous()


def quantize_linear(layer: dict[str, torch.Tensor], name: str, bits: int, group_size: int) -> None:
    """Replace layer[name.weight] with name.qweight / name.scales (weight-only, group-wise symmetric)."""
    w = layer.pop(f"{name}.weight")
    if w.shape[1] % group_size:
        raise ZplanError(f"{name} has {w.shape[1]} input features (on this tensor-parallel rank), not a multiple of "
                         f"the quantization group size {group_size}: choose a group size that divides it")
    qw = quantize_groupwise(w, bits=bits, group_size=group_size, symmetric=True)
    layer[f"{name}.qweight"], layer[f"{name}.scales"] = qw.qweight, qw.scales


def quantize_linear_fp8(layer: dict[str, torch.Tensor], name: str, device: torch.device) -> None:
    """Replace layer[name.weight] with name.fp8_weight (e4m3) / name.fp8_scale (fp32, one per output row)."""
    w = layer.pop(f"{name}.weight")
    fp8.check_shape(name, w.shape[0], w.shape[1], device)
    layer[f"{name}.fp8_weight"], layer[f"{name}.fp8_scale"] = fp8.quantize_weight(w)


LINEARS = ("qkv", "o", "up", "gate_up", "down")


def onednn_pack(layer: dict[str, torch.Tensor], names: tuple[str, ...], batch_hint: int) -> None:
    """Replace each fp32 name.weight (out, in) by oneDNN's blocked layout for its CPU GEMM, packed for batches of
    `batch_hint` rows. Decode-step matmuls run 1.5-4x faster than F.linear on an AVX2 CPU (measured: 768 -> 50257
    at 8 rows 16.8 ms against 72 ms, 768 -> 3072 at 1 row 0.31 against 0.99 ms)."""
    for name in names:
        key = f"{name}.weight"
        if key in layer and layer[key].dtype == torch.float32:
            layer[key] = torch.ops.mkldnn._reorder_linear_weight(layer[key], batch_hint)


# ---- computing ------------------------------------------------------------------------------------------


def quantized(layer: dict[str, torch.Tensor], name: str) -> QuantizedWeight:
    """The QuantizedWeight of layer's name.qweight / name.scales (int8: int8 qweight; int4: packed uint8)."""
    qweight, scales = layer[f"{name}.qweight"], layer[f"{name}.scales"]
    bits = 8 if qweight.dtype == torch.int8 else 4
    cols = qweight.shape[1] * (8 // bits)
    return QuantizedWeight(qweight, scales, None, bits, cols // scales.shape[1], (qweight.shape[0], cols))


def linear(layer: dict[str, torch.Tensor], name: str, x: torch.Tensor, *, bias: bool = True,
           gelu: str | None = None) -> torch.Tensor:
    """x (..., in) -> (..., out) with layer's Linear `name` (dense, oneDNN-packed, quantized weight-only or fp8
    W8A8), then GELU when `gelu` is its approximation ("tanh" | "none")."""
    b = layer.get(f"{name}.bias") if bias else None
    if f"{name}.fp8_weight" in layer:
        y = fp8.fp8_linear(x, layer[f"{name}.fp8_weight"], layer[f"{name}.fp8_scale"], b)
    elif f"{name}.qweight" in layer:
        y = weight_only_linear(x, quantized(layer, name), b)
    else:
        w = layer[f"{name}.weight"]
        if w.layout == torch._mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "gelu" if gelu else "none", [],
                                                      gelu or "")
        y = F.linear(x, w.to(x.dtype), b)
    return F.gelu(y, approximate=gelu) if gelu else y


def norm(layer: dict[str, torch.Tensor], name: str, kind: Norm, x: torch.Tensor) -> torch.Tensor:
    eps = torch.finfo(x.dtype).eps if kind.eps is None else kind.eps
    if kind.kind == "rms":
        return rms_norm(x, layer[f"{name}.weight"], eps)
    return F.layer_norm(x, x.shape[-1:], layer[f"{name}.weight"], layer.get(f"{name}.bias"), eps)


def rope_table(spec: DecoderSpec, length: int, dtype: torch.dtype, device: torch.device):
    """cos, sin (length, r) of the rotary angles (r = head_dim, or fewer with partial RoPE), computed as
    examples/llama.py's rotary_cos_sin does, or from a transformers rotary module's inv_freq as it does."""
    d = spec.head_dim
    if spec.rope_inv_freq is not None:
        inv_freq = torch.tensor(spec.rope_inv_freq, dtype=torch.float32, device=device)  # (r/2,)
    else:
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv_freq  # (S, r/2)
    angles = torch.cat((angles, angles), dim=-1)  # (S, r)
    return (angles.cos() * spec.rope_scaling).to(dtype), (angles.sin() * spec.rope_scaling).to(dtype)


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first r = cos.shape[-1] features of t (B, heads, T, d); the rest pass (partial RoPE)."""
    r = cos.shape[-1]
    if r == t.shape[-1]:
        return apply_rotary(t, cos, sin)
    return torch.cat((apply_rotary(t[..., :r], cos, sin), t[..., r:]), dim=-1)


def block_forward(spec: DecoderSpec, layer: dict[str, torch.Tensor], x: torch.Tensor, attend, rotary, reduce
                  ) -> torch.Tensor:
    """One block on x (B, T, h) -> (B, T, h). attend(q, k, v): (B, a, T, d), (B, a_kv, T, d) x2 -> (B, T, a*d)
    (this rank's heads; it also caches k and v); rotary(t) applies RoPE to (B, heads, T, d) or is None;
    reduce(t) sums t over the tensor-parallel ranks in place, or is None."""
    batch, seq, _ = x.shape
    d = spec.head_dim
    h = norm(layer, "norm1", spec.norm1, x)
    qkv = linear(layer, "qkv", h)  # (B, T, (a + 2 a_kv) d / tp)
    q_width = qkv.shape[-1] * spec.heads // (spec.heads + 2 * spec.kv_heads)  # a d / tp
    kv_width = (qkv.shape[-1] - q_width) // 2  # a_kv d / tp
    q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
    q = q.view(batch, seq, -1, d).transpose(1, 2)  # (B, a/tp, T, d)
    k = k.view(batch, seq, -1, d).transpose(1, 2)  # (B, a_kv/tp, T, d)
    v = v.view(batch, seq, -1, d).transpose(1, 2)
    if spec.head_norm is not None:  # Qwen3: each head's q and k normalised over its d features
        q, k = norm(layer, "q_norm", spec.head_norm, q), norm(layer, "k_norm", spec.head_norm, k)
    if rotary is not None:
        q, k = rotary(q), rotary(k)
    attended = _rowwise(layer, "o", attend(q, k, v), reduce)  # (B, T, h)
    x = x + (norm(layer, "post_attn_norm", spec.norm1, attended) if spec.sandwich else attended)
    h = norm(layer, "norm2", spec.norm2, x)
    if spec.mlp in ("swiglu", "geglu"):
        gate, up = linear(layer, "gate_up", h).chunk(2, dim=-1)  # (B, T, f/tp) each
        act = F.silu(gate) if spec.mlp == "swiglu" else F.gelu(gate, approximate=spec.gelu_approximate)
        inner = act * up
    else:
        inner = linear(layer, "up", h, gelu=spec.gelu_approximate)  # (B, T, f/tp)
    out = _rowwise(layer, "down", inner, reduce)  # (B, T, h)
    return x + (norm(layer, "post_mlp_norm", spec.norm2, out) if spec.sandwich else out)


def _rowwise(layer: dict[str, torch.Tensor], name: str, x: torch.Tensor, reduce) -> torch.Tensor:
    """A rowwise Linear: this rank's partial sum, all-reduced, then the bias (once)."""
    if reduce is None:
        return linear(layer, name, x)
    y = linear(layer, name, x, bias=False)
    reduce(y)
    bias = layer.get(f"{name}.bias")
    return y if bias is None else y + bias
