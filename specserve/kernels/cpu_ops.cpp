// Fused elementwise CPU kernels for the decoder layer's small ops (float32): RMSNorm, residual add + RMSNorm,
// SiLU-and-mul and rotate-half RoPE in place.
//
// Why: at decode batch sizes a layer's elementwise ops touch a few KiB each, so the cost of the plain torch ops is
// dispatch, temporaries and OpenMP fork/join rather than arithmetic. Each kernel here is one pass over its rows, with
// AVX2 where it was compiled in, and only enters at::parallel_for when the work is large enough to pay for the threads.
//
// Numerics follow the torch expressions they replace, in float32:
//   rms_norm:      out = (x * rsqrt(mean(x^2) + eps)) * weight            (HF LlamaRMSNorm / F.rms_norm)
//   silu_and_mul:  out = gate / (1 + exp(-gate)) * up                      (F.silu(gate) * up)
//   rope:          out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2])
// The file is built with -ffp-contract=off so the mul/add chains round exactly as torch's separate ops do; only the
// sum of squares uses explicit FMA (a reduction, whose order differs from torch's anyway).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kParallelMinElements = 1 << 16;  // below this, one thread beats fork/join on a 2-core box
constexpr int64_t kMinElementsPerTask = 1 << 15;

// Run fn(begin, end) over [0, rows): inline when rows * row_elements is small, else over torch's intra-op pool.
template <typename Fn>
inline void for_rows(int64_t rows, int64_t row_elements, const Fn& fn) {
  if (rows == 0) return;
  if (rows * row_elements < kParallelMinElements || at::get_num_threads() == 1 || at::in_parallel_region()) {
    fn(0, rows);
    return;
  }
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(1, row_elements));
  at::parallel_for(0, rows, grain, fn);
}

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for 8 floats, Cephes-style: x = n ln2 + r, |r| <= ln2 / 2, degree-6 polynomial, times 2^n (~1 ulp).
inline __m256 exp_avx2(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);  // ln2 split in two for an exact reduction
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // 2^n: n + 127 in the exponent field (n in [-127, 128]; the clamp keeps 2^n * p finite or a denormal-free tiny)
  const __m256i n = _mm256_cvtps_epi32(fx);
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
}
#endif

inline void check_cpu_f32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, what, " must be a float32 CPU tensor, got ",
              t.scalar_type(), " on ", t.device());
}

// 2-D [rows, cols] with unit column stride (rows may be strided: a view of a wider matrix).
inline void check_rows(const torch::Tensor& t, const char* what, int64_t rows, int64_t cols) {
  check_cpu_f32(t, what);
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, what, " must be [", rows, ", ", cols, "], got ",
              t.sizes());
  TORCH_CHECK(cols <= 1 || t.stride(1) == 1, what, " must have unit stride along its last dimension");
}

// sum_j x[j]^2 over one row.
inline float sum_squares(const float* x, int64_t H) {
  int64_t j = 0;
  float s = 0.f;
#ifdef __AVX2__
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; j + 32 <= H; j += 32) {
    const __m256 v0 = _mm256_loadu_ps(x + j), v1 = _mm256_loadu_ps(x + j + 8);
    const __m256 v2 = _mm256_loadu_ps(x + j + 16), v3 = _mm256_loadu_ps(x + j + 24);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
    a2 = _mm256_fmadd_ps(v2, v2, a2);
    a3 = _mm256_fmadd_ps(v3, v3, a3);
  }
  for (; j + 8 <= H; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    a0 = _mm256_fmadd_ps(v, v, a0);
  }
  s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
  for (; j < H; ++j) s += x[j] * x[j];
  return s;
}

// out[j] = (x[j] * inv) * w[j] for one row.
inline void scale_row(const float* x, float inv, const float* w, float* out, int64_t H) {
  int64_t j = 0;
#ifdef __AVX2__
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; j + 8 <= H; j += 8) {
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), vinv), _mm256_loadu_ps(w + j)));
  }
#endif
  for (; j < H; ++j) out[j] = (x[j] * inv) * w[j];
}

// inv = rsqrt(mean(x^2) + eps), rounded as torch: sum / H (the mean), + eps, 1 / sqrt.
inline float inv_rms(const float* x, int64_t H, float eps) {
  const float mean = sum_squares(x, H) / static_cast<float>(H);
  return 1.f / std::sqrt(mean + eps);
}

torch::Tensor rms_norm(const torch::Tensor& x,       // [N, H]
                       const torch::Tensor& weight,  // [H]
                       double eps) {
  TORCH_CHECK(x.dim() == 2, "rms_norm: x must be [N, H], got ", x.sizes());
  const int64_t N = x.size(0), H = x.size(1);
  check_rows(x, "rms_norm: x", N, H);
  check_cpu_f32(weight, "rms_norm: weight");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous(),
              "rms_norm: weight must be contiguous [", H, "], got ", weight.sizes());
  torch::Tensor out = torch::empty({N, H}, x.options());
  if (H == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const float e = static_cast<float>(eps);
  for_rows(N, H, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = xp + n * xs;
      scale_row(row, inv_rms(row, H, e), wp, op + n * H, H);
    }
  });
  return out;
}

