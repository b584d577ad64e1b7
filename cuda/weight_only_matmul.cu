// Weight-only quantized linear layer on CUDA: y (M, N) = x (M, K) @ dequantize(q)^T + bias, x and y in fp32, fp16
// or bf16, weights INT8 or packed INT4 with group-wise fp32 scales (layout: zplan.cuda.weight_quant's docstring).
//
// gemv (few rows, the decode step): one warp per output feature n reads row n of the quantized weight once, 4 bytes
// a lane at a time (when rows are 4-byte aligned), dequantizes each weight in registers as the reference does,
// w = T(float(q - zero) * scale) (rounded to x's dtype, as F.linear on dequantize(qw).to(x.dtype) sees it), and
// accumulates up to kMaxRows rows of x in fp32; a warp shuffle reduction gives y[:, n]. The fp weight is never
// written to memory: the kernel reads 1 (INT8) or 0.5 (INT4) bytes a weight instead of 2 or 4.
// dequantize_to (many rows): the weight dequantized into a buffer of x's dtype, bit for bit the reference's
// dequantize_groupwise(qw).to(dtype) (one fp32 multiply, then round to nearest even); the caller runs cuBLAS on it.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;  // gemv: four output features a block of 128 threads
constexpr int kMaxRows = 8;        // gemv: rows of x (weight_only_matmul.GEMV_MAX_ROWS)
constexpr int kThreads = 256;      // dequantize_to: one thread a stored byte (grid-stride)

struct QuantArgs {
  const uint8_t* q;      // (N, K) or (N, K / 2)
  const float* scales;   // (N, G)
  const uint8_t* zeros;  // (N, G), or nullptr when symmetric
  int64_t N, K, G;
  int bits, group_size;
};

// The integer level (q - zero) of column c of row n; `byte` is the stored byte that holds it.
__device__ __forceinline__ int level_of(const QuantArgs& a, int64_t n, int64_t c, uint8_t byte) {
  const int64_t g = c / a.group_size;
  if (a.bits == 8) {
    return a.zeros ? static_cast<int>(byte) - a.zeros[n * a.G + g] : static_cast<int>(static_cast<int8_t>(byte));
  }
  const int nibble = (c & 1) ? (byte >> 4) : (byte & 0xF);
  return nibble - (a.zeros ? static_cast<int>(a.zeros[n * a.G + g]) : 8);
}

// What dequantizes the bytes of one group of row n: level = q - sub (int8 symmetric: the signed byte, sub = 0).
struct Group {
  float scale;
  int sub;
};

__device__ __forceinline__ Group group_of(const QuantArgs& a, int64_t n, int64_t g) {
  const int sub = a.zeros ? static_cast<int>(a.zeros[n * a.G + g]) : (a.bits == 4 ? 8 : 0);
  return Group{a.scales[n * a.G + g], sub};
}

// Weight of level `level` rounded to T and back (exactly the value F.linear reads from the reference's buffer);
// __fmul_rn keeps the multiply a separate, correctly rounded operation.
template <typename T>
__device__ __forceinline__ float weight_of(int level, float scale) {
  return static_cast<float>(static_cast<T>(__fmul_rn(static_cast<float>(level), scale)));
}

template <typename T>
__device__ __forceinline__ void accumulate(const T* __restrict__ x, int64_t K, int M, int64_t c, float w,
                                           float (&acc)[kMaxRows]) {
#pragma unroll
  for (int m = 0; m < kMaxRows; ++m) {
    if (m < M) acc[m] += w * static_cast<float>(x[m * K + c]);
  }
}

