// CUDA kernels of zplan.cuda.comm_quant: the same semantics as its pure-torch references, bit for bit
// (tests/gpu/test_comm_quant_kernels.py). Flat fp32 inputs on one device, contiguous.
//   quantize_int8_blocks: one thread block per scale block; absmax by a shared-memory reduction,
//                         scale = absmax / 127 (IEEE division), q = rint(x / scale) (round half to even),
//                         clamped to [-127, 127]; an all-zero block has scale 0 and divides by 1.
//   dequantize_int8_blocks: x = q * scale.
//   pack_signs: one thread per output byte, bit i = (x[8j + i] >= 0).  unpack_signs: +1.0 / -1.0.
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <c10/cuda/CUDAStream.h>

namespace {

constexpr int kThreads = 256;

__global__ void quantize_int8_kernel(const float* x, int8_t* q, float* scales, int64_t block) {
  __shared__ float partial[kThreads];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * block;
  float m = 0.0f;
  for (int64_t i = threadIdx.x; i < block; i += blockDim.x) m = fmaxf(m, fabsf(x[base + i]));
  partial[threadIdx.x] = m;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] = fmaxf(partial[threadIdx.x], partial[threadIdx.x + stride]);
    __syncthreads();
  }
  const float scale = __fdiv_rn(partial[0], 127.0f);
  const float safe = scale > 0.0f ? scale : 1.0f;
  if (threadIdx.x == 0) scales[blockIdx.x] = scale;
  for (int64_t i = threadIdx.x; i < block; i += blockDim.x) {
    const float r = rintf(__fdiv_rn(x[base + i], safe));
    q[base + i] = static_cast<int8_t>(fminf(fmaxf(r, -127.0f), 127.0f));
  }
}

__global__ void dequantize_int8_kernel(const int8_t* q, const float* scales, float* x, int64_t n, int64_t block) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = __fmul_rn(static_cast<float>(q[i]), scales[i / block]);
}

__global__ void pack_signs_kernel(const float* x, uint8_t* packed, int64_t bytes) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= bytes) return;
  uint32_t byte = 0;
  for (int i = 0; i < 8; ++i) byte |= (x[8 * j + i] >= 0.0f ? 1u : 0u) << i;
  packed[j] = static_cast<uint8_t>(byte);
}

__global__ void unpack_signs_kernel(const uint8_t* packed, float* x, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = ((packed[i / 8] >> (i % 8)) & 1u) ? 1.0f : -1.0f;
}

int64_t grid(int64_t n) { return (n + kThreads - 1) / kThreads; }

}  // namespace

std::vector<torch::Tensor> quantize_int8_blocks(torch::Tensor x, int64_t block) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 1 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "quantize_int8_blocks: a contiguous 1-D fp32 CUDA tensor");
  TORCH_CHECK(block > 0 && x.numel() % block == 0, "quantize_int8_blocks: the length must divide by block");
  auto q = torch::empty({x.numel()}, x.options().dtype(torch::kChar));
  auto scales = torch::empty({x.numel() / block}, x.options());
  if (scales.numel() > 0) {
    quantize_int8_kernel<<<scales.numel(), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), q.data_ptr<int8_t>(), scales.data_ptr<float>(), block);
  }
  return {q, scales};
}

torch::Tensor dequantize_int8_blocks(torch::Tensor q, torch::Tensor scales) {
  TORCH_CHECK(q.is_cuda() && scales.is_cuda() && q.is_contiguous() && scales.is_contiguous(),
              "dequantize_int8_blocks: contiguous CUDA tensors");
  auto x = torch::empty({q.numel()}, scales.options());
  const int64_t n = q.numel();
  if (n > 0) {
    dequantize_int8_kernel<<<grid(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        q.data_ptr<int8_t>(), scales.data_ptr<float>(), x.data_ptr<float>(), n, n / scales.numel());
  }
  return x;
}

torch::Tensor pack_signs(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 1 && x.scalar_type() == torch::kFloat && x.is_contiguous() &&
              x.numel() % 8 == 0, "pack_signs: a contiguous 1-D fp32 CUDA tensor whose length divides by 8");
  auto packed = torch::empty({x.numel() / 8}, x.options().dtype(torch::kByte));
  if (packed.numel() > 0) {
    pack_signs_kernel<<<grid(packed.numel()), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), packed.data_ptr<uint8_t>(), packed.numel());
  }
  return packed;
}

torch::Tensor unpack_signs(torch::Tensor packed) {
  TORCH_CHECK(packed.is_cuda() && packed.scalar_type() == torch::kByte && packed.is_contiguous(),
              "unpack_signs: a contiguous uint8 CUDA tensor");
  auto x = torch::empty({packed.numel() * 8}, packed.options().dtype(torch::kFloat));
  if (x.numel() > 0) {
    unpack_signs_kernel<<<grid(x.numel()), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        packed.data_ptr<uint8_t>(), x.data_ptr<float>(), x.numel());
  }
  return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_int8_blocks", &quantize_int8_blocks);
  m.def("dequantize_int8_blocks", &dequantize_int8_blocks);
  m.def("pack_signs", &pack_signs);
  m.def("unpack_signs", &unpack_signs);
}
