"""Recognising the transformer in a model's module tree for the engine (decoder.py packs and runs what this finds):
the block stack, each block's q/k/v/o (or fused qkv), MLP roles, norms, rotary embedding, attention scale, sliding
windows and soft-caps, read from the modules themselves (a model file's or transformers'). What is supported is
decoder.py's docstring; anything else raises UnsupportedModelError naming what is missing: routed experts (the
engine runs dense decoders only), parameters in a block that none of its roles accounts for (Qwen3's per-head
q_norm / k_norm, a router), an MLP activation other than silu, gelu or gelu-tanh.

recognise() runs on a materialised model (the engine, at start) and on a meta one (`zplan compile --mode
inference`, runtime/plan/model_checks.py's inference_traits, so that compile refuses what the engine would), with
the same answer: the few values it reads are then computed off the meta tensors -- the rotary frequencies by the
rotary module's own constructor on its config (transformers': rope_parameters / rope_theta, rope_scaling,
partial_rotary_factor, head_dim), the RMS norm's 1 + weight offset by probing the norm with stand-in weights, a
tied head by identity. The numbers themselves are checked when the engine is built (engine.py compares its logits
with the model's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from zplan.cuda.fused_norm_rope import rms_norm_reference
from zplan.errors import ZplanError
from zplan.model.experts import find_expert_layers
from zplan.model.modules import parent_path
from zplan.schemas.model import ModelSummary

ROLE_NAMES = {  # role -> child names it goes by in common model files
    "q": ("q", "q_proj", "wq", "query"),
    "k": ("k", "k_proj", "wk", "key"),
    "v": ("v", "v_proj", "wv", "value"),
    "o": ("o", "o_proj", "wo", "out_proj", "proj", "c_proj", "dense"),
    "qkv": ("qkv_proj", "c_attn", "Wqkv"),  # q, k, v rows stacked in one Linear (Phi-3) or Conv1D (GPT-2)
    "gate": ("gate", "gate_proj", "w1"),
    "gate_up": ("gate_up_proj",),  # gate rows, then up rows (Phi-3)
    "up": ("up", "up_proj", "fc", "c_fc", "fc1", "w3", "fc_in"),
    "down": ("down", "down_proj", "proj", "c_proj", "fc2", "w2", "fc_out"),
}
EPS_NAMES = ("eps", "variance_epsilon", "epsilon")
ACTIVATION_NAMES = ("act_fn", "act", "activation_fn", "activation")  # an MLP's activation attribute (transformers)
SANDWICH_NORMS = {  # Gemma 2's four block norms -> their roles
    "input_layernorm": "norm1", "post_attention_layernorm": "post_attn_norm", "pre_feedforward_layernorm": "norm2",
    "post_feedforward_layernorm": "post_mlp_norm"}

class UnsupportedModelError(ZplanError):
    """The inference engine does not recognise (or cannot reproduce) this model's architecture; `module`: where in
    the model, when one module is to blame ('' otherwise)."""

    def __init__(self, message: str, *, module: str = "") -> None:
        super().__init__(message)
        self.module = module


class UnsupportedExpertsError(UnsupportedModelError):
    """The model routes tokens to experts (a mixture of experts), which the engine does not run yet; `detail`: the
    experts module's class and counts."""

    def __init__(self, message: str, *, module: str = "", detail: str = "") -> None:
        super().__init__(message, module=module)
        self.detail = detail


ENGINE_RUNS_NO_EXPERTS = "the inference engine does not run expert layers yet"


@dataclass(frozen=True)
class Norm:
    kind: str  # "layer" | "rms"
    eps: float | None  # None: torch.finfo(dtype).eps, as nn.RMSNorm(eps=None)
    offset: float = 0.0  # the norm scales by offset + weight (Gemma: 1 + weight); packed as one weight


