// Group-wise weight quantization kernels, INT8 and packed INT4, symmetric and asymmetric.
// Semantics, layout and encodings: weight_quant.py's docstring; these kernels must equal its pure-torch reference
// bit for bit (tests/gpu/test_weight_quant_kernels.py). Every arithmetic step is one IEEE fp32 operation with
// round-to-nearest (__fdiv_rn, __fsub_rn, __fadd_rn, __fmul_rn are never contracted into FMA), rintf rounds half
// to even like torch.round, and fmaxf/fminf are exact, so the order of the warp reduction does not matter.
//
// quantize:   w fp32 (rows, cols) -> qweight (rows, cols) int8/uint8 or (rows, cols / 2) uint8,
//             scales fp32 (rows, cols / group_size), zeros uint8 (rows, cols / group_size) or (0, 0).
// dequantize: the inverse -> fp32 (rows, cols).
// Because cols % group_size == 0, group g = row * (cols / group_size) + j covers w[g * group_size, (g + 1) *
// group_size) of the row-major weight, and bytes [g * group_size / 2, ...) of a packed int4 qweight.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;  // one warp per group, 128 threads a block
constexpr int kThreads = 256;      // dequantize: one thread per stored byte (grid-stride)

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ __forceinline__ float warp_min(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// The stored level of one element: symmetric clamp(round(x / s), -qmax, qmax), asymmetric
// clamp(round(x / s) + zero, 0, qmax); integer-valued, clamped in float before the conversion to int.
__device__ __forceinline__ int quantize_one(float x, float scale, float zero, float qmax, bool symmetric) {
  const float r = rintf(__fdiv_rn(x, scale));
  const float q = symmetric ? fminf(fmaxf(r, -qmax), qmax) : fminf(fmaxf(__fadd_rn(r, zero), 0.f), qmax);
  return static_cast<int>(q);
}

// One warp per group; q: the qweight bytes (int8 / uint8 levels for 8 bits, packed nibbles for 4 bits).
__global__ void quantize_kernel(const float* __restrict__ w, uint8_t* __restrict__ q, float* __restrict__ scales,
                                uint8_t* __restrict__ zeros, int64_t num_groups, int group_size, int bits,
                                bool symmetric) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (g >= num_groups) return;  // g is the same for the whole warp, so the warp exits together
  const float* wg = w + g * group_size;

  float lo = 0.f, hi = 0.f;  // min(min x, 0) and max(max x, 0)
  for (int i = lane; i < group_size; i += kWarp) {
    lo = fminf(lo, wg[i]);
    hi = fmaxf(hi, wg[i]);
  }
  lo = warp_min(lo);
  hi = warp_max(hi);

  const float qmax = symmetric ? static_cast<float>((1 << (bits - 1)) - 1) : static_cast<float>((1 << bits) - 1);
  // symmetric: max|x| = max(hi, -lo); asymmetric: (hi - lo)
  float scale = __fdiv_rn(symmetric ? fmaxf(hi, -lo) : __fsub_rn(hi, lo), qmax);
  if (scale == 0.f) scale = 1.f;
  const float zero = symmetric ? 0.f : fminf(fmaxf(rintf(__fdiv_rn(-lo, scale)), 0.f), qmax);
  if (lane == 0) {
    scales[g] = scale;
    if (!symmetric) zeros[g] = static_cast<uint8_t>(static_cast<int>(zero));
  }

  if (bits == 8) {
    uint8_t* qg = q + g * group_size;
    for (int i = lane; i < group_size; i += kWarp) {
      // symmetric: the int8 two's-complement byte of q in [-127, 127] (conversion to uint8 is modulo 256);
      // asymmetric: q in [0, 255]
      qg[i] = static_cast<uint8_t>(quantize_one(wg[i], scale, zero, qmax, symmetric));
    }
  } else {
    uint8_t* qg = q + g * (group_size / 2);
    const int offset = symmetric ? 8 : 0;  // symmetric nibble holds q + 8
    for (int p = lane; p < group_size / 2; p += kWarp) {
      const int low = quantize_one(wg[2 * p], scale, zero, qmax, symmetric) + offset;
      const int high = quantize_one(wg[2 * p + 1], scale, zero, qmax, symmetric) + offset;
      qg[p] = static_cast<uint8_t>(low | (high << 4));
    }
  }
}

