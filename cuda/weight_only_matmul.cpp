// Weight-only quantized GEMV on the CPU: y (M, N) = x (M, K) @ dequantize(q)^T + bias, dequantizing inside the dot
// product so the fp32 weight is never written to memory (weight_only_matmul.py's docstring says why: decoding is
// memory-bound, and INT8 / INT4 weights are 4x / 8x fewer bytes than fp32).
//
// Layout (zplan.cuda.weight_quant): qweight int8 (N, K) symmetric / uint8 (N, K) asymmetric, or uint8 (N, K / 2)
// packed int4 (column 2j in the low nibble of byte j, 2j + 1 in the high one; symmetric nibbles hold q + 8);
// scales fp32 (N, K / group_size); zeros uint8 (N, K / group_size) for asymmetric, else empty.
//
// Dequantization is folded into the sum: per group, sum_k float(q_k - zero) * x_k (exact integer levels), times the
// group's scale once, instead of scale * level for every weight; so it agrees with F.linear on the dequantized
// weight to fp32 rounding, not bit for bit. The inner loop is then convert + FMA: 16 columns take ~6 instructions
// plus 2 FMAs a row of x, few enough to keep up with memory on 2 cores.
// Threads (OpenMP, static schedule) split the N output features; each reads its weight rows once for a block of
// up to kMaxBlock rows of x. AVX2 (ZPLAN_AVX2): 16 columns a step, as two 8-float vectors; a group's columns that
// do not fill a step (group_size % 16) run the scalar code.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#if defined(ZPLAN_AVX2)
#include <immintrin.h>
#endif
#include <omp.h>

namespace {

constexpr int kMaxBlock = 8;  // rows of x per pass over the weights (accumulators kept in registers)

struct Args {
  const float* x;        // (M, K)
  const uint8_t* q;      // (N, K) or (N, K / 2) bytes
  const float* scales;   // (N, G)
  const uint8_t* zeros;  // (N, G) or nullptr (symmetric)
  const float* bias;     // (N,) or nullptr
  float* y;              // (M, N)
  int64_t M, N, K, G;
  int bits, group_size;
};

// Integer level of column k of a row, as float (exact): q - zero (asymmetric), q (int8 symmetric), nibble - 8.
template <int BITS, bool ASYM>
inline float level(const uint8_t* qrow, int64_t k, float zero) {
  if (BITS == 8) return ASYM ? static_cast<float>(qrow[k]) - zero : static_cast<float>(static_cast<int8_t>(qrow[k]));
  const uint8_t b = qrow[k / 2];
  return static_cast<float>((k % 2) ? (b >> 4) : (b & 0xF)) - zero;  // symmetric: zero = 8
}

#if defined(ZPLAN_AVX2)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// The 16 integer levels of columns [k, k + 16) of one row, as two float vectors (exact).
template <int BITS, bool ASYM>
inline void levels16(const uint8_t* qrow, int64_t k, __m256 zero, __m256& l0, __m256& l1) {
  __m256i i0, i1;
  if (BITS == 8) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + k));
    if (ASYM) {
      i0 = _mm256_cvtepu8_epi32(b);
      i1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    } else {
      i0 = _mm256_cvtepi8_epi32(b);
      i1 = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
    }
  } else {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qrow + k / 2));  // 8 bytes, 16 nibbles
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i cols = _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
    i0 = _mm256_cvtepu8_epi32(cols);  // columns k .. k + 7, then k + 8 .. k + 15
    i1 = _mm256_cvtepu8_epi32(_mm_srli_si128(cols, 8));
  }
  l0 = _mm256_cvtepi32_ps(i0);
  l1 = _mm256_cvtepi32_ps(i1);
  if (BITS == 4 || ASYM) {
    l0 = _mm256_sub_ps(l0, zero);
    l1 = _mm256_sub_ps(l1, zero);
  }
}
#endif

