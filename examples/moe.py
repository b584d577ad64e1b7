"""A mixture-of-experts decoder (Mixtral-style, Jiang et al. 2024): the Llama decoder of examples/llama.py with its
MLP replaced by E SwiGLU experts of which a learned router picks the top k for each token, their outputs weighted by
the router's renormalised probabilities. Like transformers' Mixtral with its default output_router_logits=False, it
trains on the language-model loss alone (no load-balancing loss).

The experts are stored as transformers 5 stores them (zplan.model.experts recognises both): gate_up_proj (E, 2F, h)
and down_proj (E, h, F) beside a router whose weight is (E, h), called as experts(hidden (T, h), top_k_index (T, k),
top_k_weights (T, k)). The default sizes are Mixtral-8x7B's; build_model(num_layers=2, hidden=64, ...) for a small
one. zplan builds it on the meta device and prices the experts by top-k; the experts' loop below runs the tokens
each expert was given, the same FLOPs.
"""

import torch
import torch.nn.functional as F
from torch import nn

from zplan.examples.llama import Attention

NUM_LAYERS = 32
HIDDEN = 4096
HEADS = 32
KV_HEADS = 8
EXPERT_FFN_HIDDEN = 14336
NUM_EXPERTS = 8
TOP_K = 2
VOCAB_SIZE = 32000
SEQ_LEN = 4096
ROPE_THETA = 1e6


class Router(nn.Module):
    """Each token's top-k experts and their weights (softmax over all experts, renormalised over the k)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x (T, h)
        probs = F.linear(x, self.weight).float().softmax(dim=-1)  # (T, E)
        weights, index = probs.topk(self.top_k, dim=-1)  # (T, k) each
        return index, (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)


class Experts(nn.Module):
    """E SwiGLU experts, their weights stacked: down(silu(gate(x)) * up(x)) for the tokens routed to each. It
    declares its layout as transformers 5's experts do (has_gate, has_bias, is_transposed, _apply_gate), which lets
    zplan's runtime run it as its own executor (grouped, expert-parallel) with the same numbers."""

    has_gate, has_bias, is_transposed = True, False, False  # gate_up (E, 2F, h), down (E, h, F), no biases

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden))

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:  # (n, 2F) -> (n, F)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        flat = top_k_index.reshape(-1)  # (T*k,) expert of each routed copy
        order = flat.argsort(stable=True)  # routed copies grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # tokens per expert (host: the loop)
        routed = x[order // top_k]  # (T*k, h)
        outputs = []
        for expert, part in enumerate(routed.split(counts)):
            inner = self._apply_gate(F.linear(part, self.gate_up_proj[expert]))  # (n, F)
            outputs.append(F.linear(inner, self.down_proj[expert]))  # (n, h)
        combined = torch.empty_like(routed).index_copy(0, order, torch.cat(outputs))  # back in (token, k) order
        weighted = combined.view(tokens, top_k, -1) * top_k_weights.unsqueeze(-1)  # (T, k, h)
        return weighted.sum(dim=1)  # (T, h)


class MoE(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.gate = Router(hidden, num_experts, top_k)
        self.experts = Experts(hidden, ffn_hidden, num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        flat = x.reshape(-1, x.shape[-1])  # (B*T, h)
        index, weights = self.gate(flat)
        return self.experts(flat, index, weights).view_as(x)


class Block(nn.Module):
    def __init__(self, hidden, heads, kv_heads, ffn_hidden, num_experts, top_k, rope_theta):
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.attn = Attention(hidden, heads, kv_heads, rope_theta)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.mlp = MoE(hidden, ffn_hidden, num_experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class MixtureOfExperts(nn.Module):
    def __init__(self, num_layers, hidden, heads, kv_heads, ffn_hidden, num_experts, top_k, vocab_size, rope_theta):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, kv_heads, ffn_hidden, num_experts, top_k, rope_theta)
                                    for _ in range(num_layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)
        if self.lm_head.weight.device.type != "meta":
            self.init_weights()

    def init_weights(self) -> None:
        for param in self.parameters():
            if param.dim() >= 2:  # matrices and stacked experts; norms keep their ones
                nn.init.normal_(param, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) token ids -> (B, T, V) logits
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build_model(num_layers: int = NUM_LAYERS, hidden: int = HIDDEN, heads: int = HEADS, kv_heads: int = KV_HEADS,
                ffn_hidden: int = EXPERT_FFN_HIDDEN, num_experts: int = NUM_EXPERTS, top_k: int = TOP_K,
                vocab_size: int = VOCAB_SIZE, rope_theta: float = ROPE_THETA) -> nn.Module:
    """Mixtral-8x7B's sizes by default."""
    return MixtureOfExperts(num_layers, hidden, heads, kv_heads, ffn_hidden, num_experts, top_k, vocab_size,
                            rope_theta)
