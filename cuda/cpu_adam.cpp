// CPU AdamW for ZeRO-Offload (DESIGN.md decision 6): one pass over fp32 master weights and moments.
//
// Semantics are torch.optim.AdamW's (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR'19,
// Algorithm 2), written in the order of torch's fused CPU kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp):
//   p   = p * (1 - lr * wd)                            decoupled weight decay
//   m   = fma(1 - beta1, g - m, m)                     m.lerp_(g, 1 - beta1)
//   v   = fma((1 - beta2) * g, g, v * beta2)          v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
//   p   = p - (step_size * m) / (sqrt(v) / bc2_sqrt + eps)
// with step_size = lr / (1 - beta1^t) and bc2_sqrt = sqrt(1 - beta2^t) computed in double, then rounded to
// float. g is read as fp32, bf16 or fp16, upcast in registers and multiplied by grad_scale (the inverse of a loss
// scale times a clipping factor; 1 leaves it exact); when an output copy is given, the updated
// parameter is rounded to bf16 / fp16 (round to nearest even, as torch's .to()) and written in the same pass:
// the "offload step" reads p, g16, m, v and writes p, m, v, p16: 28 bytes a parameter. The 16-bit copy is
// written with non-temporal stores when it is aligned for them, so its lines are not first read into the cache
// (30 bytes with that write-allocate, as plain stores would cost; ~2% slower measured on a 2-core EPYC).
//
// SIMD width is chosen at build time: ZPLAN_AVX512 (16 floats), ZPLAN_AVX2 (8 floats, needs FMA and F16C), or
// neither (scalar loop). OpenMP threads split the tensor into contiguous tiles (static schedule); the tail of
// each tile that is not a multiple of the vector width runs the scalar code, which has the same rounding.
#include <torch/extension.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(ZPLAN_AVX512) || defined(ZPLAN_AVX2)
#include <immintrin.h>
#endif
#include <omp.h>

