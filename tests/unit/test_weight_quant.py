"""Group-wise weight quantization (zplan.cuda.weight_quant references, runtime.compression.quantized_weights):
hand-computed INT8/INT4 examples, the int4 packing, the round-trip bound, zero groups, bad arguments, the tiny
model's logits after quantization (cosine similarity and size printed), and QAT (STE, training, conversion).

Hand examples use scales that are powers of two, so every value below is exact; several elements sit on x.5
levels to check round-half-to-even.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zplan.cuda.weight_quant import (
    dequantize_groupwise,
    fake_quantize,
    nbytes,
    pack_int4,
    quantize_groupwise,
    unpack_int4,
)
from zplan.examples import tiny
from zplan.runtime.compression.quantized_weights import (
    FakeQuantLinear,
    QuantizedLinear,
    convert_qat,
    linear_weight_bytes,
    prepare_qat,
    quantize_model,
    weight_bytes,
)

T = torch.tensor

# --- hand-computed examples: (2, 8) weights, group_size 4, row 1 = row 0 with its two groups swapped ------------


def two_rows(a: list[float], b: list[float]) -> torch.Tensor:
    return T([a + b, b + a])


def test_int8_symmetric_by_hand():
    a = [127.0, -3.4, 2.5, 0.6]  # absmax 127 -> scale 1; 2.5 -> 2 (half to even), 0.6 -> 1
    b = [-63.5, 1.0, 0.25, 0.75]  # absmax 63.5 -> scale 0.5; levels -127, 2, 0.5 -> 0, 1.5 -> 2
    qw = quantize_groupwise(two_rows(a, b), bits=8, group_size=4, symmetric=True)
    qa, qb = [127, -3, 2, 1], [-127, 2, 0, 2]
    assert qw.qweight.dtype == torch.int8 and torch.equal(qw.qweight, T([qa + qb, qb + qa], dtype=torch.int8))
    assert torch.equal(qw.scales, T([[1.0, 0.5], [0.5, 1.0]])) and qw.zeros is None
    assert torch.equal(dequantize_groupwise(qw), two_rows([127.0, -3.0, 2.0, 1.0], [-63.5, 1.0, 0.0, 1.0]))
    assert nbytes(qw) == 16 + 4 * 4


def test_int4_symmetric_by_hand():
    a = [7.0, -3.5, 0.5, 1.5]  # scale 1: levels 7, -4 (-3.5 to even), 0, 2 -> nibbles (+8) 15, 4, 8, 10
    b = [-14.0, 2.0, 3.0, -1.0]  # scale 2: levels -7, 1, 2 (1.5 to even), 0 (-0.5 to even) -> 1, 9, 10, 8
    qw = quantize_groupwise(two_rows(a, b), bits=4, group_size=4, symmetric=True)
    ba, bb = [0x4F, 0xA8], [0x91, 0x8A]  # column 2j in the low nibble: 15 | 4 << 4, 8 | 10 << 4, ...
    assert qw.qweight.dtype == torch.uint8 and torch.equal(qw.qweight, T([ba + bb, bb + ba], dtype=torch.uint8))
    assert torch.equal(qw.scales, T([[1.0, 2.0], [2.0, 1.0]])) and qw.zeros is None
    assert torch.equal(dequantize_groupwise(qw), two_rows([7.0, -4.0, 0.0, 2.0], [-14.0, 2.0, 4.0, 0.0]))
    assert nbytes(qw) == 8 + 4 * 4


def test_int8_asymmetric_by_hand():
    c = [-1.0, 0.0, 2.984375, 0.5078125]  # range 255/64 -> scale 1/64, zero 64; 0.5078125 * 64 = 32.5 -> 32
    d = [-100.5, 154.5, 0.0, 3.5]  # range 255 -> scale 1, zero round(100.5) = 100; -100.5 -> -100, 154.5 -> 154
    qw = quantize_groupwise(two_rows(c, d), bits=8, group_size=4, symmetric=False)
    qc, qd = [0, 64, 255, 96], [0, 254, 100, 104]
    assert qw.qweight.dtype == torch.uint8 and torch.equal(qw.qweight, T([qc + qd, qd + qc], dtype=torch.uint8))
    assert torch.equal(qw.scales, T([[1 / 64, 1.0], [1.0, 1 / 64]]))
    assert torch.equal(qw.zeros, T([[64, 100], [100, 64]], dtype=torch.uint8))
    assert torch.equal(dequantize_groupwise(qw), two_rows([-1.0, 0.0, 2.984375, 0.5], [-100.0, 154.0, 0.0, 4.0]))
    assert nbytes(qw) == 16 + 4 * 4 + 4


def test_int4_asymmetric_by_hand():
    e = [-1.0, 0.0, 2.75, 0.625]  # range 3.75 -> scale 0.25, zero 4; levels 0, 4, 15, 2.5 -> 2 (+4) = 6
    f = [1.0, 2.0, 3.0, 7.5]  # all positive: the range still holds 0 -> scale 0.5, zero 0; levels 2, 4, 6, 15
    qw = quantize_groupwise(two_rows(e, f), bits=4, group_size=4, symmetric=False)
    be, bf = [0x40, 0x6F], [0x42, 0xF6]
    assert torch.equal(qw.qweight, T([be + bf, bf + be], dtype=torch.uint8))
    assert torch.equal(qw.scales, T([[0.25, 0.5], [0.5, 0.25]]))
    assert torch.equal(qw.zeros, T([[4, 0], [0, 4]], dtype=torch.uint8))
    assert torch.equal(dequantize_groupwise(qw), two_rows([-1.0, 0.0, 2.75, 0.5], [1.0, 2.0, 3.0, 7.5]))
    assert nbytes(qw) == 8 + 16 + 4


def test_int4_packing_layout():
    nibbles = T([[1, 2, 3, 4, 15, 0], [0, 15, 7, 8, 9, 10]], dtype=torch.uint8)
    packed = pack_int4(nibbles)
    assert torch.equal(packed, T([[0x21, 0x43, 0x0F], [0xF0, 0x87, 0xA9]], dtype=torch.uint8))
    assert torch.equal(unpack_int4(packed), nibbles)
    # through the quantizer: asymmetric, scale 1, zero 0 -> the levels are the values themselves
    w = T([[0.0, 15.0, 1.0, 14.0]])
    assert torch.equal(quantize_groupwise(w, 4, 4, symmetric=False).qweight, T([[0xF0, 0xE1]], dtype=torch.uint8))


# --- properties on random weights -------------------------------------------------------------------------------

MODES = [(8, True), (8, False), (4, True), (4, False)]


def random_weight(rows: int = 16, cols: int = 256, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    row_scale = torch.logspace(-3, 1, rows).unsqueeze(1)  # rows of very different magnitude
    return torch.randn(rows, cols, generator=gen) * row_scale + 0.1 * row_scale * torch.rand(rows, 1, generator=gen)


@pytest.mark.parametrize("bits,symmetric", MODES)
@pytest.mark.parametrize("group_size", [2, 32, 256])
def test_round_trip_within_half_a_step(bits, symmetric, group_size):
    w = random_weight()
    qw = quantize_groupwise(w, bits, group_size, symmetric)
    w_hat = dequantize_groupwise(qw)
    assert w_hat.dtype == torch.float32 and w_hat.shape == w.shape
    step = qw.scales.repeat_interleave(group_size, dim=1)  # (rows, cols)
    eps = torch.finfo(torch.float32).eps
    assert ((w - w_hat).abs() <= step / 2 + 4 * eps * w.abs()).all()
    # the step is what the mode says: max|x| / qmax or (max(x, 0) - min(x, 0)) / qmax
    groups = w.reshape(w.shape[0], -1, group_size)
    if symmetric:
        expected = groups.abs().amax(-1) / (2 ** (bits - 1) - 1)
    else:
        expected = (groups.amax(-1).clamp(min=0) - groups.amin(-1).clamp(max=0)) / (2**bits - 1)
    torch.testing.assert_close(qw.scales, expected, rtol=1e-6, atol=0)
    if symmetric:  # the largest |x| of each group lands on +-qmax
        levels = w_hat.reshape_as(groups) / qw.scales.unsqueeze(-1)
        assert torch.equal(levels.abs().amax(-1).round(), torch.full_like(qw.scales, 2 ** (bits - 1) - 1))


@pytest.mark.parametrize("bits,symmetric", MODES)
def test_zero_groups_give_zeros_not_nan(bits, symmetric):
    w = random_weight(rows=3, cols=16)
    w[1, 4:8] = 0.0  # one all-zero group
    w[2] = 0.0  # an all-zero row
    qw = quantize_groupwise(w, bits, 4, symmetric)
    w_hat = dequantize_groupwise(qw)
    assert torch.isfinite(qw.scales).all() and torch.isfinite(w_hat).all()
    assert qw.scales[1, 1] == 1.0 and (qw.scales[2] == 1.0).all()
    assert torch.equal(w_hat[1, 4:8], torch.zeros(4)) and torch.equal(w_hat[2], torch.zeros(16))
    zero_byte = 0x88 if (bits, symmetric) == (4, True) else 0  # symmetric int4 stores level 0 as nibble 8
    assert (qw.qweight[2] == zero_byte).all()
    if not symmetric:
        assert (qw.zeros[2] == 0).all()


@pytest.mark.parametrize("bits,symmetric", MODES)
def test_empty_weight(bits, symmetric):
    qw = quantize_groupwise(torch.empty(0, 8), bits, 4, symmetric)
    assert qw.qweight.shape == (0, 8 if bits == 8 else 4) and qw.scales.shape == (0, 2) and nbytes(qw) == 0
    assert dequantize_groupwise(qw).shape == (0, 8)


def test_half_precision_input_quantizes_its_fp32_value():
    w = random_weight(rows=4, cols=64).to(torch.bfloat16)
    a, b = quantize_groupwise(w, 4, 32, False), quantize_groupwise(w.float(), 4, 32, False)
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales) and torch.equal(a.zeros, b.zeros)


@pytest.mark.parametrize("shape,bits,group_size,match", [
    ((4, 8), 3, 4, "bits must be 4 or 8"),
    ((4, 8), 16, 4, "bits must be 4 or 8"),
    ((4, 8), 8, 3, "must be positive and divide cols"),
    ((4, 8), 8, 0, "must be positive and divide cols"),
    ((4, 8), 8, 16, "must be positive and divide cols"),
    ((4, 9), 4, 3, "group_size must be even"),
    ((8,), 8, 4, "must be 2-D"),
    ((2, 2, 4), 8, 4, "must be 2-D"),
])
def test_bad_arguments_raise(shape, bits, group_size, match):
    with pytest.raises(ValueError, match=match):
        quantize_groupwise(torch.ones(shape), bits, group_size, True)


def test_quantize_model_names_the_bad_layer_and_leaves_the_model_unchanged():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    with pytest.raises(ValueError, match=r"^2: group_size 64 must be positive and divide cols = 32"):
        quantize_model(model, bits=8, group_size=64)
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear


# --- the tiny model -----------------------------------------------------------------------------------------------


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return tiny.build_model().eval()


def tokens(batch: int = 4) -> torch.Tensor:
    return torch.randint(0, tiny.VOCAB_SIZE, (batch, tiny.SEQ_LEN), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def cosine(a: nn.Module, b: nn.Module, idx: torch.Tensor) -> float:
    return F.cosine_similarity(a(idx).flatten(), b(idx).flatten(), dim=0).item()


# group_size 64 = hidden: the largest group that divides every Linear's in_features (64 and 256), so 128 cannot be
# used on this model. Bytes per weight: 1 + 4/64 (int8), 0.5 + 4/64 (int4), against 4 in fp32.
@pytest.mark.parametrize("bits,min_cosine,linear_ratio", [(8, 0.999, (1 + 4 / 64) / 4), (4, 0.98, (0.5 + 4 / 64) / 4)])
def test_tiny_model_logits_after_quantization(bits, min_cosine, linear_ratio):
    model = tiny_model()
    quantized = quantize_model(copy.deepcopy(model), bits=bits, group_size=64, symmetric=True)
    similarity = cosine(model, quantized, tokens())
    skip = ("lm_head",)  # tied to the embedding, not quantized
    lin = linear_weight_bytes(quantized, skip) / linear_weight_bytes(model, skip)
    total = weight_bytes(quantized) / weight_bytes(model)
    print(f"\nINT{bits} group 64 symmetric: logits cosine {similarity:.6f}, Linear weight bytes "
          f"{linear_weight_bytes(model, skip)} -> {linear_weight_bytes(quantized, skip)} (ratio {lin:.4f}), "
          f"all parameters and buffers {weight_bytes(model)} -> {weight_bytes(quantized)} (ratio {total:.4f})")
    assert similarity >= min_cosine
    assert lin == linear_ratio
    replaced = [n for n, m in quantized.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(replaced) == 6 * tiny.NUM_LAYERS and "lm_head" not in replaced
    assert quantized.lm_head.weight is quantized.wte.weight  # still tied


def test_quantized_state_dict_round_trip():
    a = quantize_model(tiny_model(0), bits=4, group_size=32, symmetric=False)
    b = quantize_model(tiny_model(1), bits=4, group_size=32, symmetric=False)
    idx = tokens(2)
    with torch.no_grad():
        assert not torch.equal(a(idx), b(idx))
        b.load_state_dict(a.state_dict())
        assert torch.equal(a(idx), b(idx))
    assert "blocks.0.attn.q.zeros" in a.state_dict() and "blocks.0.attn.q.weight" not in a.state_dict()


# --- quantization-aware training ---------------------------------------------------------------------------------


def test_fake_quantize_value_and_identity_gradient():
    w = random_weight(rows=4, cols=64).requires_grad_()
    out = fake_quantize(w, 4, 16, True)
    assert torch.equal(out, dequantize_groupwise(quantize_groupwise(w, 4, 16, True)))
    grad = torch.randn_like(w)
    out.backward(grad)
    assert torch.equal(w.grad, grad)
    half = random_weight(rows=4, cols=64).to(torch.bfloat16).requires_grad_()
    assert fake_quantize(half, 8, 64, False).dtype == torch.bfloat16


def test_fake_quant_linear_gradient_is_the_dequantized_weight_gradient():
    linear = nn.Linear(64, 8)
    fq = FakeQuantLinear.from_linear(linear, bits=4, group_size=32, symmetric=False)
    x = torch.randn(5, 64, requires_grad=True)
    upstream = torch.randn(5, 8)
    (fq(x) * upstream).sum().backward()
    w_hat = dequantize_groupwise(quantize_groupwise(linear.weight, 4, 32, False)).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    (F.linear(x_ref, w_hat, linear.bias) * upstream).sum().backward()
    assert torch.equal(linear.weight.grad, w_hat.grad)  # STE: dL/dw = dL/dw_hat
    assert torch.equal(x.grad, x_ref.grad)
    assert not torch.equal(w_hat, linear.weight)  # the forward did use the quantized weight


def test_prepare_qat_keeps_the_parameters():
    model = tiny_model()
    params_before = dict(model.named_parameters())
    keys_before = list(model.state_dict())
    prepare_qat(model, bits=8, group_size=64)
    assert dict(model.named_parameters()) == params_before  # the same Parameter objects
    assert list(model.state_dict()) == keys_before
    fq = [n for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)]
    assert len(fq) == 6 * tiny.NUM_LAYERS and type(model.lm_head) is nn.Linear


def test_qat_training_reduces_the_loss_and_converts_exactly():
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # built before prepare_qat: same Parameters
    prepare_qat(model, bits=4, group_size=32, symmetric=True)
    model.train()
    data = tiny.train_data(batch_size=8, seq_len=32, seed=0)
    losses = []
    for _ in range(20):
        idx = next(data)
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"\nQAT INT4 group 32: loss {losses[0]:.3f} -> {losses[-1]:.3f} in 20 AdamW steps")
    assert losses[-1] < losses[0] - 0.5

    model.eval()
    idx = tokens(2)
    with torch.no_grad():
        fake = model(idx)
        convert_qat(model)
        assert not any(isinstance(m, FakeQuantLinear) for m in model.modules())
        assert isinstance(model.blocks[0].mlp.up, QuantizedLinear) and model.blocks[0].mlp.up.bits == 4
        torch.testing.assert_close(model(idx), fake, rtol=0, atol=0)  # same dequantized weights, same ops


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_cpu_path_never_builds_the_cuda_kernels():
    from zplan.cuda import weight_quant

    assert weight_quant.load_cuda() is None and not weight_quant._CUDA.tried()
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        weight_quant.quantize_groupwise_cuda(torch.ones(2, 8), 8, 4)