// One stored byte (one int8 column, or two int4 columns: both nibbles of a byte lie in one group since
// group_size is even), its first column c.
template <typename T>
__device__ __forceinline__ void accumulate_byte(const QuantArgs& a, const T* __restrict__ x, int M, int64_t c,
                                                uint8_t byte, Group grp, float (&acc)[kMaxRows]) {
  if (a.bits == 8) {
    const int level = a.zeros ? static_cast<int>(byte) - grp.sub : static_cast<int>(static_cast<int8_t>(byte));
    accumulate<T>(x, a.K, M, c, weight_of<T>(level, grp.scale), acc);
  } else {
    accumulate<T>(x, a.K, M, c, weight_of<T>(static_cast<int>(byte & 0xF) - grp.sub, grp.scale), acc);
    accumulate<T>(x, a.K, M, c + 1, weight_of<T>(static_cast<int>(byte >> 4) - grp.sub, grp.scale), acc);
  }
}

// One warp per output feature n. kVec4: rows are 4-byte aligned, each lane loads 4 stored bytes at once.
template <typename T, bool kVec4>
__global__ void gemv_kernel(QuantArgs a, const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                            int M) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (n >= a.N) return;  // whole warps exit together
  const int64_t row_bytes = a.bits == 8 ? a.K : a.K / 2;
  const uint8_t* qrow = a.q + n * row_bytes;
  const int cols_per_byte = a.bits == 8 ? 1 : 2;
  float acc[kMaxRows];
#pragma unroll
  for (int m = 0; m < kMaxRows; ++m) acc[m] = 0.f;

  if (kVec4) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(qrow);
    for (int64_t wi = lane; wi < row_bytes / 4; wi += kWarp) {
      const uint32_t word = __ldg(words + wi);
      const int64_t c_first = wi * 4 * cols_per_byte, c_last = c_first + 4 * cols_per_byte - 1;
      const int64_t g_first = c_first / a.group_size;
      const bool one_group = c_last / a.group_size == g_first;  // the usual case: group_size a multiple of 8
      const Group grp = group_of(a, n, g_first);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t c = c_first + j * cols_per_byte;
        accumulate_byte<T>(a, x, M, c, static_cast<uint8_t>(word >> (8 * j)),
                           one_group ? grp : group_of(a, n, c / a.group_size), acc);
      }
    }
  } else {
    for (int64_t b = lane; b < row_bytes; b += kWarp) {
      const int64_t c = b * cols_per_byte;
      accumulate_byte<T>(a, x, M, c, __ldg(qrow + b), group_of(a, n, c / a.group_size), acc);
    }
  }

#pragma unroll
  for (int m = 0; m < kMaxRows; ++m) {
    for (int offset = kWarp / 2; offset > 0; offset /= 2) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], offset);
  }
  if (lane == 0) {
    const float b = bias ? static_cast<float>(bias[n]) : 0.f;
    for (int m = 0; m < M; ++m) y[m * a.N + n] = static_cast<T>(acc[m] + b);
  }
}

// One thread per stored byte: out (N, K) in T = T(float(q - zero) * scale).
template <typename T>
__global__ void dequantize_to_kernel(QuantArgs a, T* __restrict__ out, int64_t num_bytes) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t row_bytes = a.bits == 8 ? a.K : a.K / 2;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < num_bytes; b += stride) {
    const int64_t n = b / row_bytes, rb = b % row_bytes;
    const uint8_t byte = a.q[b];
    if (a.bits == 8) {
      out[b] = static_cast<T>(
          __fmul_rn(static_cast<float>(level_of(a, n, rb, byte)), a.scales[n * a.G + rb / a.group_size]));
    } else {
      for (int j = 0; j < 2; ++j) {
        const int64_t c = 2 * rb + j;
        out[n * a.K + c] = static_cast<T>(
            __fmul_rn(static_cast<float>(level_of(a, n, c, byte)), a.scales[n * a.G + c / a.group_size]));
      }
    }
  }
}