namespace {

struct Hyper {
  float decay;        // 1 - lr * wd
  float w1;           // 1 - beta1 (lerp weight, < 0.5 for any usual beta1)
  float beta2;
  float c2;           // 1 - beta2
  float step_size;    // lr / (1 - beta1^t)
  float bc2_sqrt;     // sqrt(1 - beta2^t)
  float eps;
  float grad_scale;   // g is read as g * grad_scale
};

// ---- scalar element update (also the tail of every vector loop) -------------------------------------------
template <typename G> inline float load_scalar(const G* p) { return static_cast<float>(*p); }
template <typename O> inline void store_scalar(O* p, float x) { *p = static_cast<O>(x); }

template <typename G, typename O>
inline void update_scalar(float* p, const G* g, float* m, float* v, O* out, const Hyper& h) {
  const float gf = load_scalar(g) * h.grad_scale;
  float pf = *p * h.decay;
  // lerp with weight < 0.5: start + weight * (end - start), fused (torch's lerp uses fma here too)
  float mf = std::fma(h.w1, gf - *m, *m);
  float vf = std::fma(h.c2 * gf, gf, *v * h.beta2);  // torch's addcmul contracts to this fma
  float denom = std::sqrt(vf) / h.bc2_sqrt + h.eps;
  pf = pf - (h.step_size * mf) / denom;
  *p = pf;
  *m = mf;
  *v = vf;
  if constexpr (!std::is_same_v<O, void>) store_scalar(out, pf);
}

// ---- vector width abstraction -----------------------------------------------------------------------------
#if defined(ZPLAN_AVX512)
constexpr int64_t kWidth = 16;
using vfloat = __m512;
using vbits = __m256i;  // 16 bf16 / fp16
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vfloat x) { _mm512_storeu_ps(p, x); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
inline vfloat vsqrt(vfloat a) { return _mm512_sqrt_ps(a); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vload_g(const float* p) { return vload(p); }
inline vfloat vload_g(const c10::BFloat16* p) {
  __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}
inline vfloat vload_g(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vbits vconv_o(c10::BFloat16*, vfloat x) {
  // round to nearest even: bits + 0x7fff + lsb(bits >> 16), then the high half; NaN becomes 0x7fc0 (c10)
  __m512i b = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}
inline vbits vconv_o(c10::Half*, vfloat x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// Streaming (non-temporal) stores need 32-byte alignment; they skip the read-for-ownership of the output lines.
template <bool Stream> inline void vstore_bits(void* p, vbits x) {
  if constexpr (Stream) _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
}
constexpr uintptr_t kStreamAlign = 32;
#elif defined(ZPLAN_AVX2)
constexpr int64_t kWidth = 8;
using vfloat = __m256;
using vbits = __m128i;  // 8 bf16 / fp16
inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vfloat x) { _mm256_storeu_ps(p, x); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
inline vfloat vsqrt(vfloat a) { return _mm256_sqrt_ps(a); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vload_g(const float* p) { return vload(p); }
inline vfloat vload_g(const c10::BFloat16* p) {
  __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}
inline vfloat vload_g(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vbits vconv_o(c10::BFloat16*, vfloat x) {
  __m256i b = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  // values are < 2^16, so the unsigned-saturating pack is exact
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline vbits vconv_o(c10::Half*, vfloat x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
template <bool Stream> inline void vstore_bits(void* p, vbits x) {
  if constexpr (Stream) _mm_stream_si128(reinterpret_cast<__m128i*>(p), x);
  else _mm_storeu_si128(reinterpret_cast<__m128i*>(p), x);
}
constexpr uintptr_t kStreamAlign = 16;
#else
constexpr int64_t kWidth = 1;
#endif

// One tile [begin, end): vector body, then the scalar tail. Stream: write the 16-bit copy with non-temporal
// stores (its lines are only written, so they need not be read into the cache first).
template <typename G, typename O, bool Stream>
void update_tile(float* p, const G* g, float* m, float* v, O* out, int64_t begin, int64_t end, const Hyper& h) {
  int64_t i = begin;
#if defined(ZPLAN_AVX512) || defined(ZPLAN_AVX2)
  const vfloat decay = vset1(h.decay), w1 = vset1(h.w1), beta2 = vset1(h.beta2), c2 = vset1(h.c2);
  const vfloat step_size = vset1(h.step_size), bc2_sqrt = vset1(h.bc2_sqrt), eps = vset1(h.eps);
  const vfloat grad_scale = vset1(h.grad_scale);
  for (; i + kWidth <= end; i += kWidth) {
    const vfloat gv = vmul(vload_g(g + i), grad_scale);
    vfloat pv = vmul(vload(p + i), decay);
    vfloat mv = vload(m + i);
    mv = vfma(w1, vsub(gv, mv), mv);
    vfloat vv = vfma(vmul(c2, gv), gv, vmul(vload(v + i), beta2));
    vfloat denom = vadd(vdiv(vsqrt(vv), bc2_sqrt), eps);
    pv = vsub(pv, vdiv(vmul(step_size, mv), denom));
    vstore(p + i, pv);
    vstore(m + i, mv);
    vstore(v + i, vv);
    if constexpr (!std::is_same_v<O, void>) vstore_bits<Stream>(out + i, vconv_o(out, pv));
  }
  if constexpr (Stream) _mm_sfence();  // this thread's non-temporal stores become visible before the tile ends
#endif
  for (; i < end; ++i) {
    if constexpr (std::is_same_v<O, void>) {
      update_scalar<G, void>(p + i, g + i, m + i, v + i, nullptr, h);
    } else {
      update_scalar<G, O>(p + i, g + i, m + i, v + i, out + i, h);
    }
  }
}

template <typename G, typename O, bool Stream>
void update_tensor(float* p, const G* g, float* m, float* v, O* out, int64_t n, const Hyper& h, int threads) {
  // Tiles of a whole number of vectors and cache lines, so threads never share a line and every vector store
  // of a tile keeps the output's alignment.
  constexpr int64_t kTile = 1 << 14;
  const int64_t tiles = (n + kTile - 1) / kTile;
  if (threads <= 1 || tiles <= 1) {
    update_tile<G, O, Stream>(p, g, m, v, out, 0, n, h);
  } else {
    // Contiguous blocks of tiles per thread (static schedule): each thread streams one region.
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t begin = t * kTile;
      const int64_t end = begin + kTile < n ? begin + kTile : n;
      update_tile<G, O, Stream>(p, g, m, v, out, begin, end, h);
    }
  }
}

template <typename G, typename O>
void dispatch_stream(float* p, const G* g, float* m, float* v, O* out, int64_t n, const Hyper& h, int threads) {
#if defined(ZPLAN_AVX512) || defined(ZPLAN_AVX2)
  if (out != nullptr && reinterpret_cast<uintptr_t>(out) % kStreamAlign == 0) {
    update_tensor<G, O, true>(p, g, m, v, out, n, h, threads);
    return;
  }
#endif
  update_tensor<G, O, false>(p, g, m, v, out, n, h, threads);
}

template <typename G>
void dispatch_out(float* p, const G* g, float* m, float* v, const at::Tensor* out, int64_t n, const Hyper& h,
                  int threads) {
  if (out == nullptr) {
    update_tensor<G, void, false>(p, g, m, v, nullptr, n, h, threads);
  } else if (out->scalar_type() == at::kBFloat16) {
    dispatch_stream<G, c10::BFloat16>(p, g, m, v, out->data_ptr<c10::BFloat16>(), n, h, threads);
  } else if (out->scalar_type() == at::kHalf) {
    dispatch_stream<G, c10::Half>(p, g, m, v, out->data_ptr<c10::Half>(), n, h, threads);
  } else {
    TORCH_CHECK(false, "param_copy_out must be bfloat16 or float16, got ", out->scalar_type());
  }
}

void check_state(const at::Tensor& t, const at::Tensor& p, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == p.numel(), name, " has ", t.numel(), " elements, the parameter ", p.numel());
}

}  // namespace

// AdamW step over lists of tensors, in place. params, exp_avgs, exp_avg_sqs: fp32. grads: fp32, bf16 or fp16.
// outs: empty, or one bf16/fp16 tensor a parameter (the device copy, written in the same pass).
void adamw_step(std::vector<at::Tensor> params, std::vector<at::Tensor> grads, std::vector<at::Tensor> exp_avgs,
                std::vector<at::Tensor> exp_avg_sqs, std::vector<at::Tensor> outs, double lr, double beta1,
                double beta2, double eps, double weight_decay, int64_t step, int64_t threads, double grad_scale) {
  const size_t count = params.size();
  TORCH_CHECK(grads.size() == count && exp_avgs.size() == count && exp_avg_sqs.size() == count,
              "params, grads, exp_avg and exp_avg_sq must have the same length");
  TORCH_CHECK(outs.empty() || outs.size() == count, "param_copy_out must be empty or one tensor a parameter");
  TORCH_CHECK(step >= 1, "step counts from 1, got ", step);
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  Hyper h;
  h.decay = static_cast<float>(1.0 - lr * weight_decay);
  h.w1 = static_cast<float>(1.0 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.c2 = static_cast<float>(1.0 - beta2);
  h.step_size = static_cast<float>(lr / bias_correction1);
  h.bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  h.eps = static_cast<float>(eps);
  h.grad_scale = static_cast<float>(grad_scale);
  TORCH_CHECK(h.w1 < 0.5f, "beta1 must be > 0.5 (the lerp form used here), got ", beta1);
  const int nthreads = threads > 0 ? static_cast<int>(threads) : at::get_num_threads();

  for (size_t k = 0; k < count; ++k) {
    const at::Tensor& p = params[k];
    const at::Tensor& g = grads[k];
    TORCH_CHECK(p.device().is_cpu() && p.is_contiguous() && p.scalar_type() == at::kFloat,
                "params must be contiguous fp32 CPU tensors");
    check_state(g, p, "grad");
    check_state(exp_avgs[k], p, "exp_avg");
    check_state(exp_avg_sqs[k], p, "exp_avg_sq");
    TORCH_CHECK(exp_avgs[k].scalar_type() == at::kFloat && exp_avg_sqs[k].scalar_type() == at::kFloat,
                "exp_avg and exp_avg_sq must be fp32");
    const at::Tensor* out = nullptr;
    if (!outs.empty()) {
      check_state(outs[k], p, "param_copy_out");
      out = &outs[k];
    }
    const int64_t n = p.numel();
    if (n == 0) continue;
    float* pp = p.data_ptr<float>();
    float* mp = exp_avgs[k].data_ptr<float>();
    float* vp = exp_avg_sqs[k].data_ptr<float>();
    switch (g.scalar_type()) {
      case at::kFloat: dispatch_out<float>(pp, g.data_ptr<float>(), mp, vp, out, n, h, nthreads); break;
      case at::kBFloat16:
        dispatch_out<c10::BFloat16>(pp, g.data_ptr<c10::BFloat16>(), mp, vp, out, n, h, nthreads);
        break;
      case at::kHalf: dispatch_out<c10::Half>(pp, g.data_ptr<c10::Half>(), mp, vp, out, n, h, nthreads); break;
      default: TORCH_CHECK(false, "grads must be fp32, bf16 or fp16, got ", g.scalar_type());
    }
  }
}

// Streaming triad a = b + s * c over fp32 arrays (the bandwidth yardstick of benchmarks/cpu_adam.py), with the
// same tiling and threads as the step.
void triad(at::Tensor a, at::Tensor b, at::Tensor c, double s, int64_t threads) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && c.is_contiguous(), "triad needs contiguous tensors");
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && c.scalar_type() == at::kFloat,
              "triad needs fp32 tensors");
  const int64_t n = a.numel();
  TORCH_CHECK(b.numel() == n && c.numel() == n, "triad needs equal sizes");
  float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float sf = static_cast<float>(s);
  const int nthreads = threads > 0 ? static_cast<int>(threads) : at::get_num_threads();
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t i = 0; i < n; ++i) ap[i] = bp[i] + sf * cp[i];
}

std::string simd() {
#if defined(ZPLAN_AVX512)
  return "avx512";
#elif defined(ZPLAN_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// adamw_step and triad run without the GIL (pybind11 converts the arguments to at::Tensor while it is held, then
// releases it for the call and takes it back before the result or a TORCH_CHECK error goes back to Python): the
// functions touch no Python object, only tensor data and metadata, so a Python thread running the step (the
// delayed update of runtime/offload/cpu_adam_optimizer.py) overlaps the main thread's forward and backward.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adamw_step", &adamw_step, "AdamW step over lists of tensors (fp32 master, fp32/bf16/fp16 grads)",
        py::call_guard<py::gil_scoped_release>());
  m.def("triad", &triad, "streaming triad a = b + s * c", py::call_guard<py::gil_scoped_release>());
  m.def("simd", &simd, "SIMD width this build was compiled for");
}
