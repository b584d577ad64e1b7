"""A tiny GPT (2 layers, hidden 64, 4 heads, vocabulary 256) that trains on a CPU in seconds.

Same structure as examples/gpt.py (pre-LayerNorm blocks in `blocks`, separate q/k/v projections,
causal scaled_dot_product_attention, tied output head), written out again so this file stands alone.
train_data() yields arithmetic token sequences that the model learns within a few dozen steps, so a
falling loss shows that training works. The file needs no zplan import.
"""

import torch
import torch.nn.functional as F
from torch import nn

NUM_LAYERS = 2
HIDDEN = 64
HEADS = 4
VOCAB_SIZE = 256
SEQ_LEN = 64


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, h)
        batch, seq, _ = x.shape
        q = self.q(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, a, T, d)
        k = self.k(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, a, T, d)
        v = self.v(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, a, T, d)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, a, T, d)
        return self.o(y.transpose(1, 2).reshape(batch, seq, -1))  # (B, T, h)


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU(approximate="tanh")
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, num_layers: int, hidden: int, heads: int, vocab_size: int, max_seq_len: int):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, hidden)
        self.wpe = nn.Embedding(max_seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied output head
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2 initialisation: normal(0, 0.02) weights, zero biases; call again after to_empty()."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) token ids -> (B, T, V) logits; position_ids (B, T): the tokens' positions (default 0..T-1)."""
        positions = torch.arange(idx.size(1), device=idx.device) if position_ids is None else position_ids  # (T,)
        x = self.wte(idx) + self.wpe(positions)  # (B, T, h)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V) logits


def build_model(num_layers: int = NUM_LAYERS, hidden: int = HIDDEN, heads: int = HEADS,
                vocab_size: int = VOCAB_SIZE, max_seq_len: int = SEQ_LEN) -> nn.Module:
    return TinyGPT(num_layers, hidden, heads, vocab_size, max_seq_len)


def train_data(batch_size: int, seq_len: int, seed: int = 0):
    """Endless batches of token ids (B, T): token_t = (start + t * stride) mod V, with a random start
    and a stride from {1, 2, 3} per row, so the next token follows from the previous two."""
    generator = torch.Generator().manual_seed(seed)
    steps = torch.arange(seq_len)  # (T,)
    while True:
        start = torch.randint(0, VOCAB_SIZE, (batch_size, 1), generator=generator)  # (B, 1)
        stride = torch.randint(1, 4, (batch_size, 1), generator=generator)  # (B, 1)
        yield (start + steps * stride) % VOCAB_SIZE  # (B, T)