QuantArgs make_args(const torch::Tensor& qweight, const torch::Tensor& scales, const torch::Tensor& zeros,
                    int64_t bits, int64_t group_size, int64_t K) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group_size > 0 && K % group_size == 0, "group_size ", group_size, " must divide K = ", K);
  TORCH_CHECK(bits == 8 || group_size % 2 == 0, "4-bit needs an even group_size");
  TORCH_CHECK(qweight.is_cuda() && qweight.dim() == 2 && qweight.is_contiguous() && qweight.element_size() == 1,
              "qweight must be contiguous CUDA bytes");
  TORCH_CHECK(qweight.size(1) == (bits == 8 ? K : K / 2), "qweight has ", qweight.size(1), " columns");
  const int64_t N = qweight.size(0), G = K / group_size;
  TORCH_CHECK(scales.is_cuda() && scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() &&
                  scales.numel() == N * G,
              "scales must be contiguous fp32 (N, K / group_size)");
  const bool asym = zeros.numel() > 0;
  TORCH_CHECK(!asym || (zeros.is_cuda() && zeros.scalar_type() == torch::kUInt8 && zeros.is_contiguous() &&
                        zeros.numel() == N * G),
              "zeros must be contiguous uint8 (N, K / group_size) or empty");
  return QuantArgs{static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
                   asym ? zeros.data_ptr<uint8_t>() : nullptr, N, K, G, static_cast<int>(bits),
                   static_cast<int>(group_size)};
}

}  // namespace

// x (M, K) fp32/fp16/bf16 contiguous, M <= kMaxRows; bias (N,) of x's dtype or empty -> y (M, N) of x's dtype.
torch::Tensor gemv(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros, int64_t bits,
                   int64_t group_size, torch::Tensor bias) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-D CUDA tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M <= kMaxRows, "gemv takes at most ", kMaxRows, " rows, got ", M);
  const QuantArgs a = make_args(qweight, scales, zeros, bits, group_size, K);
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.is_cuda() && bias.scalar_type() == x.scalar_type() && bias.numel() == a.N &&
                            bias.is_contiguous()),
              "bias must be (N,) of x's dtype or empty");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty({M, a.N}, x.options());
  if (M == 0 || a.N == 0) return y;
  const int64_t row_bytes = bits == 8 ? K : K / 2;
  const bool vec4 = row_bytes % 4 == 0 && reinterpret_cast<uintptr_t>(a.q) % 4 == 0;
  const auto blocks = static_cast<unsigned int>((a.N + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "weight_only_gemv", [&] {
    const scalar_t* b = has_bias ? bias.data_ptr<scalar_t>() : nullptr;
    if (vec4) {
      gemv_kernel<scalar_t, true><<<blocks, kWarpsPerBlock * kWarp, 0, stream>>>(a, x.data_ptr<scalar_t>(), b,
                                                                                 y.data_ptr<scalar_t>(), int(M));
    } else {
      gemv_kernel<scalar_t, false><<<blocks, kWarpsPerBlock * kWarp, 0, stream>>>(a, x.data_ptr<scalar_t>(), b,
                                                                                  y.data_ptr<scalar_t>(), int(M));
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

// The dequantized weight (N, K) in `dtype`, equal to dequantize_groupwise(qw).to(dtype).
torch::Tensor dequantize_to(torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros, int64_t bits,
                            int64_t group_size, int64_t K, at::ScalarType dtype) {
  const QuantArgs a = make_args(qweight, scales, zeros, bits, group_size, K);
  const c10::cuda::CUDAGuard guard(qweight.device());
  auto out = torch::empty({a.N, K}, scales.options().dtype(dtype));
  const int64_t num_bytes = qweight.numel();
  if (num_bytes == 0) return out;
  const auto blocks = static_cast<unsigned int>(std::min<int64_t>((num_bytes + kThreads - 1) / kThreads, 65535));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "weight_only_dequantize_to", [&] {
    dequantize_to_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(a, out.data_ptr<scalar_t>(), num_bytes);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "weight-only GEMV (x, qweight, scales, zeros, bits, group_size, bias)");
  m.def("dequantize_to", &dequantize_to, "dequantize to a buffer of dtype (qweight, scales, zeros, bits, "
                                         "group_size, K, dtype)");
}
