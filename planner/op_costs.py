"""What each traced operation costs: its FLOPs and the bytes autograd saves for backward.

Costs per operation (rules in the tables below):
  FLOPs      2*M*N*K for linear / matmul / bmm / addmm / baddbmm; scaled_dot_product_attention counted
             here (torch's FlopCounterMode misses the CPU flash kernel): QK^T and AV are 2*B*H*T*S*D each,
             halved when is_causal=True; elementwise operations count 0. Backward = 2x forward for these.
  act bytes  tensors autograd saves for backward (see SAVED-TENSOR RULE below), at the compute precision.
  experts    routed_experts (planner/expert_trace.py): each of T tokens visits k experts, each visit a pass through one
             expert's matrices: 2*T*k*(one expert's matrix parameters) forward FLOPs, balanced or not.
"""

from __future__ import annotations

import math

import torch

from zplan.errors import SpecError
from zplan.planner.expert_trace import ROUTED_EXPERTS
from zplan.planner.tracers import DROPOUT_OPS, SDPA, TracedOp

PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}  # bytes per floating-point element

# --- operation tables ------------------------------------------------------------------------------
# SDPA ("scaled_dot_product_attention") and DROPOUT_OPS come from zplan.planner.tracers, which names them.
MATMUL_K_FROM_ARG0 = {"linear", "matmul", "mm", "bmm"}  # contraction length K = args[0].shape[-1]
MATMUL_K_FROM_ARG1 = {"addmm", "baddbmm"}  # args[0] is the added term; K = args[1].shape[-1]
MATMUL_OPS = MATMUL_K_FROM_ARG0 | MATMUL_K_FROM_ARG1
NORM_EXTRA_BYTES_PER_ROW = {"layer_norm": 8, "rms_norm": 4, "group_norm": 8, "batch_norm": 8}  # fp32 stats
# Ops whose output is the same values as args[0] (a view, or a dtype cast, which is free under the
# all-floats-at-compute-precision convention): a tensor saved through any of them is charged once.
ALIAS_OPS = {
    "view", "reshape", "transpose", "permute", "t", "T", "mT", "contiguous", "unsqueeze", "squeeze", "flatten",
    "unflatten", "expand", "expand_as", "view_as", "reshape_as", "_unsafe_view", "alias", "detach", "data",
    "to", "type_as", "float", "half", "bfloat16", "type", "identity",
}
ADD_OPS = {"add", "add_"}

# SAVED-TENSOR RULE (what autograd keeps for backward; one tensor is charged once, to the first
# operation in execution order that saves it, identified through ALIAS_OPS):
#   products (linear, matmul, mul, div): each operand when the other operand requires grad
#     (linear saves its input because the weight requires grad: Korthikanti 2022 section 4.1);
#   SAVES_INPUT ops: their activation inputs; SAVES_OUTPUT ops: their output;
#   scaled_dot_product_attention: q, k, v, the output and a fp32 logsumexp (B, H, T), as a flash
#     kernel does; no (T, T) scores are saved, unlike Korthikanti's unfused 5*a*s^2 term;
#   norms: their input plus fp32 mean / rstd per row; dropout with p > 0: a 1-byte mask per element;
#   routed_experts: per routed token (T * k of them), its copy of the input (h), the first matrix's output (2F, the
#     activation's input), the last matrix's input (F) and the expert's output (h, which the routing weight
#     multiplies): what a grouped-GEMM MoE layer keeps (Megatron-Core's MoE layer; torchtitan's);
#   additions, views and concatenations: nothing.
# The loss's logits (B, T, V) are not charged here: the cost model counts them (planner/cost/memory.py).
PRODUCT_OPS = MATMUL_OPS | {"mul", "div"}
SAVES_INPUT = {"gelu", "silu", "pow", "layer_norm", "rms_norm", "group_norm", "batch_norm", "embedding", "log",
               "sin", "cos", "var", "std", "norm", "softplus", "mish", "leaky_relu", "elu", "square"}
SAVES_OUTPUT = {"relu", "tanh", "sigmoid", "exp", "softmax", "log_softmax", "_softmax", "_log_softmax",
                "rsqrt", "sqrt", "reciprocal"}


def element_bytes(precision: str) -> int:
    if precision not in PRECISION_BYTES:
        raise SpecError(f"unknown precision {precision!r}: use one of {', '.join(PRECISION_BYTES)}.")
    return PRECISION_BYTES[precision]



# --- per-operation costs --------------------------------------------------------------------------------

