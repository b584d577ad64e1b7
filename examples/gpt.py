"""A GPT-3 style decoder (Brown et al. 2020): learned position embedding, pre-LayerNorm blocks,
multi-head causal attention, a 4h GELU MLP, biases everywhere, output head tied to the token embedding.

The default sizes are GPT-3 175B; zplan builds it on the meta device, so planning allocates nothing.
Pass other sizes to build_model(), e.g. build_model(num_layers=4, hidden=256, heads=4).

zplan reads this file: build_model() returns the nn.Module, SEQ_LEN is the default sequence length and
VOCAB_SIZE the token range of the synthetic training data. The file needs no zplan import.
"""

import torch
import torch.nn.functional as F
from torch import nn

NUM_LAYERS = 96
HIDDEN = 12288
HEADS = 96
VOCAB_SIZE = 51200
SEQ_LEN = 2048


class CausalSelfAttention(nn.Module):
    """Separate q, k, v projections so tensor parallelism splits heads without regrouping."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, h)
        batch, seq, _ = x.shape
        # view(B, T, -1, head_dim): under tensor parallelism each rank keeps its own heads.
        q = self.q(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, a, T, d)
        k = self.k(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, a, T, d)
        v = self.v(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, a, T, d)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, a, T, d)
        y = y.transpose(1, 2).reshape(batch, seq, -1)  # (B, T, a*d)
        return self.o(y)  # (B, T, h)


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.up = nn.Linear(hidden, ffn_hidden)
        self.act = nn.GELU(approximate="tanh")
        self.down = nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        return self.down(self.act(self.up(x)))  # (B, T, f) inside


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn_hidden: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, num_layers: int, hidden: int, heads: int, ffn_hidden: int, vocab_size: int,
                 max_seq_len: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
        self.wte = nn.Embedding(vocab_size, hidden)
        self.wpe = nn.Embedding(max_seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn_hidden) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied output head
        if self.lm_head.weight.device.type != "meta":  # on meta there are no values to initialise
            self.init_weights()

    def init_weights(self) -> None:
        """Initialise all weights; call it again after materialising a meta-built model (to_empty)."""
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) token ids -> (B, T, V) logits; position_ids (B, T): the tokens' positions (default 0..T-1)."""
        positions = torch.arange(idx.size(1), device=idx.device) if position_ids is None else position_ids  # (T,)
        x = self.wte(idx) + self.wpe(positions)  # (B, T, h)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V) logits


def _init_weights(module: nn.Module) -> None:
    """GPT-2 initialisation: normal(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model(num_layers: int = NUM_LAYERS, hidden: int = HIDDEN, heads: int = HEADS,
                ffn_hidden: int | None = None, vocab_size: int = VOCAB_SIZE,
                max_seq_len: int = SEQ_LEN) -> nn.Module:
    """GPT-3 175B by default; ffn_hidden defaults to 4 * hidden."""
    return GPT(num_layers, hidden, heads, ffn_hidden or 4 * hidden, vocab_size, max_seq_len)
