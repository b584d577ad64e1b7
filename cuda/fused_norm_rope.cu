// RMSNorm and rotary position embedding, one kernel each (semantics: fused_norm_rope.py's docstring).
//
// rms_norm:     x (rows, h) fp32/fp16/bf16, weight fp32 (h,) or empty -> y (rows, h) of x's dtype;
//               one block a row: the sum of squares in fp32 (block reduction), then y = T(x * rsqrt(sum / h + eps)
//               * w) (Zhang & Sennrich 2019, eq. 4). The second read of x hits the cache.
// apply_rotary: x (B, H, T, d) contiguous, cos / sin of x's dtype with x's shape and any strides (stride 0 where
//               broadcast; last stride 1) -> out (B, H, T, d) = x * cos + rotate_half(x) * sin, in fp32, rounded
//               once; rotate_half(x)[j] = -x[j + d/2] for j < d/2, x[j - d/2] otherwise (Su et al. 2021, as in
//               GPT-NeoX / Llama).
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int kWarp = 32;
constexpr int kNormThreads = 256;
constexpr int kRopeThreads = 256;

template <typename T>
__global__ void rms_norm_kernel(const T* __restrict__ x, const float* __restrict__ weight, T* __restrict__ y,
                                int64_t h, float eps) {
  __shared__ float partial[kNormThreads / kWarp];
  const T* xr = x + static_cast<int64_t>(blockIdx.x) * h;
  T* yr = y + static_cast<int64_t>(blockIdx.x) * h;
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float v = static_cast<float>(xr[j]);
    sum += v * v;
  }
  for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % kWarp == 0) partial[threadIdx.x / kWarp] = sum;
  __syncthreads();
  if (threadIdx.x < kWarp) {
    sum = threadIdx.x < blockDim.x / kWarp ? partial[threadIdx.x] : 0.f;
    for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (threadIdx.x == 0) partial[0] = rsqrtf(sum / static_cast<float>(h) + eps);
  }
  __syncthreads();
  const float inv_rms = partial[0];
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float v = static_cast<float>(xr[j]) * inv_rms;
    yr[j] = static_cast<T>(weight ? v * weight[j] : v);
  }
}

struct RopeShape {
  int64_t H, T, d;
  int64_t cs[3], ss[3];  // cos / sin strides of the B, H, T dimensions, in elements (the last one is 1)
};

template <typename T>
__global__ void rotary_kernel(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                              T* __restrict__ out, RopeShape s, int64_t numel) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t half = s.d / 2;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
    const int64_t j = i % s.d;
    const int64_t row = i / s.d;  // (b, h, t) flattened
    const int64_t t = row % s.T, bh = row / s.T;
    const int64_t hh = bh % s.H, b = bh / s.H;
    const float c = static_cast<float>(cos[b * s.cs[0] + hh * s.cs[1] + t * s.cs[2] + j]);
    const float sn = static_cast<float>(sin[b * s.ss[0] + hh * s.ss[1] + t * s.ss[2] + j]);
    const float partner = j < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
    out[i] = static_cast<T>(static_cast<float>(x[i]) * c + partner * sn);
  }
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-D CUDA tensor (rows, h)");
  const int64_t rows = x.size(0), h = x.size(1);
  const bool has_weight = weight.numel() > 0;
  TORCH_CHECK(!has_weight || (weight.is_cuda() && weight.scalar_type() == torch::kFloat32 && weight.numel() == h &&
                              weight.is_contiguous()),
              "weight must be contiguous fp32 (h,) on the device, or empty");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  if (rows == 0 || h == 0) return y;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "zplan_rms_norm", [&] {
    rms_norm_kernel<scalar_t><<<static_cast<unsigned int>(rows), kNormThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), has_weight ? weight.data_ptr<float>() : nullptr, y.data_ptr<scalar_t>(), h,
        static_cast<float>(eps));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

torch::Tensor apply_rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 4 && x.is_contiguous(), "x must be a contiguous (B, H, T, d) CUDA tensor");
  TORCH_CHECK(x.size(3) % 2 == 0, "the head dimension d must be even, got ", x.size(3));
  for (const auto& t : {cos, sin}) {
    TORCH_CHECK(t.is_cuda() && t.scalar_type() == x.scalar_type() && t.sizes() == x.sizes() && t.stride(3) == 1,
                "cos / sin must be expanded to x's shape, of x's dtype, with unit last stride");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = torch::empty_like(x);
  const int64_t numel = x.numel();
  if (numel == 0) return out;
  RopeShape s{x.size(1), x.size(2), x.size(3), {cos.stride(0), cos.stride(1), cos.stride(2)},
              {sin.stride(0), sin.stride(1), sin.stride(2)}};
  const auto blocks = static_cast<unsigned int>(std::min<int64_t>((numel + kRopeThreads - 1) / kRopeThreads, 65535));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "zplan_apply_rotary", [&] {
    rotary_kernel<scalar_t><<<blocks, kRopeThreads, 0, stream>>>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                                                                  sin.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                                                  s, numel);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (x (rows, h), fp32 weight or empty, eps)");
  m.def("apply_rotary", &apply_rotary, "rotate-half RoPE (x (B, H, T, d), cos, sin expanded to x's shape)");
}
