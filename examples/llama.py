"""A Llama-style decoder (Touvron et al. 2023; Llama 3, Dubey et al. 2024): RMSNorm, SwiGLU MLP,
grouped-query attention, rotary position embedding (RoPE), no biases, untied output head.

The default sizes are Llama 3 8B; zplan builds it on the meta device, so planning allocates nothing.
Pass other sizes to build_model(), e.g. build_model(num_layers=4, hidden=256, heads=8, kv_heads=2).

zplan reads this file: build_model() returns the nn.Module, SEQ_LEN is the default sequence length and
VOCAB_SIZE the token range of the synthetic training data. The file needs no zplan import.
"""

import torch
import torch.nn.functional as F
from torch import nn

NUM_LAYERS = 32
HIDDEN = 4096
HEADS = 32
KV_HEADS = 8
FFN_HIDDEN = 14336
VOCAB_SIZE = 128256
SEQ_LEN = 8192
ROPE_THETA = 500000.0


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, like: torch.Tensor,
                   position_ids: torch.Tensor | None = None):
    """cos and sin of RoPE angles (Su et al. 2021), each (T, d) for positions 0..T-1, or (B, 1, T, d) for the given
    (B, T) position_ids (context parallel hands each rank its tokens' global positions), in the dtype and device of
    `like`."""
    exponents = torch.arange(0, head_dim, 2, device=like.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)  # (d/2,)
    if position_ids is None:
        positions = torch.arange(seq_len, device=like.device, dtype=torch.float32)  # (T,)
        angles = torch.outer(positions, inv_freq)  # (T, d/2)
    else:
        angles = (position_ids.float()[..., None] * inv_freq).unsqueeze(1)  # (B, 1, T, d/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, d) or (B, 1, T, d)
    return angles.cos().to(like.dtype), angles.sin().to(like.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate half the head dimensions: x (B, H, T, d), cos/sin (T, d)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (B, H, T, d)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query attention: `heads` query heads share `kv_heads` key/value heads."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, rope_theta: float):
        super().__init__()
        self.head_dim = hidden // heads
        self.rope_theta = rope_theta
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:  # x: (B, T, h)
        batch, seq, _ = x.shape
        # view(B, T, -1, head_dim): under tensor parallelism each rank keeps its own heads.
        q = self.q(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, a, T, d)
        k = self.k(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, a_kv, T, d)
        v = self.v(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, a_kv, T, d)
        cos, sin = rotary_cos_sin(seq, self.head_dim, self.rope_theta, like=x, position_ids=position_ids)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, a, T, d)
        y = y.transpose(1, 2).reshape(batch, seq, -1)  # (B, T, a*d)
        return self.o(y)  # (B, T, h)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer 2020)."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        return self.down(F.silu(self.gate(x)) * self.up(x))  # (B, T, f) inside


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, rope_theta: float):
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.attn = Attention(hidden, heads, kv_heads, rope_theta)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.mlp = SwiGLU(hidden, ffn_hidden)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:  # (B, T, h)
        x = x + self.attn(self.attn_norm(x), position_ids)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, num_layers: int, hidden: int, heads: int, kv_heads: int, ffn_hidden: int,
                 vocab_size: int, rope_theta: float):
        super().__init__()
        if hidden % heads or heads % kv_heads:
            raise ValueError(f"need hidden % heads == 0 and heads % kv_heads == 0, got "
                             f"hidden={hidden}, heads={heads}, kv_heads={kv_heads}")
        self.embed = nn.Embedding(vocab_size, hidden)
        self.layers = nn.ModuleList(
            Block(hidden, heads, kv_heads, ffn_hidden, rope_theta) for _ in range(num_layers)
        )
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)
        if self.lm_head.weight.device.type != "meta":  # on meta there are no values to initialise
            self.init_weights()

    def init_weights(self) -> None:
        """Initialise all weights; call it again after materialising a meta-built model (to_empty)."""
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) token ids -> (B, T, V) logits; position_ids (B, T): the tokens' positions (default 0..T-1)."""
        x = self.embed(idx)  # (B, T, h)
        for layer in self.layers:
            x = layer(x) if position_ids is None else layer(x, position_ids)
        return self.lm_head(self.norm(x))  # (B, T, V) logits


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def build_model(num_layers: int = NUM_LAYERS, hidden: int = HIDDEN, heads: int = HEADS,
                kv_heads: int = KV_HEADS, ffn_hidden: int = FFN_HIDDEN, vocab_size: int = VOCAB_SIZE,
                rope_theta: float = ROPE_THETA) -> nn.Module:
    """Llama 3 8B by default."""
    return Llama(num_layers, hidden, heads, kv_heads, ffn_hidden, vocab_size, rope_theta)