@dataclass(frozen=True)
class DecoderSpec:
    """What the engine needs to know about the model, found by recognise()."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab: int
    norm1: Norm
    norm2: Norm
    final_norm: Norm
    mlp: str  # "gelu" (down(gelu(up))) | "swiglu" (down(silu(gate) * up)) | "geglu" (down(gelu(gate) * up))
    gelu_approximate: str  # "tanh" | "none"
    rope_theta: float | None  # rotary embedding base; None without
    position_rows: int  # rows of the learned position table; 0 without
    tied_head: bool
    paths: dict  # role -> module path inside a block, e.g. {"q": "attn.q", ..., "norm1": "ln1"}
    outer: dict  # "tok", "pos", "norm", "head" -> module path in the model ("pos" may be absent)
    # transformers' models (read from their modules and config; the defaults are a plain model file's)
    rope_inv_freq: tuple[float, ...] | None = None  # (r/2,) the rotary module's inv_freq; r < head_dim: partial
    rope_scaling: float = 1.0  # cos and sin multiplied by it (transformers' attention_scaling)
    slices: dict | None = None  # role -> (first, end) output rows of a fused Linear (qkv_proj, gate_up_proj)
    transposed: frozenset = frozenset()  # roles whose weight is (in, out): GPT-2's Conv1D
    attn_scale: float | None = None  # scores * attn_scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores = cap * tanh(scores / cap) (Gemma 2)
    logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)
    embed_scale: float | None = None  # token embeddings multiplied by it (Gemma: sqrt(hidden))
    windows: tuple = ()  # per layer: sliding attention window (a query sees keys q - window < j <= q) or None
    sandwich: bool = False  # post_attn / post_mlp norms on each branch's output (Gemma 2)
    head_norm: Norm | None = None  # q_norm / k_norm over each head's features before RoPE (Qwen3), or None


# ---- recognition ------------------------------------------------------------------------------------------


def _norm_of(module: nn.Module, path: str) -> Norm:
    name = type(module).__name__
    eps = next((getattr(module, a) for a in EPS_NAMES if hasattr(module, a)), "missing")
    if eps == "missing" or getattr(module, "weight", None) is None:
        raise UnsupportedModelError(f"norm {path} ({name}) needs a weight and an eps attribute")
    if "rms" in name.lower():
        if getattr(module, "bias", None) is not None:
            raise UnsupportedModelError(f"norm {path} ({name}) is an RMSNorm with a bias, which the engine lacks")
        eps = None if eps is None else float(eps)
        return Norm("rms", eps, _rms_offset(module, eps))
    if "layernorm" in name.lower():
        return Norm("layer", float(eps))
    raise UnsupportedModelError(f"norm {path} ({name}) is neither a LayerNorm nor an RMSNorm")


def _rms_offset(module: nn.Module, eps: float | None) -> float:
    """1.0 when the RMSNorm scales by 1 + weight (Gemma's), else 0.0: its output on a probe input against both. On
    the meta device the norm is probed with stand-in weights (the offset is in its code, not its values)."""
    generator = torch.Generator().manual_seed(0)
    meta = any(t.is_meta for t in (*module.parameters(), *module.buffers()))
    if meta:  # the module's own forward with CPU tensors of its parameters' shapes
        stand_ins = {name: (torch.randn(t.shape, generator=generator) if name == "weight" else torch.zeros(t.shape))
                     for name, t in (*module.named_parameters(), *module.named_buffers())}
        weight = stand_ins["weight"]
    else:
        weight = module.weight.detach().float()
    x = torch.randn(2, weight.numel(), generator=torch.Generator().manual_seed(0))  # (2, h)
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    try:
        with torch.no_grad():
            y = (functional_call(module, stand_ins, (x,)) if meta else module(x)).float()
    except Exception:  # a norm that wants other inputs: the build-time check judges it
        return 0.0
    errors = [(y - rms_norm_reference(x, weight + offset, eps)).abs().max().item() for offset in (0.0, 1.0)]
    return 1.0 if errors[1] < errors[0] else 0.0


def _activation(mlp: nn.Module, path: str) -> str | None:
    """The MLP's activation found by its output on a probe input: "silu" | "gelu_tanh" | "gelu"; None without an
    activation attribute (ACTIVATION_NAMES); UnsupportedModelError for one that is none of the three (ReLU,
    quick_gelu: the engine would compute another function)."""
    x = torch.linspace(-6.0, 6.0, 97)
    known = {"silu": F.silu(x), "gelu_tanh": F.gelu(x, approximate="tanh"), "gelu": F.gelu(x)}
    for attribute in ACTIVATION_NAMES:
        act = getattr(mlp, attribute, None)
        if not callable(act):
            continue
        try:
            with torch.no_grad():
                y = act(x)
        except Exception:  # not an elementwise function of one tensor
            continue
        if isinstance(y, torch.Tensor) and y.shape == x.shape and y.device == x.device:
            found = next((name for name, ref in known.items() if (y - ref).abs().max().item() < 1e-6), None)
            if found is not None:
                return found
        raise UnsupportedModelError(f"the MLP's activation {path}.{attribute} ({type(act).__name__}) is none of "
                                    "those the inference engine runs (silu, gelu, gelu with tanh)",
                                    module=f"{path}.{attribute}")
    return None


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _is_conv1d(module: object) -> bool:
    """transformers' Conv1D (GPT-2): a Linear whose weight is stored (in, out)."""
    return type(module).__name__ == "Conv1D" and getattr(getattr(module, "weight", None), "dim", lambda: 0)() == 2


def _features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear or a Conv1D."""
    if _is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def _find_child(parent: nn.Module, role: str) -> str | None:
    return next((n for n in ROLE_NAMES[role]
                 if isinstance(getattr(parent, n, None), nn.Linear) or _is_conv1d(getattr(parent, n, None))), None)


def _block_paths(block: nn.Module, where: str) -> tuple[dict, nn.Module, nn.Module]:
    """Role -> path inside the block, and the attention and MLP modules."""
    attn = mlp = None
    paths: dict = {}
    for name, child in block.named_children():
        roles = {r: _find_child(child, r) for r in ROLE_NAMES}
        if attn is None and roles["o"] and (all(roles[r] for r in ("q", "k", "v")) or roles["qkv"]):
            attn = child
            found = ("q", "k", "v", "o") if all(roles[r] for r in ("q", "k", "v")) else ("qkv", "o")
            paths.update({r: f"{name}.{roles[r]}" for r in found})
        elif mlp is None and roles["down"] and (roles["up"] or roles["gate"] or roles["gate_up"]) and \
                child is not attn:
            mlp = child
            paths.update({r: f"{name}.{roles[r]}" for r in ("gate", "up", "down", "gate_up") if roles[r]})
    norms = [name for name, child in block.named_children() if _is_norm(child)]
    sandwich = len(norms) == 4 and set(norms) == set(SANDWICH_NORMS)
    missing = ([] if attn is not None else
               ["an attention module with q, k, v, o Linears (or fused q, k, v: qkv_proj, c_attn)"]) + \
              ([] if mlp is not None else ["an MLP module with up (and gate) and down Linears"]) + \
              ([] if len(norms) == 2 or sandwich else [f"two norms (found {len(norms)}: {norms})"])
    if "gate" in paths and "up" not in paths:
        missing.append("an MLP up Linear beside its gate")
    if missing:
        raise UnsupportedModelError(f"block {where} lacks {', '.join(missing)}: the inference engine runs pre-norm "
                                    "blocks x + attn(norm1(x)); x + mlp(norm2(x)) (see runtime/inference/"
                                    "decoder.py for the names it recognises)")
    if sandwich:
        paths.update({role: name for name, role in SANDWICH_NORMS.items()})
    else:
        paths["norm1"], paths["norm2"] = norms
    return paths, attn, mlp


def _outer_modules(model: nn.Module, prefix: str, vocab: int, hidden: int) -> dict:
    """Token and position embeddings, final norm and head: modules outside the blocks."""
    embeddings, norms, heads = [], [], []
    for name, module in model.named_modules():
        if name == prefix or name.startswith(prefix + "."):
            continue
        if isinstance(module, nn.Embedding):
            embeddings.append((name, module))
        elif isinstance(module, nn.Linear) and module.out_features == vocab and module.in_features == hidden:
            heads.append(name)
        elif _is_norm(module) and getattr(module, "weight", None) is not None:
            norms.append(name)
    tok = [n for n, m in embeddings if m.num_embeddings == vocab and m.embedding_dim == hidden]
    pos = [n for n, m in embeddings if n not in tok[:1] and m.embedding_dim == hidden]
    missing = ([] if tok else [f"a token embedding ({vocab}, {hidden})"]) + \
              ([] if len(norms) == 1 else [f"one final norm (found {norms})"]) + \
              ([] if len(heads) == 1 else [f"one output head Linear {hidden} -> {vocab} (found {heads})"]) + \
              ([] if len(pos) <= 1 else [f"at most one position embedding (found {pos})"])
    if missing:
        raise UnsupportedModelError(f"outside the blocks ({prefix}) the model lacks {', '.join(missing)}")
    return {"tok": tok[0], "norm": norms[0], "head": heads[0], **({"pos": pos[0]} if pos else {})}


def _submodule(block: nn.Module, path: str) -> nn.Module | None:
    try:
        return block.get_submodule(path)
    except AttributeError:
        return None


def recognise(model: nn.Module, summary: ModelSummary) -> DecoderSpec:
    """The model's architecture, or UnsupportedModelError naming what is missing (UnsupportedExpertsError for a
    mixture of experts). `model` materialised or on the meta device: the same answer (the module docstring)."""
    _refuse_experts(model)
    try:
        blocks = model.get_submodule(summary.block_prefix)
    except AttributeError as exc:
        raise UnsupportedModelError(f"the model has no block container {summary.block_prefix!r}") from exc
    if len(blocks) != summary.num_blocks:
        raise UnsupportedModelError(f"{summary.block_prefix} holds {len(blocks)} blocks, the summary says "
                                    f"{summary.num_blocks}: trace the model file again")
    paths, attn, mlp = _block_paths(blocks[0], f"{summary.block_prefix}.0")
    block0 = blocks[0]
    o_in = _features(block0.get_submodule(paths["o"]))[0]  # heads * head_dim
    head_dim = o_in // summary.heads
    paths.update(_head_norms(attn, paths["o"].rsplit(".", 1)[0], head_dim))
    for i, block in enumerate(blocks):  # every block like the first (the build-time check then tests the numbers)
        kinds = {role: type(_submodule(block, path)) for role, path in paths.items()}
        if kinds != {role: type(block0.get_submodule(path)) for role, path in paths.items()}:
            raise UnsupportedModelError(f"block {summary.block_prefix}.{i} differs from block 0 ({kinds}): the engine "
                                        "runs models whose blocks all have the same modules")
        _refuse_other_parameters(block, paths, f"{summary.block_prefix}.{i}")
    if head_dim * summary.heads != o_in:
        raise UnsupportedModelError(f"o has {o_in} input features, not a multiple of heads={summary.heads}")
    slices: dict = {}
    if "qkv" in paths:  # one Linear: q rows, then k, then v
        kv_width = (_features(block0.get_submodule(paths["qkv"]))[1] - o_in) // 2
        slices.update(q=(0, o_in), k=(o_in, o_in + kv_width), v=(o_in + kv_width, o_in + 2 * kv_width))
        paths.update(q=paths["qkv"], k=paths["qkv"], v=paths.pop("qkv"))
    else:
        kv_width = _features(block0.get_submodule(paths["k"]))[1]
    if kv_width <= 0 or kv_width % head_dim:
        raise UnsupportedModelError(f"k has {kv_width} features, not a multiple of head_dim={head_dim}")
    kv_heads = kv_width // head_dim
    if summary.heads % kv_heads:
        raise UnsupportedModelError(f"{summary.heads} query heads cannot share {kv_heads} key/value heads")
    if "gate_up" in paths:  # one Linear: gate rows, then up rows
        half = _features(block0.get_submodule(paths["gate_up"]))[1] // 2
        slices.update(gate=(0, half), up=(half, 2 * half))
        paths.update(gate=paths["gate_up"], up=paths.pop("gate_up"))
    transposed = frozenset(role for role in ("q", "k", "v", "o", "gate", "up", "down")
                           if role in paths and _is_conv1d(block0.get_submodule(paths[role])))
    mlp_path = paths["down"].rsplit(".", 1)[0]
    act = _activation(mlp, f"{summary.block_prefix}.0.{mlp_path}")
    gelu = next((m for m in mlp.modules() if isinstance(m, nn.GELU)), None)
    if "gate" in paths:
        kind = "geglu" if act in ("gelu", "gelu_tanh") else "swiglu"
    elif act == "silu":
        raise UnsupportedModelError(f"the MLP {summary.block_prefix}.0.{mlp_path} applies silu without a gate: the "
                                    "inference engine runs gelu MLPs, or silu / gelu gating two projections "
                                    "(SwiGLU, GeGLU)", module=f"{summary.block_prefix}.0.{mlp_path}")
    else:
        kind = "gelu"
    approximate = {"gelu_tanh": "tanh", "gelu": "none"}.get(act) or (gelu.approximate if gelu else "tanh")
    config = getattr(model, "config", None)  # a transformers model's
    rope = getattr(attn, "rope_theta", None)
    inv_freq, rope_scaling = (None, 1.0) if rope is not None else _rotary_module(model)
    outer = _outer_modules(model, summary.block_prefix, summary.vocab, summary.hidden)
    tok, head = model.get_submodule(outer["tok"]), model.get_submodule(outer["head"])
    down = block0.get_submodule(paths["down"])
    attn_path = paths["o"].rsplit(".", 1)[0]
    return DecoderSpec(
        num_layers=len(blocks), hidden=summary.hidden, heads=summary.heads, kv_heads=kv_heads, head_dim=head_dim,
        ffn_hidden=_features(down)[0], vocab=summary.vocab,
        norm1=_norm_of(block0.get_submodule(paths["norm1"]), paths["norm1"]),
        norm2=_norm_of(block0.get_submodule(paths["norm2"]), paths["norm2"]),
        final_norm=_norm_of(model.get_submodule(outer["norm"]), outer["norm"]),
        mlp=kind, gelu_approximate=approximate,
        rope_theta=None if rope is None else float(rope),
        position_rows=model.get_submodule(outer["pos"]).num_embeddings if "pos" in outer else 0,
        tied_head=_tied(head.weight, tok.weight),
        paths=paths, outer=outer, rope_inv_freq=inv_freq, rope_scaling=rope_scaling, slices=slices or None,
        transposed=transposed, attn_scale=_attention_scale(attn),
        attn_softcap=_float_or_none(getattr(attn, "attn_logit_softcapping", None)),
        logit_softcap=_float_or_none(getattr(config, "final_logit_softcapping", None)),
        embed_scale=_embed_scale(model, tok, summary.hidden),
        windows=tuple(_window(block.get_submodule(attn_path), config) for block in blocks),
        sandwich="post_attn_norm" in paths,
        head_norm=_norm_of(block0.get_submodule(paths["q_norm"]), paths["q_norm"]) if "q_norm" in paths else None,
    )


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)


def _head_norms(attn: nn.Module, attn_path: str, head_dim: int) -> dict[str, str]:
    """Qwen3's per-head q_norm and k_norm (RMSNorms over each head's head_dim features, before RoPE): role -> path
    inside the block, both or neither. A q/k norm over all heads at once (OLMo2's) is not this, and is refused."""
    found = {}
    for role in ("q_norm", "k_norm"):
        norm = getattr(attn, role, None)
        weight = getattr(norm, "weight", None)
        if isinstance(norm, nn.Module) and _is_norm(norm) and weight is not None and weight.numel() == head_dim:
            found[role] = f"{attn_path}.{role}"
    return found if len(found) == 2 else {}


def _refuse_experts(model: nn.Module) -> None:
    """UnsupportedExpertsError naming the first routed-experts module (model.experts.find_expert_layers: Mixtral,
    Qwen3-MoE, DeepSeek-V3, ...): the engine's blocks have one dense MLP."""
    layers = find_expert_layers(model)
    if not layers:
        return
    first = layers[0]
    more = len(layers) - 1
    more = f"; {more} more expert layer{'s' if more > 1 else ''} after it" if more else ""
    detail = (f"{type(model.get_submodule(first.path)).__name__}: {first.num_experts} routed experts, {first.top_k} "
              f"per token{more}")
    raise UnsupportedExpertsError(f"{first.path} ({detail}) routes each token to experts: {ENGINE_RUNS_NO_EXPERTS} "
                                  "(it runs dense decoders, one MLP per block)", module=first.path, detail=detail)


def _refuse_other_parameters(block: nn.Module, paths: dict, where: str) -> None:
    """UnsupportedModelError naming the modules of `block` whose parameters no role in `paths` (block-relative
    module paths) accounts for: the engine packs those roles' weights only, so anything else (Qwen3's per-head
    q_norm / k_norm, an attention sink, a router beside the MLP) would be dropped."""
    known = set(paths.values())
    others: dict[str, None] = {}
    for name, _ in block.named_parameters():
        owner = parent_path(name)
        if owner not in known:
            others[owner if owner not in ("", *{parent_path(p) for p in known}) else name] = None
    if others:
        named = ", ".join(f"{path} ({type(block.get_submodule(path)).__name__})"
                          if isinstance(_submodule(block, path), nn.Module) else path for path in others)
        first = f"{where}.{next(iter(others))}"
        raise UnsupportedModelError(f"block {where} has parameters the inference engine does not run: {named} (it "
                                    "runs q, k, v, o, the MLP's gate / up / down and the block's norms; per-head "
                                    "q/k norms, extra norms and routers are not among them)", module=first)


def _tied(head: torch.Tensor, tok: torch.Tensor) -> bool:
    """The head's weight is the token table's: the same tensor, or (materialised) the same memory. On the meta device
    every data_ptr() is 0, so identity alone tells."""
    if head is tok:
        return True
    return not (head.is_meta or tok.is_meta) and head.data_ptr() == tok.data_ptr()


def _rotary_module(model: nn.Module) -> tuple[tuple[float, ...] | None, float]:
    """(inv_freq (r/2,), cos/sin scaling) of the model's rotary module (transformers': a buffer inv_freq), or
    (None, 1.0) without one. On the meta device inv_freq is computed from the model's config (_meta_inv_freq)."""
    found = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not found:
        return None, 1.0
    if len({id(m.inv_freq) if m.inv_freq.is_meta else m.inv_freq.data_ptr() for m in found}) > 1:
        raise UnsupportedModelError(f"the model has {len(found)} rotary embeddings: the engine runs one")
    rotary = found[0]
    if getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):  # inv_freq changes with the length
        raise UnsupportedModelError(f"RoPE type {rotary.rope_type!r} changes its frequencies with the sequence "
                                    "length, which the engine's fixed table does not")
    inv_freq = _meta_inv_freq(rotary, model) if rotary.inv_freq.is_meta else rotary.inv_freq.detach()
    return tuple(inv_freq.float().tolist()), float(getattr(rotary, "attention_scaling", 1.0))


