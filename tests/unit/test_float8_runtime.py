"""runtime/precision/float8.py on one process: which Linears become torchao Float8Linears, how close fp8 GEMMs come to
bf16's, the device rule, and fp8 under activation recompute.

The model is a two-block toy in bf16 (B=4, T=32, h=64): each block an MLP 64 -> 256 -> 64 (dims multiples of 16:
converted) and a 64 -> 10 Linear (10 is not: kept), then an embedding and a head outside the blocks (never converted).
Tolerances, measured on this machine against the same weights in bf16 over 5 batches: loss relative difference
0.8e-4 to 3.3e-4, logits 1.4 % to 1.5 % (relative L2), the first block's up-projection weight gradient 8.7 % to 9.0 %
(its GEMM takes the output gradient in e5m2, 2 mantissa bits, and the input in e4m3, 3 bits: relative rounding up to
2^-3 and 2^-4 per element). The bounds are 3x (loss), 2x (logits) and 1.7x (gradient) those, and the fp8 logits must
differ from bf16's (else nothing ran in fp8). torch._scaled_mm against torchao's emulation: logits and gradients
within 1.7e-4 (bf16 rounding of the outputs), bound 1e-3.
"""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from zplan.errors import PlanMismatchError

pytest.importorskip("torchao")

from zplan.runtime.precision.float8 import convert_blocks_to_float8, float8_emulated  # noqa: E402

VOCAB, HIDDEN, BATCH, SEQ = 100, 64, 4, 32


class Block(nn.Module):
    def __init__(self, h: int, odd: int = 10):
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.side = nn.Linear(h, odd)  # out features not a multiple of 16: stays bf16

    def forward(self, x):  # (B, T, h)
        return x + self.down(F.gelu(self.up(x))) + self.side(x).mean(-1, keepdim=True)


class Toy(nn.Module):
    def __init__(self, h: int = HIDDEN, odd: int = 10):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, h)
        self.blocks = nn.ModuleList([Block(h, odd) for _ in range(2)])
        self.head = nn.Linear(h, VOCAB)  # outside the blocks: never converted (its dims are multiples of 4 only)

    def forward(self, tokens):  # (B, T) -> (B, T, V)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _models(**kwargs):
    torch.manual_seed(0)
    bf16 = Toy(**kwargs).to(torch.bfloat16)
    return bf16, copy.deepcopy(bf16)


def _loss_and_grads(model, tokens):
    logits = model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    return logits.detach().float(), loss.item(), model.blocks[0].up.weight.grad.float()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_block_linears_convert_and_the_head_does_not():
    bf16, fp8 = _models()
    params_before = dict(fp8.named_parameters())
    converted = convert_blocks_to_float8(fp8, "blocks", "cpu", say=lambda message: None)
    assert converted == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"]
    assert type(fp8.blocks[0].up).__name__ == "Float8Linear"
    assert type(fp8.blocks[0].side) is nn.Linear and type(fp8.head) is nn.Linear
    # the same Parameter objects under the same names: init replay, optimizers and checkpoints see no change
    assert {name: id(p) for name, p in fp8.named_parameters()} == {name: id(p) for name, p in params_before.items()}


def test_fp8_loss_and_gradients_close_to_bf16():
    bf16, fp8 = _models()
    convert_blocks_to_float8(fp8, "blocks", "cpu", say=lambda message: None)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    logits_ref, loss_ref, grad_ref = _loss_and_grads(bf16, tokens)
    logits, loss, grad = _loss_and_grads(fp8, tokens)
    print(f"loss {loss:.6f} vs bf16 {loss_ref:.6f}; logits rel {_rel(logits, logits_ref):.2e}; "
          f"grad rel {_rel(grad, grad_ref):.2e}")
    assert abs(loss - loss_ref) / loss_ref < 1e-3
    assert _rel(grad, grad_ref) < 0.15
    assert 0 < _rel(logits, logits_ref) < 3e-2  # fp8 ran (not bit-equal to bf16) and stayed close


def test_scaled_mm_path_matches_torchao_emulation():
    """The CPU runs torch._scaled_mm (float8_emulated: False), the GPU's path; torchao's emulation (the GEMM on the
    dequantized fp8 tensors) must agree up to the bf16 rounding of the outputs (module docstring)."""
    assert float8_emulated(torch.device("cpu")) is False
    _, real = _models()
    emulated = copy.deepcopy(real)
    convert_blocks_to_float8(real, "blocks", "cpu", say=lambda message: None)
    convert_blocks_to_float8(emulated, "blocks", "cpu", say=lambda message: None, emulate=True)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    logits_a, _, grad_a = _loss_and_grads(real, tokens)
    logits_b, _, grad_b = _loss_and_grads(emulated, tokens)
    assert _rel(logits_a, logits_b) < 1e-3 and _rel(grad_a, grad_b) < 1e-3


def test_no_convertible_linear_is_refused():
    _, model = _models(h=40, odd=10)  # 40 -> 160 -> 40: 40 is not a multiple of 16
    with pytest.raises(PlanMismatchError, match=r"no Linear under blocks .* multiples of 16.*--precision bf16"):
        convert_blocks_to_float8(model, "blocks", "cpu", say=lambda message: None)


def test_device_rule(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # A100
    with pytest.raises(PlanMismatchError, match=r"compute capability 8\.0.*no fp8 tensor cores"):
        float8_emulated(torch.device("cuda", 0))
    for capability in ((8, 9), (9, 0), (10, 0)):  # L40S, H100, B200
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert float8_emulated(torch.device("cuda", 0)) is False


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_fp8_under_activation_recompute_gives_the_same_gradients(mode):
    """Recompute reruns the fp8 casts and GEMMs in backward (the selective policy keeps aten._scaled_mm's outputs):
    the same values, so the same gradients, bit for bit."""
    from zplan.runtime.training.recompute import apply_recompute

    _, plain = _models()
    recomputed = copy.deepcopy(plain)
    for model in (plain, recomputed):
        convert_blocks_to_float8(model, "blocks", "cpu", say=lambda message: None)
    apply_recompute(recomputed, mode, "blocks")
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    _, loss_a, grad_a = _loss_and_grads(plain, tokens)
    _, loss_b, grad_b = _loss_and_grads(recomputed, tokens)
    assert loss_a == loss_b and torch.equal(grad_a, grad_b)
