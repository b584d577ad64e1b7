"""ZeRO-3's parameter all-gather in int8 (the quantized weight communication of ZeRO++, Wang et al. 2023, qwZ).

FSDP2 gathers a unit's parameters as one flat buffer per rank (its shards, concatenated); this all-gather
quantizes that buffer to int8 with one fp32 scale per 256 elements (zplan.cuda.comm_quant), gathers the int8
values and the scales, and dequantizes every rank's part into FSDP's output buffer. The sharded parameters (the
fp32 master weights the optimizer updates) are untouched: only the gathered copy used by forward and backward
carries the int8 rounding. Per rank 1 + 4/256 bytes an element travel instead of the element size (4 in fp32,
2 in bf16). A buffer that is not floating point (FSDP packs parameters of mixed dtypes as bytes) is gathered
as it is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from zplan.cuda.comm_quant import dequantize_int8_blocks, quantize_int8_blocks
from zplan.runtime.compression.grad_compression import INT8_BLOCK, WireBytes, _all_gather_single, _nbytes


class Int8AllGather(AllGather):
    """FSDP2 custom all-gather (FSDPModule.set_custom_all_gather) in int8; `wire` counts the bytes sent."""

    def __init__(self, wire: WireBytes | None = None, block: int = INT8_BLOCK):
        self.wire = wire if wire is not None else WireBytes()
        self.block = block

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        world = dist.get_world_size(group)
        if not input_tensor.is_floating_point():
            self.wire.add("all_gather", (world - 1) * _nbytes(input_tensor))
            return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        n = input_tensor.numel()
        padded_n = -(-n // self.block) * self.block  # quantized in whole blocks; the padding is not sent
        padded = torch.zeros(padded_n, dtype=torch.float32, device=input_tensor.device)
        padded[:n] = input_tensor
        q, scales = quantize_int8_blocks(padded, self.block)
        q = q[:n].contiguous()
        q_all = torch.empty(world * n, dtype=q.dtype, device=q.device)
        scales_all = torch.empty(world * scales.numel(), dtype=scales.dtype, device=scales.device)
        _all_gather_single(q_all, q, group=group)
        _all_gather_single(scales_all, scales, group=group)
        self.wire.add("all_gather", (world - 1) * _nbytes(q, scales))
        q_padded = torch.zeros(world, padded_n, dtype=q.dtype, device=q.device)
        q_padded[:, :n] = q_all.view(world, n)
        values = dequantize_int8_blocks(q_padded.view(-1), scales_all).view(world, padded_n)[:, :n]
        output_tensor.view(world, n).copy_(values)
        return None


class CountedAllGather(Int8AllGather):
    """FSDP2's plain all-gather, its bytes counted: the baseline of Int8AllGather."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.wire.add("all_gather", (dist.get_world_size(group) - 1) * _nbytes(input_tensor))
        return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def quantize_weight_all_gathers(model: torch.nn.Module, wire: WireBytes | None = None,
                                int8: bool = True) -> WireBytes:
    """Every FSDP2 unit of `model` gathers its parameters in int8 (int8=False: as before, counted); returns the
    shared byte counter."""
    from torch.distributed.fsdp import FSDPModule

    wire = wire if wire is not None else WireBytes()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather((Int8AllGather if int8 else CountedAllGather)(wire))
    return wire