// residual += x (in place), then return rms_norm(residual).
torch::Tensor fused_add_rms_norm(const torch::Tensor& x,         // [N, H]
                                 torch::Tensor& residual,        // [N, H], updated in place
                                 const torch::Tensor& weight,    // [H]
                                 double eps) {
  TORCH_CHECK(x.dim() == 2, "fused_add_rms_norm: x must be [N, H], got ", x.sizes());
  const int64_t N = x.size(0), H = x.size(1);
  check_rows(x, "fused_add_rms_norm: x", N, H);
  check_rows(residual, "fused_add_rms_norm: residual", N, H);
  check_cpu_f32(weight, "fused_add_rms_norm: weight");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous(),
              "fused_add_rms_norm: weight must be contiguous [", H, "], got ", weight.sizes());
  torch::Tensor out = torch::empty({N, H}, x.options());
  if (H == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  const float e = static_cast<float>(eps);
  for_rows(N, H, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* xr = xp + n * xs;
      float* rr = rp + n * rs;
      int64_t j = 0;
#ifdef __AVX2__
      for (; j + 8 <= H; j += 8) {
        _mm256_storeu_ps(rr + j, _mm256_add_ps(_mm256_loadu_ps(rr + j), _mm256_loadu_ps(xr + j)));
      }
#endif
      for (; j < H; ++j) rr[j] += xr[j];
      scale_row(rr, inv_rms(rr, H, e), wp, op + n * H, H);
    }
  });
  return out;
}

// out[n, f] = silu(gate_up[n, f]) * gate_up[n, F + f]
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {  // [N, 2F]
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up must be [N, 2F], got ",
              gate_up.sizes());
  const int64_t N = gate_up.size(0), F = gate_up.size(1) / 2;
  check_rows(gate_up, "silu_and_mul: gate_up", N, 2 * F);
  torch::Tensor out = torch::empty({N, F}, gate_up.options());
  if (F == 0) return out;
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0);
  for_rows(N, F, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* g = gp + n * gs;
      const float* u = g + F;
      float* o = op + n * F;
      int64_t j = 0;
#ifdef __AVX2__
      const __m256 one = _mm256_set1_ps(1.f);
      const __m256 sign = _mm256_set1_ps(-0.f);
      for (; j + 8 <= F; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 e = exp_avx2(_mm256_xor_ps(gv, sign));  // exp(-gate)
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
      }
#endif
      for (; j < F; ++j) o[j] = (g[j] / (1.f + std::exp(-g[j]))) * u[j];
    }
  });
  return out;
}

// In place on qk[n, h, :] (a view; row and head strides free, unit stride along D):
//   i <  D/2: x[i] * cos[i] + (-x[i + D/2]) * sin[i]
//   i >= D/2: x[i] * cos[i] + x[i - D/2] * sin[i]
void rope_rotate_half_(torch::Tensor& qk,         // [N, heads, D]
                       const torch::Tensor& cos,  // [N, D]
                       const torch::Tensor& sin) {
  check_cpu_f32(qk, "rope_rotate_half_: qk");
  TORCH_CHECK(qk.dim() == 3 && qk.size(2) % 2 == 0, "rope_rotate_half_: qk must be [N, heads, D] with even D, got ",
              qk.sizes());
  const int64_t N = qk.size(0), heads = qk.size(1), D = qk.size(2), half = D / 2;
  TORCH_CHECK(D <= 1 || qk.stride(2) == 1, "rope_rotate_half_: qk must have unit stride along D");
  check_rows(cos, "rope_rotate_half_: cos", N, D);
  check_rows(sin, "rope_rotate_half_: sin", N, D);
  if (N == 0 || heads == 0 || D == 0) return;
  float* qp = qk.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t s0 = qk.stride(0), s1 = qk.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  for_rows(N, heads * D, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* c = cp + n * cs;
      const float* s = sp + n * ss;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = qp + n * s0 + h * s1;
        int64_t i = 0;
#ifdef __AVX2__
        const __m256 sign = _mm256_set1_ps(-0.f);
        for (; i + 8 <= half; i += 8) {
          const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
          const __m256 o1 = _mm256_add_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)),
                                          _mm256_mul_ps(_mm256_xor_ps(x2, sign), _mm256_loadu_ps(s + i)));
          const __m256 o2 = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + i)),
                                          _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + i)));
          _mm256_storeu_ps(x + i, o1);
          _mm256_storeu_ps(x + half + i, o2);
        }
#endif
        for (; i < half; ++i) {
          const float x1 = x[i], x2 = x[half + i];
          x[i] = x1 * c[i] + (-x2) * s[i];
          x[half + i] = x2 * c[half + i] + x1 * s[half + i];
        }
      }
    }
  });
}

bool built_with_avx2() {
#ifdef __AVX2__
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "fused float32 elementwise kernels for the CPU decoder layer (RMSNorm, SiLU-and-mul, RoPE)";
  module.def("rms_norm", &rms_norm, "out[N, H] = x * rsqrt(mean(x^2, -1) + eps) * weight", py::arg("x"),
             py::arg("weight"), py::arg("eps"));
  module.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x (in place); return rms_norm(residual)",
             py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  module.def("silu_and_mul", &silu_and_mul, "out[N, F] = silu(gate_up[:, :F]) * gate_up[:, F:]", py::arg("gate_up"));
  module.def("rope_rotate_half_", &rope_rotate_half_, "qk[N, heads, D] = qk * cos + rotate_half(qk) * sin, in place",
             py::arg("qk"), py::arg("cos"), py::arg("sin"));
  module.def("built_with_avx2", &built_with_avx2, "whether the AVX2+FMA path was compiled in");
}
