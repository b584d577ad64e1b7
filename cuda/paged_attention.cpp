// Decode attention over a paged KV cache on the CPU (paged_attention.py's docstring): each sequence's one query per
// head against the keys and values of its positions 0..len-1, read in place from the blocks its table names, so no
// gathered copy of the cache is made (the torch path copies every sequence's keys and values each step and layer).
//
// Shapes: q (D, a, d) fp32; k_cache, v_cache (slots, a_kv, d) fp32, slot = table[p / block] * block + p % block;
// tables (D, B) int64; lengths (D,) int64. Out (D, a, d) fp32. Query head h reads key/value head h / (a / a_kv)
// (grouped-query attention). Scores: dot(q, k) * scale, then cap * tanh(s / cap) when cap > 0 (Gemma 2), keys
// j > len - 1 - window only when window > 0 (a sliding window), then a softmax in two passes (max, then exp and sum)
// and the weighted sum of the values. Threads (OpenMP, dynamic schedule) split the D sequences; a sequence reads
// each position's key row and value row (all heads) once, contiguously;
// the inner loops over d are plain loops the compiler vectorizes (-O3 -mavx2 -mfma where the CPU has them).
// The sums run in another order than torch's: the results agree with the reference to float rounding.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <omp.h>

namespace {

constexpr int kLanes = 8;  // partial sums of a dot product: independent, so the compiler keeps them in one vector

// dot(a, b) over n floats; kLanes partial sums (a single running sum would serialise every add: no vectorization
// without -ffast-math).
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {0.f};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int t = 0; t < kLanes; ++t) lanes[t] += a[j + t] * b[j + t];
  float s = 0.f;
  for (int t = 0; t < kLanes; ++t) s += lanes[t];
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

torch::Tensor decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                     torch::Tensor lengths, double scale, int64_t window, double softcap, int64_t block_tokens,
                     int64_t threads) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
                  v_cache.dtype() == torch::kFloat32, "paged decode attention: fp32 tensors only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && tables.is_contiguous() &&
                  lengths.is_contiguous(), "paged decode attention: contiguous tensors only");
  const int64_t D = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_cache.size(1);
  const int64_t B = tables.size(1), group = heads / kv_heads;
  auto out = torch::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t longest = D ? *std::max_element(lp, lp + D) : 0;
  const float s_scale = static_cast<float>(scale), cap = static_cast<float>(softcap);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores(heads * std::max<int64_t>(longest, 1));  // (a, S) of one sequence
#pragma omp for schedule(dynamic)
    for (int64_t b = 0; b < D; ++b) {
      const int64_t len = lp[b], first = window > 0 ? std::max<int64_t>(0, len - window) : 0, span = len - first;
      const float* qb = qp + b * heads * d;
      const int64_t* table = tp + b * B;
      // keys: each position's row of a_kv * d floats is read once, contiguously, for every head
      for (int64_t p = first; p < len; ++p) {
        const int64_t slot = table[p / block_tokens] * block_tokens + p % block_tokens;
        const float* krow = kp + slot * kv_heads * d;
        for (int64_t h = 0; h < heads; ++h) {
          float s = dot(qb + h * d, krow + (h / group) * d, d) * s_scale;
          if (cap > 0.f) s = cap * std::tanh(s / cap);
          scores[h * span + p - first] = s;
        }
      }
      for (int64_t h = 0; h < heads; ++h) {  // softmax of each head's row: max, then exp and sum
        float* row = scores.data() + h * span;
        const float top = *std::max_element(row, row + span);
        float total = 0.f;
        for (int64_t i = 0; i < span; ++i) {
          row[i] = std::exp(row[i] - top);
          total += row[i];
        }
        for (int64_t i = 0; i < span; ++i) row[i] /= total;
      }
      float* ob = op + b * heads * d;
      for (int64_t p = first; p < len; ++p) {  // values: the same order, each row once
        const int64_t slot = table[p / block_tokens] * block_tokens + p % block_tokens;
        const float* vrow = vp + slot * kv_heads * d;
        for (int64_t h = 0; h < heads; ++h) {
          const float w = scores[h * span + p - first];
          const float* vv = vrow + (h / group) * d;
          float* o = ob + h * d;
          for (int64_t j = 0; j < d; ++j) o[j] += w * vv[j];
        }
      }
    }
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode, "decode attention over a paged KV cache (CPU, fp32)");
}