def _meta_inv_freq(rotary: nn.Module, model: nn.Module) -> torch.Tensor:
    """inv_freq of a rotary module on the meta device, as materialising the model computes it: the module's own
    constructor run on the CPU with its config (transformers' rotary modules: the rope type's init function reads
    rope_parameters / rope_theta, rope_scaling, partial_rotary_factor and head_dim), else its rope_init_fn (older
    transformers), else the default RoPE from the model config's rope theta (base ** (-2i / r), r = 2 * len(inv_freq));
    NaNs where none applies (a model file's own rotary module: compile needs only that there is one)."""
    shape = rotary.inv_freq.shape
    config = getattr(rotary, "config", None)
    with torch.device("cpu"):
        if config is not None:
            for make in (lambda: type(rotary)(config).inv_freq, lambda: rotary.rope_init_fn(config, "cpu")[0]):
                try:
                    inv_freq = make()
                except Exception:  # another constructor's signature, no rope_init_fn: the next way
                    continue
                if isinstance(inv_freq, torch.Tensor) and not inv_freq.is_meta and inv_freq.shape == shape:
                    return inv_freq
        theta = _config_rope_theta(getattr(model, "config", None))
        if theta is not None and getattr(rotary, "rope_type", "default") == "default":
            dim = 2 * shape[-1]
            return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return torch.full(shape, float("nan"))