// Rows m0 .. m0 + MB of y, output features [n0, n1). Per group: partial[m] = sum_k level_k * x[m, k] (exact
// integer levels times fp32 x), then y[m] += partial[m] * scale: one multiply by the scale a group, not a weight.
template <int BITS, bool ASYM, int MB>
void gemv_block(const Args& a, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t row_bytes = BITS == 8 ? a.K : a.K / 2;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qrow = a.q + n * row_bytes;
    float total[MB] = {};
#if defined(ZPLAN_AVX2)
    constexpr int U = MB <= 4 ? 2 : 1;  // two accumulator chains a row when few rows: hides the FMA latency
    __m256 vtotal[MB];
    for (int m = 0; m < MB; ++m) vtotal[m] = _mm256_setzero_ps();
#endif
    for (int64_t g = 0; g < a.G; ++g) {
      const float scale = a.scales[n * a.G + g];
      const float zero = ASYM ? static_cast<float>(a.zeros[n * a.G + g]) : (BITS == 4 ? 8.f : 0.f);
      const int64_t k0 = g * a.group_size, k1 = k0 + a.group_size;
      int64_t k = k0;
#if defined(ZPLAN_AVX2)
      if (k + 16 <= k1) {
        __m256 acc[MB][2];
        for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
        const __m256 vzero = _mm256_set1_ps(zero);
        for (; k + 16 <= k1; k += 16) {
          __m256 l0, l1;
          levels16<BITS, ASYM>(qrow, k, vzero, l0, l1);
          for (int m = 0; m < MB; ++m) {
            const float* xr = a.x + (m0 + m) * a.K + k;
            acc[m][0] = _mm256_fmadd_ps(l0, _mm256_loadu_ps(xr), acc[m][0]);
            acc[m][U - 1] = _mm256_fmadd_ps(l1, _mm256_loadu_ps(xr + 8), acc[m][U - 1]);
          }
        }
        const __m256 vscale = _mm256_set1_ps(scale);
        for (int m = 0; m < MB; ++m) {
          vtotal[m] = _mm256_fmadd_ps(U == 2 ? _mm256_add_ps(acc[m][0], acc[m][1]) : acc[m][0], vscale, vtotal[m]);
        }
      }
#endif
      if (k < k1) {
        float partial[MB] = {};
        for (; k < k1; ++k) {
          const float l = level<BITS, ASYM>(qrow, k, zero);
          for (int m = 0; m < MB; ++m) partial[m] += l * a.x[(m0 + m) * a.K + k];
        }
        for (int m = 0; m < MB; ++m) total[m] += partial[m] * scale;
      }
    }
    const float b = a.bias ? a.bias[n] : 0.f;
    for (int m = 0; m < MB; ++m) {
      float sum = total[m];
#if defined(ZPLAN_AVX2)
      sum += hsum(vtotal[m]);
#endif
      a.y[(m0 + m) * a.N + n] = sum + b;
    }
  }
}

template <int BITS, bool ASYM>
void gemv_rows_mode(const Args& a, int64_t m0, int mb, int64_t n0, int64_t n1) {
  switch (mb) {
    case 1: return gemv_block<BITS, ASYM, 1>(a, m0, n0, n1);
    case 2: return gemv_block<BITS, ASYM, 2>(a, m0, n0, n1);
    case 3: return gemv_block<BITS, ASYM, 3>(a, m0, n0, n1);
    case 4: return gemv_block<BITS, ASYM, 4>(a, m0, n0, n1);
    case 5: return gemv_block<BITS, ASYM, 5>(a, m0, n0, n1);
    case 6: return gemv_block<BITS, ASYM, 6>(a, m0, n0, n1);
    case 7: return gemv_block<BITS, ASYM, 7>(a, m0, n0, n1);
    default: return gemv_block<BITS, ASYM, 8>(a, m0, n0, n1);
  }
}

void gemv_rows(const Args& a, int64_t m0, int mb, int64_t n0, int64_t n1) {
  const bool asym = a.zeros != nullptr;
  if (a.bits == 8) {
    return asym ? gemv_rows_mode<8, true>(a, m0, mb, n0, n1) : gemv_rows_mode<8, false>(a, m0, mb, n0, n1);
  }
  return asym ? gemv_rows_mode<4, true>(a, m0, mb, n0, n1) : gemv_rows_mode<4, false>(a, m0, mb, n0, n1);
}

}  // namespace