// One thread per stored byte: out = (q - zero) * scale, q - zero an exact integer converted to float.
__global__ void dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scales,
                                  const uint8_t* __restrict__ zeros, float* __restrict__ out, int64_t num_bytes,
                                  int group_size, int bits, bool symmetric) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < num_bytes; b += stride) {
    if (bits == 8) {
      const int64_t g = b / group_size;
      const int level = symmetric ? static_cast<int>(static_cast<int8_t>(q[b])) : static_cast<int>(q[b]) - zeros[g];
      out[b] = __fmul_rn(static_cast<float>(level), scales[g]);
    } else {
      const int64_t g = (2 * b) / group_size;  // both nibbles of a byte are in one group (group_size even)
      const int sub = symmetric ? 8 : static_cast<int>(zeros[g]);
      const int low = static_cast<int>(q[b] & 0xF) - sub;
      const int high = static_cast<int>(q[b] >> 4) - sub;
      out[2 * b] = __fmul_rn(static_cast<float>(low), scales[g]);
      out[2 * b + 1] = __fmul_rn(static_cast<float>(high), scales[g]);
    }
  }
}

void check_args(int64_t cols, int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group_size > 0 && cols % group_size == 0, "group_size ", group_size, " must divide cols = ", cols);
  TORCH_CHECK(bits == 8 || group_size % 2 == 0, "4-bit needs an even group_size, got ", group_size);
}

}  // namespace

// w: fp32 (rows, cols) on a CUDA device -> [qweight, scales, zeros]; zeros is (0, 0) when symmetric.
std::vector<torch::Tensor> quantize(torch::Tensor w, int64_t bits, int64_t group_size, bool symmetric) {
  TORCH_CHECK(w.is_cuda() && w.dim() == 2 && w.scalar_type() == torch::kFloat32, "w must be a 2-D fp32 CUDA tensor");
  const int64_t rows = w.size(0), cols = w.size(1);
  check_args(cols, bits, group_size);
  const c10::cuda::CUDAGuard guard(w.device());
  w = w.contiguous();
  const auto opts = w.options();
  const auto q_dtype = (bits == 8 && symmetric) ? torch::kInt8 : torch::kUInt8;
  auto qweight = torch::empty({rows, bits == 8 ? cols : cols / 2}, opts.dtype(q_dtype));
  auto scales = torch::empty({rows, cols / group_size}, opts.dtype(torch::kFloat32));
  auto zeros = torch::empty({symmetric ? 0 : rows, symmetric ? 0 : cols / group_size}, opts.dtype(torch::kUInt8));
  const int64_t num_groups = rows * (cols / group_size);
  if (num_groups > 0) {
    const auto blocks = static_cast<unsigned int>((num_groups + kWarpsPerBlock - 1) / kWarpsPerBlock);
    quantize_kernel<<<blocks, kWarpsPerBlock * kWarp, 0, c10::cuda::getCurrentCUDAStream()>>>(
        w.data_ptr<float>(), static_cast<uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
        symmetric ? nullptr : zeros.data_ptr<uint8_t>(), num_groups, static_cast<int>(group_size),
        static_cast<int>(bits), symmetric);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {qweight, scales, zeros};
}

// The inverse: fp32 (rows, cols); zeros is ignored (may be empty) when symmetric.
torch::Tensor dequantize(torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros, int64_t bits,
                         int64_t group_size, bool symmetric, int64_t cols) {
  TORCH_CHECK(qweight.is_cuda() && scales.is_cuda() && qweight.dim() == 2, "qweight, scales: CUDA tensors");
  check_args(cols, bits, group_size);
  const int64_t rows = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == (bits == 8 ? cols : cols / 2), "qweight has ", qweight.size(1), " columns");
  TORCH_CHECK(qweight.element_size() == 1 && scales.scalar_type() == torch::kFloat32, "qweight bytes, fp32 scales");
  TORCH_CHECK(scales.numel() == rows * (cols / group_size), "scales must be (rows, cols / group_size)");
  TORCH_CHECK(symmetric || (zeros.is_cuda() && zeros.scalar_type() == torch::kUInt8 && zeros.numel() == scales.numel()),
              "asymmetric needs uint8 zeros shaped like scales");
  const c10::cuda::CUDAGuard guard(qweight.device());
  qweight = qweight.contiguous();
  scales = scales.contiguous();
  zeros = zeros.contiguous();
  auto out = torch::empty({rows, cols}, scales.options());
  const int64_t num_bytes = qweight.numel();
  if (num_bytes > 0) {
    const auto blocks = static_cast<unsigned int>(std::min<int64_t>((num_bytes + kThreads - 1) / kThreads, 65535));
    dequantize_kernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
        symmetric ? nullptr : zeros.data_ptr<uint8_t>(), out.data_ptr<float>(), num_bytes,
        static_cast<int>(group_size), static_cast<int>(bits), symmetric);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize", &quantize, "group-wise quantize (fp32 w, bits, group_size, symmetric)");
  m.def("dequantize", &dequantize, "group-wise dequantize (qweight, scales, zeros, bits, group_size, symmetric, cols)");
}