def forward_flops(op: TracedOp) -> float:
    """Forward FLOPs of one operation (multiply-add = 2 FLOPs)."""
    shapes = [arg.shape for arg in op.args]
    if op.op in MATMUL_OPS and op.shape is not None:
        k_arg = 0 if op.op in MATMUL_K_FROM_ARG0 else 1
        if len(shapes) <= k_arg or not shapes[k_arg]:
            return 0.0
        return 2.0 * math.prod(op.shape) * shapes[k_arg][-1]  # 2 * M * N * K
    if op.op == ROUTED_EXPERTS:
        tokens, top_k = _routed(op)
        matrices = [shape for shape in shapes[3:] if shape and len(shape) == 3]  # (E, out, in) or (E, in, out)
        return 2.0 * tokens * top_k * sum(math.prod(shape[1:]) for shape in matrices)
    if op.op == SDPA and len(shapes) >= 3 and all(shapes[:3]):
        query, key, value = shapes[:3]  # (B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, Dv)
        rows = math.prod(query[:-1])  # B * H * T
        full = 2.0 * rows * key[-2] * query[-1] + 2.0 * rows * key[-2] * value[-1]  # QK^T + AV
        return full / 2.0 if op.attrs.get("is_causal") else full  # causal: half the (T, S) square
    return 0.0


def causal_attention_flops(op: TracedOp) -> float:
    """FLOPs of a scaled_dot_product_attention's QK^T and AV from its shapes, over a causal square (half of it),
    whatever mask the tracer saw: what a causal language model's flash kernel computes."""
    query, key, value = (arg.shape for arg in op.args[:3])  # (B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, Dv)
    rows = math.prod(query[:-1])  # B * H * T
    return (2.0 * rows * key[-2] * query[-1] + 2.0 * rows * key[-2] * value[-1]) / 2.0


def _routed(op: TracedOp) -> tuple[int, int]:
    """(T tokens, k experts each) of a routed_experts operation: its hidden (T, h) and top_k_index (T, k)."""
    hidden, index = op.args[0].shape or (0, 0), op.args[1].shape or (0, 0)
    return math.prod(hidden[:-1]), index[-1]


def routed_saved_elements(op: TracedOp) -> float:
    """Elements a routed_experts operation saves for backward (the rule above), at compute precision."""
    tokens, top_k = _routed(op)
    hidden = op.args[0].shape[-1]
    matrices = [arg.shape for arg in op.args[3:] if arg.shape and len(arg.shape) == 3]
    first = matrices[0][1] if matrices[0][2] == hidden else matrices[0][2]  # the side that is not h: 2F
    last = matrices[-1][2] if matrices[-1][1] == hidden else matrices[-1][1]  # F
    return float(tokens * top_k * (2 * hidden + first + last))


def saved_tensors(op: TracedOp, requires_grad: dict[str, bool], float_bytes: int) -> tuple[list[int], bool, float]:
    """(indices of args saved, whether the output is saved, extra bytes saved) under the rule above."""
    arg_rg = [arg.requires_grad for arg in op.args]
    if not requires_grad.get(op.name):
        return [], False, 0.0
    if op.op == ROUTED_EXPERTS:
        return [], False, float_bytes * routed_saved_elements(op)
    if op.op in PRODUCT_OPS:
        saved = [i for i in range(len(op.args)) if any(rg for j, rg in enumerate(arg_rg) if j != i)]
        if op.op in MATMUL_K_FROM_ARG1:
            saved = [i for i in saved if i != 0]  # the added term (bias) is not needed for backward
        return saved, False, 0.0
    if op.op in SAVES_INPUT:
        extra = 0.0
        if op.op in NORM_EXTRA_BYTES_PER_ROW and op.shape:
            extra = NORM_EXTRA_BYTES_PER_ROW[op.op] * math.prod(op.shape[:-1])
        return [i for i, arg in enumerate(op.args) if arg.param is None], False, extra
    if op.op in SAVES_OUTPUT:
        return [], True, 0.0
    if op.op == SDPA and op.args and op.args[0].shape:
        logsumexp_bytes = 4.0 * math.prod(op.args[0].shape[:-1])  # fp32 (B, H, T)
        return list(range(len(op.args))), True, logsumexp_bytes
    if op.op in DROPOUT_OPS and op.attrs.get("dropout_p", 0.0) > 0 and op.shape:
        return [], False, float(math.prod(op.shape))  # 1-byte mask (B, T, ...)
    return [], False, 0.0


def tensor_bytes(shape: tuple[int, ...] | None, dtype: torch.dtype | None, float_bytes: int) -> float:
    if shape is None or dtype is None:
        return 0.0
    itemsize = float_bytes if dtype.is_floating_point else dtype.itemsize
    return float(math.prod(shape) * itemsize)