// x fp32 (M, K); qweight (N, K) int8/uint8 or (N, K / 2) uint8; scales fp32 (N, G); zeros uint8 (N, G) or empty;
// bias fp32 (N,) or empty -> y fp32 (M, N).
torch::Tensor gemv(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros,
                   torch::Tensor bias, int64_t bits, int64_t group_size, int64_t threads) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(group_size > 0 && K % group_size == 0, "group_size ", group_size, " must divide K = ", K);
  TORCH_CHECK(bits == 8 || group_size % 2 == 0, "4-bit needs an even group_size");
  TORCH_CHECK(qweight.is_contiguous() && qweight.element_size() == 1 && qweight.dim() == 2 &&
                  qweight.size(1) == (bits == 8 ? K : K / 2),
              "qweight must be contiguous bytes (N, ", bits == 8 ? K : K / 2, ")");
  const int64_t G = K / group_size;
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == N * G,
              "scales must be contiguous fp32 (N, K / group_size)");
  const bool asym = zeros.numel() > 0;
  TORCH_CHECK(!asym || (zeros.scalar_type() == torch::kUInt8 && zeros.is_contiguous() && zeros.numel() == N * G),
              "zeros must be contiguous uint8 (N, K / group_size) or empty");
  TORCH_CHECK(bits == 4 || asym || qweight.scalar_type() == torch::kInt8, "symmetric int8 qweight must be int8");
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == torch::kFloat32 && bias.is_contiguous() && bias.numel() == N),
              "bias must be contiguous fp32 (N,) or empty");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  Args a{x.data_ptr<float>(), static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
         asym ? zeros.data_ptr<uint8_t>() : nullptr, has_bias ? bias.data_ptr<float>() : nullptr,
         y.data_ptr<float>(), M, N, K, G, static_cast<int>(bits), static_cast<int>(group_size)};
  const int nthreads = static_cast<int>(std::max<int64_t>(1, threads));
  constexpr int64_t kTile = 16;  // output features a task: a tile of weight rows
  const int64_t tiles = (N + kTile - 1) / kTile;
  {
    pybind11::gil_scoped_release no_gil;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxBlock) {
      const int mb = static_cast<int>(std::min<int64_t>(kMaxBlock, M - m0));
#pragma omp parallel for schedule(dynamic, 4) num_threads(nthreads)
      for (int64_t t = 0; t < tiles; ++t) gemv_rows(a, m0, mb, t * kTile, std::min(N, (t + 1) * kTile));
    }
  }
  return y;
}

// The dequantized weight fp32 (N, K) = float(q - zero) * scale, bit for bit dequantize_groupwise's (one fp32
// multiply of an exact integer), for many rows of x: the caller runs F.linear (MKL / oneDNN) on it.
torch::Tensor dequantize(torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros, int64_t bits,
                         int64_t group_size, int64_t K, int64_t threads) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group_size > 0 && K % group_size == 0, "group_size ", group_size, " must divide K = ", K);
  TORCH_CHECK(bits == 8 || group_size % 2 == 0, "4-bit needs an even group_size");
  TORCH_CHECK(qweight.is_contiguous() && qweight.element_size() == 1 && qweight.dim() == 2 &&
                  qweight.size(1) == (bits == 8 ? K : K / 2),
              "qweight must be contiguous bytes (N, ", bits == 8 ? K : K / 2, ")");
  const int64_t N = qweight.size(0), G = K / group_size;
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == N * G,
              "scales must be contiguous fp32 (N, K / group_size)");
  const bool asym = zeros.numel() > 0;
  TORCH_CHECK(!asym || (zeros.scalar_type() == torch::kUInt8 && zeros.is_contiguous() && zeros.numel() == N * G),
              "zeros must be contiguous uint8 (N, K / group_size) or empty");
  auto out = torch::empty({N, K}, scales.options());
  const uint8_t* q = static_cast<const uint8_t*>(qweight.data_ptr());
  const float* sc = scales.data_ptr<float>();
  const uint8_t* zp = asym ? zeros.data_ptr<uint8_t>() : nullptr;
  float* o = out.data_ptr<float>();
  const int64_t row_bytes = bits == 8 ? K : K / 2;
  const int nthreads = static_cast<int>(std::max<int64_t>(1, threads));
  {
    pybind11::gil_scoped_release no_gil;
#pragma omp parallel for schedule(dynamic, 16) num_threads(nthreads)
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* qrow = q + n * row_bytes;
      for (int64_t g = 0; g < G; ++g) {
        const float scale = sc[n * G + g];
        const int sub = zp ? zp[n * G + g] : (bits == 4 ? 8 : 0);
        float* orow = o + n * K;
        for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
          int level;
          if (bits == 8) {
            level = zp ? static_cast<int>(qrow[k]) - sub : static_cast<int>(static_cast<int8_t>(qrow[k]));
          } else {
            level = static_cast<int>((k % 2) ? (qrow[k / 2] >> 4) : (qrow[k / 2] & 0xF)) - sub;
          }
          orow[k] = static_cast<float>(level) * scale;
        }
      }
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "weight-only quantized GEMV (x, qweight, scales, zeros, bias, bits, group_size, threads)");
  m.def("dequantize", &dequantize, "dequantize to fp32 (qweight, scales, zeros, bits, group_size, K, threads)");
}