def _config_rope_theta(config) -> float | None:
    """The RoPE base of a transformers config: rope_parameters["rope_theta"] (transformers 5), else rope_theta."""
    parameters = getattr(config, "rope_parameters", None)
    theta = parameters.get("rope_theta") if isinstance(parameters, dict) else None
    theta = theta if theta is not None else getattr(config, "rope_theta", None)
    return float(theta) if isinstance(theta, (int, float)) else None


def _attention_scale(attn: nn.Module) -> float | None:
    """transformers' attention `scaling` (Gemma 2: query_pre_attn_scalar ** -0.5); GPT-2 without
    scale_attn_weights: 1; None: head_dim ** -0.5."""
    if getattr(attn, "scale_attn_by_inverse_layer_idx", False):
        raise UnsupportedModelError("scale_attn_by_inverse_layer_idx scales each layer's scores differently, "
                                    "which the engine does not")
    if getattr(attn, "scale_attn_weights", True) is False:
        return 1.0
    scaling = getattr(attn, "scaling", None)
    return float(scaling) if isinstance(scaling, (int, float)) else None


def _embed_scale(model: nn.Module, tok: nn.Module, hidden: int) -> float | None:
    """Gemma's sqrt(hidden) on the token embeddings (its model's forward, or a scaled embedding's embed_scale)."""
    scale = getattr(tok, "embed_scale", None)
    if isinstance(scale, torch.Tensor) and scale.is_meta:  # a scaled embedding's buffer (Gemma): its float beside it
        value = getattr(tok, "scalar_embed_scale", None)  # rounded to the buffer's dtype, as materialised
        scale = torch.tensor(float(value)).to(scale.dtype) if isinstance(value, (int, float)) else None
    if isinstance(scale, (int, float, torch.Tensor)):
        return float(scale)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return hidden ** 0.5 if model_type in ("gemma", "gemma2") else None


def _window(attn: nn.Module, config) -> int | None:
    """The layer's sliding attention window: its attention's sliding_window (Qwen2, Gemma 2: None on full layers),
    else the config's (Mistral, Phi-3), else None."""
    if hasattr(attn, "sliding_window"):
        window = attn.sliding_window
    else:
        window = getattr(config, "sliding_window", None)
    return int(window) if isinstance(window, int) and window > 0 else None
