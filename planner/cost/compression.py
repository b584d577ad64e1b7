"""Compressed communication as zplan's runtime runs it (runtime/compression/), vectorised over candidates: bytes
on the wire per element, the collectives' time, and the time of quantizing and dequantizing.

Gradients, ZeRO 0/1 with tp = 1 (runtime.compression.grad_compression). A flat tensor of N elements is averaged
over the W data-parallel ranks in two phases (the shape of ZeRO++'s qgZ, Wang et al. 2023, and of 1-bit Adam's
compressed all-reduce, Tang et al. 2021, Sec. 4): an all-to-all of the compressed tensor, then an all-gather of
each rank's compressed averaged chunk; per rank 2 (W-1)/W x C bytes, C = N x bytes per element:
  int8  1 + 4/256: int8 and one fp32 scale per block of 256; a DDP communication hook, one call per DDP bucket.
  1bit  1/8 + 4/256: signs and one fp32 scale per block of 256; 1-bit Adam's momentum, one call per step in the
        optimizer step. Priced in its steady state, after the warm-up of exact AdamW steps (whose gradients go
        through an uncompressed fp32 all-reduce).
Both run synchronously (the hook returns a completed future; 1-bit Adam's runs in the optimizer step), so unlike
DDP's own all-reduce they are not hidden behind the backward. The all-to-all sends directly
(planner.cost.comm.all_to_all_s): across nodes each rank's link carries (n-g)/n of C, where the hierarchical
all-reduce of the uncompressed gradients carries 2 (k-1)/k x S/g: across nodes compression pays only where C is
well under 2 S/g (S: the uncompressed bytes).
Weights, ZeRO 3 (ZeRO++ qwZ, Wang et al. 2023): every parameter all-gather moves 1 + 4/256 bytes an element
instead of the compute precision's (runtime.compression.weight_allgather).
Activations, pp > 1 (runtime.compression.activations): the hidden state on its way forward and its gradient on
its way back cross stages as rows of H int8 values with one fp32 scale a row: (H + 4)/H bytes an element.

Quantizing and dequantizing stream memory at HBM bandwidth x efficiency.memory_bound on the compute stream, not
overlapped. Bytes read + written per element, counted pass by pass in the runtime's code (on a GPU, with the
kernels of zplan.cuda.comm_quant; the passes over one rank's 1/W chunk are left out):
  int8 all-reduce, 31: zero-padded fp32 copy 12 (zeros 4, read 4, write 4); quantize 5 (read 4, write 1);
      dequantize the received chunks 5 (read 1, write 4); their mean 4 (read); dequantize the gathered result 5.
  1-bit all-reduce, 114.375: flatten the momenta 8; zero-padded copy 12; add the worker's error 12; compress
      46.125 (|x| 8, its block mean 4, x >= 0 5, signs as +-1.0 5, pack 4.125, scale x signs 8, the new error
      12); decode the received chunks 12.125 (unpack 4.125, x scale 8); their mean 4; decode the gathered
      result 12.125; copy back into the momenta 8.
  int8 weights, per gather and element of the unit: dequantize the gathered unit (read 1, write the compute
      precision's bytes) and quantize this rank's 1/W shard (read 4, write 1).
  int8 activations, per element crossing a stage: forward 18 + e (cast to fp32 e + 4, quantize 5, pack with the
      scales 2, unpack 2, dequantize 5), backward the same plus the cast back to the compute precision (4 + e),
      e the compute precision's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zplan.planner.cost.comm import all_gather_s, all_to_all_s
from zplan.planner.cost.inputs import Candidates, gpu_sequences
from zplan.schemas.cluster import ClusterSpec

BLOCK = 256  # elements per fp32 scale (runtime.compression.grad_compression INT8_BLOCK, ONE_BIT_BLOCK)
SCALE_BYTES = 4.0  # one fp32 scale
FP32_BYTES = 4.0
INT8_BYTES_PER_ELEMENT = 1.0 + SCALE_BYTES / BLOCK
ONE_BIT_BYTES_PER_ELEMENT = 1.0 / 8.0 + SCALE_BYTES / BLOCK
INT8_ALL_REDUCE_PASS_BYTES = 12.0 + 5.0 + 5.0 + 4.0 + 5.0
ONE_BIT_ALL_REDUCE_PASS_BYTES = 8.0 + 12.0 + 12.0 + 46.125 + 12.125 + 4.0 + 12.125 + 8.0
QUANTIZE_PASS_BYTES = 4.0 + 1.0  # read fp32, write int8
ACTIVATION_CODEC_BYTES = 18.0  # per element crossing forward, plus the compute precision's bytes
# Memory (planner.cost.memory): the int8 hook's transient copies of one DDP bucket, in fp32 buckets' bytes (its
# padded copy, the dequantized received chunks, the dequantized result, and the int8 copies of 1/4 each);
# 1-bit Adam's error feedback kept between steps (the worker's, per parameter; the server's, per parameter / W);
# and its transient peak in the step (flat momenta, padded copy, error-corrected input, signs, their scaled
# product, the new error), while the activations are freed.
INT8_HOOK_BUCKET_COPIES = 4.0
ONE_BIT_ERROR_BYTES_PER_PARAM = 4.0
ONE_BIT_STEP_BYTES_PER_PARAM = 24.0


def memory_bandwidth_Bps(cluster: ClusterSpec) -> float:
    """Bytes per second one GPU streams through memory in a memory-bound pass."""
    return cluster.gpu.hbm_bandwidth_Bps * cluster.efficiency.memory_bound


def gradient_bytes_per_element(cand: Candidates, elem: float) -> np.ndarray:
    """Bytes per gradient element in the ZeRO 0/1 reduction: the compute precision's uncompressed (as the
    uncompressed all-reduce of planner.cost.step counts them), else the compressed."""
    return np.select([cand.grad_compress == 1, cand.grad_compress == 2],
                     [INT8_BYTES_PER_ELEMENT, ONE_BIT_BYTES_PER_ELEMENT], float(elem))


def compressed_gradient_reduce_s(params: np.ndarray, cand: Candidates, cluster: ClusterSpec,
                                 grad_buckets: np.ndarray) -> np.ndarray:
    """Seconds per step of the compressed gradient all-reduce of `params` elements per GPU (all-to-all +
    all-gather per call, and the quantizing passes), where the candidate compresses gradients; 0 elsewhere.
    `grad_buckets`: DDP buckets per step (int8 runs once per bucket; 1-bit once per step)."""
    one_bit = cand.grad_compress == 2
    calls = np.where(one_bit, 1.0, grad_buckets)
    call_bytes = gradient_bytes_per_element(cand, 1.0) * params / calls
    wire_s = calls * (all_to_all_s(call_bytes, cand.dp, cand.tp, cluster)
                      + all_gather_s(call_bytes, cand.dp, cand.tp, cluster))
    passes = np.where(one_bit, ONE_BIT_ALL_REDUCE_PASS_BYTES, INT8_ALL_REDUCE_PASS_BYTES)
    return np.where(cand.grad_compress > 0, wire_s + params * passes / memory_bandwidth_Bps(cluster), 0.0)


def weight_gather_bytes_per_element(cand: Candidates, elem: float) -> np.ndarray:
    """Bytes per element of a ZeRO-3 parameter all-gather: int8 with scales, or the compute precision's."""
    return np.where(cand.weight_compress == 1, INT8_BYTES_PER_ELEMENT, float(elem))


