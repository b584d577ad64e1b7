"""Weight quantization of nn.Linear layers, INT8 and INT4 group-wise: weight-only for inference
(QuantizedLinear, quantize_model) and quantization-aware training (FakeQuantLinear, prepare_qat, convert_qat).

    model = quantize_model(model, bits=4, group_size=32)           # inference: Linear -> QuantizedLinear
    model = prepare_qat(model, bits=4, group_size=32)               # QAT: Linear -> FakeQuantLinear, same params
    ... train ...
    model = convert_qat(model)                                      # FakeQuantLinear -> QuantizedLinear

The quantizers are zplan.cuda.weight_quant's pure-torch references (group-wise along the input dimension, as
GPTQ/AWQ store weights; the layout is in that module's docstring). QuantizedLinear dequantizes its weight on every
forward with the reference and runs F.linear in the input's dtype: it saves memory, not time.

Modules are replaced in place and the model is returned. `skip` takes patterns over qualified module names
(fnmatch; a pattern without a dot also matches the last name component, so "lm_head" skips "lm_head" and
"model.lm_head"). The default skips the LM head, which GPT-style models tie to the token embedding (quantizing it
would untie it). The out_proj of nn.MultiheadAttention is never replaced (that module reads its weight directly).
Every replaced Linear's in_features must be a multiple of group_size; quantize_model and prepare_qat check all of
them before replacing any.
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
from torch import nn

from zplan.cuda.weight_quant import (
    QuantizedWeight,
    check_args,
    dequantize_groupwise,
    fake_quantize,
    nbytes,
    quantize_groupwise,
)

DEFAULT_SKIP = ("lm_head",)


class QuantizedLinear(nn.Module):
    """A Linear with a group-wise quantized weight (buffers qweight, scales, zeros) and an unquantized bias."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.bits, self.group_size = qw.bits, qw.group_size
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scales", qw.scales)
        self.register_buffer("zeros", qw.zeros)  # None (not in the state dict) when symmetric
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int, symmetric: bool = True) -> QuantizedLinear:
        return cls(quantize_groupwise(linear.weight, bits, group_size, symmetric), linear.bias)

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scales, self.zeros, self.bits, self.group_size,
                               (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        weight = dequantize_groupwise(self.quantized_weight).to(x.dtype)  # (out, in)
        return F.linear(x, weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, symmetric={self.symmetric}, bias={self.bias is not None}")


class FakeQuantLinear(nn.Linear):
    """An nn.Linear whose forward uses fake_quantize(weight) (straight-through gradient): QAT. The weight stays
    a full-precision Parameter, so optimizers and state dicts see an ordinary Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, bits: int = 8,
                 group_size: int = 64, symmetric: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        check_args((out_features, in_features), bits, group_size)
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int, symmetric: bool = True) -> FakeQuantLinear:
        """A FakeQuantLinear holding the same weight and bias Parameter objects as `linear`."""
        fq = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, bits=bits,
                 group_size=group_size, symmetric=symmetric, device="meta")
        fq.weight, fq.bias = linear.weight, linear.bias
        fq.train(linear.training)
        return fq

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, fake_quantize(self.weight, self.bits, self.group_size, self.symmetric), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.bits}, group_size={self.group_size}, symmetric={self.symmetric}"


def _skipped(name: str, skip: Iterable[str]) -> bool:
    last = name.rsplit(".", 1)[-1]
    return any(fnmatchcase(name, p) or ("." not in p and fnmatchcase(last, p)) for p in skip)


def _replace(model: nn.Module, targets: dict[str, nn.Module], make) -> nn.Module:
    """Build make(module) for every target, then swap them in: a ValueError (naming the module) leaves the model
    unchanged."""
    new = {}
    for name, module in targets.items():
        try:
            new[name] = make(module)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    for name, module in new.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
    return model


def _linears(model: nn.Module, skip: Iterable[str], kind: type = nn.Linear) -> dict[str, nn.Module]:
    skip = tuple(skip)
    return {name: m for name, m in model.named_modules()
            if isinstance(m, kind) and not isinstance(m, nn.modules.linear.NonDynamicallyQuantizableLinear)
            and name and not _skipped(name, skip)}


def quantize_model(model: nn.Module, bits: int, group_size: int = 64, symmetric: bool = True,
                   skip: Iterable[str] = DEFAULT_SKIP) -> nn.Module:
    """Replace every nn.Linear (FakeQuantLinear included) not matched by `skip` with a QuantizedLinear of its
    current weight, in place; returns the model. Raises ValueError naming the layer if one cannot be quantized."""
    return _replace(model, _linears(model, skip), lambda m: QuantizedLinear.from_linear(m, bits, group_size, symmetric))


def prepare_qat(model: nn.Module, bits: int, group_size: int = 64, symmetric: bool = True,
                skip: Iterable[str] = DEFAULT_SKIP) -> nn.Module:
    """Replace every plain nn.Linear not matched by `skip` with a FakeQuantLinear sharing its weight and bias
    Parameters (optimizers built before keep working, state dict keys are unchanged), in place; returns the model.
    Forward hooks registered on the replaced modules are not carried over."""
    targets = {n: m for n, m in _linears(model, skip).items() if not isinstance(m, FakeQuantLinear)}
    return _replace(model, targets, lambda m: FakeQuantLinear.from_linear(m, bits, group_size, symmetric))


def convert_qat(model: nn.Module) -> nn.Module:
    """Replace every FakeQuantLinear with the QuantizedLinear of its weight, same bits, group size and symmetry,
    in place; returns the model. Its forward equals the FakeQuantLinear's exactly (same dequantized weight)."""
    targets = _linears(model, skip=(), kind=FakeQuantLinear)
    return _replace(model, targets, lambda m: QuantizedLinear.from_linear(m, m.bits, m.group_size, m.symmetric))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers (quantized weights' qweight, scales and zeros are buffers); a tensor
    shared by several modules (a tied LM head) counts once."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def linear_weight_bytes(model: nn.Module, skip: Iterable[str] = ()) -> int:
    """Bytes of the weights (not biases) of the nn.Linear and QuantizedLinear layers not matched by `skip`:
    weight for a Linear, qweight + scales + zeros for a QuantizedLinear; a shared weight counts once."""
    skip = tuple(skip)
    seen: set[int] = set()
    total = 0
    for name, m in model.named_modules():
        if _skipped(name, skip):
            continue
        if isinstance(m, QuantizedLinear) and id(m.qweight) not in seen:
            seen.add(id(m.qweight))
            total += nbytes(m.quantized_weight)
        elif isinstance(m, nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            total += m.weight.numel() * m.weight.element_size()
    return total