def weight_codec_s(unit_params: np.ndarray, cand: Candidates, cluster: ClusterSpec, elem: float) -> np.ndarray:
    """Seconds of quantizing and dequantizing one unit's gather of `unit_params` elements (int8 weights only)."""
    per_element = (1.0 + elem) + QUANTIZE_PASS_BYTES / cand.dp
    return np.where(cand.weight_compress == 1, unit_params * per_element / memory_bandwidth_Bps(cluster), 0.0)


def activation_bytes_per_element(cand: Candidates, hidden: int, elem: float) -> np.ndarray:
    """Bytes per element of a hidden state (or its gradient) crossing a pipeline stage."""
    return np.where(cand.act_compress == 1, 1.0 + SCALE_BYTES / hidden, float(elem))


def activation_codec_s(elements: np.ndarray, cand: Candidates, cluster: ClusterSpec,
                       elem: float) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of encoding and decoding one crossing of `elements` (int8 activations only)."""
    bandwidth, on = memory_bandwidth_Bps(cluster), cand.act_compress == 1
    forward = elements * (ACTIVATION_CODEC_BYTES + elem) / bandwidth
    backward = elements * (ACTIVATION_CODEC_BYTES + elem + FP32_BYTES + elem) / bandwidth
    return np.where(on, forward, 0.0), np.where(on, backward, 0.0)


@dataclass(frozen=True)
class WireBytes:
    """Bytes one GPU sends per step in the collectives compression can cover, at the candidates' settings."""

    gradients: np.ndarray  # ZeRO 0/1: the gradient all-reduce (1-bit: the momentum's)
    weights: np.ndarray  # ZeRO 3: the parameter all-gathers
    activations: np.ndarray  # pp > 1: the hidden states forward and their gradients back


def wire_bytes_per_step(cand: Candidates, params_gpu: np.ndarray, num_micro_batches: np.ndarray, seq_len: int,
                        hidden: int, elem: float) -> WireBytes:
    """Per rank: an all-reduce sends 2 (W-1)/W of the tensor, an all-gather (W-1)/W; ZeRO 3 gathers every unit
    before its forward and its backward in every micro-batch; each of the v m micro-batch chunks sends one hidden
    state forward and one gradient back (b s h / tp elements each, planner.cost.step)."""
    dp, m, v = cand.dp.astype(float), num_micro_batches, cand.interleave.astype(float)
    share = (dp - 1.0) / dp
    gradients = np.where(cand.zero <= 1, 2.0 * share * gradient_bytes_per_element(cand, elem) * params_gpu, 0.0)
    weights = np.where(cand.zero == 3, 2.0 * m * share * weight_gather_bytes_per_element(cand, elem) * params_gpu,
                       0.0)
    elements = gpu_sequences(cand) * seq_len * hidden / cand.tp
    activations = np.where(cand.pp > 1, 2.0 * v * m * elements * activation_bytes_per_element(cand, hidden, elem),
                           0.0)
    return WireBytes(gradients=gradients, weights=weights, activations=activations)
