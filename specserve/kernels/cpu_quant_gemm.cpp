// CPU GEMM straight from GGUF block-quantized weights: y = x @ W.T with W stored as Q4_1 or Q8_0 blocks.
//
// Block formats (32 consecutive weights along K of one output row n, group g = k / 32):
//   Q4_1: w[n, 32g + j] = d[n,g] * (qs[n,g,j] & 0xF) + m[n,g],  w[n, 32g + 16 + j] = d[n,g] * (qs[n,g,j] >> 4) + m[n,g]
//   Q8_0: w[n, 32g + j] = d[n,g] * qs[n,g,j]                     (qs int8)
// The scales d, m arrive here already widened from float16 to float32 (exactly) by the Python side.
//
// Identity used by both kernels (xsum[r,g] = sum of the 32 x values of group g, computed once per call):
//   y[r,n] = sum_g d[n,g] * (x[r, g] . q[n, g]) + m[n,g] * xsum[r,g]
// so a group's integer codes are converted to float once and FMA'd against up to kRowTile rows of x; each row keeps
// one 8-lane accumulator, scaled by d with one vector FMA per group, and is reduced horizontally once per output.
// For Q4_1 with K <= 768 (SmolLM2's q|k|v, o, gate|up) and more than 6 rows, rows go 8 at a time and the group's
// weights are scaled by d before the FMAs instead (tile_scaled_avx2): four FMAs per (group, row) instead of five;
// 5-15% faster at M = 7..16. Up to 6 rows (a speculative verify step at batch 1) form one tile_avx2 tile.
//
// Decoding is memory-bandwidth bound: a Q4_1 group is 16 + 8 bytes for 32 weights (0.75 B/weight) against 4 B/weight
// for fp32, so the kernel only has to unpack faster than memory delivers; work is split over N with at::parallel_for
// (torch's intra-op pool, so torch.set_num_threads applies).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;     // weights per GGUF block
constexpr int64_t kRowTile = 4;    // rows of x sharing one unpacked group
constexpr int64_t kWideRowTile = 8;  // ... for Q4_1 with K <= kWideTileMaxK: 8 rows of x (24 KiB) stay in L1
constexpr int64_t kWideTileMaxK = 768;
constexpr int64_t kSingleTileMaxRows = 6;  // up to this many rows of x form a single tile
constexpr int64_t kMinWorkPerTask = 4096;  // (group, row) products per parallel task, below which threads cost more
constexpr int64_t kCodeBlockBytes = 8192;  // weight bytes of the output rows computed together (L1-resident)

struct Q4_1Format {
  static constexpr int64_t kCodeBytes = 16;
  static constexpr bool kHasMin = true;
  using Code = uint8_t;
  // codes -> the 32 integer values of the group, as floats, in weight order
  static inline void to_float_scalar(const Code* q, float* out) {
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<float>(q[j] & 0xF);
      out[j + 16] = static_cast<float>(q[j] >> 4);
    }
  }
#ifdef __AVX2__
  // w[0]: weights 0-7, w[1]: 8-15, w[2]: 16-23, w[3]: 24-31
  static inline void to_float_avx2(const Code* q, __m256 w[4]) {
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));      // bytes 0-7
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));  // bytes 8-15
    const __m256i low = _mm256_set1_epi32(0xF);
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));
    w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));  // a byte's high nibble: the zero-extended byte >> 4
    w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
  }
#endif
};

struct Q8_0Format {
  static constexpr int64_t kCodeBytes = 32;
  static constexpr bool kHasMin = false;
  using Code = int8_t;
  static inline void to_float_scalar(const Code* q, float* out) {
    for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(q[j]);
  }
#ifdef __AVX2__
  static inline void to_float_avx2(const Code* q, __m256 w[4]) {
    for (int i = 0; i < 4; ++i) {
      w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i))));
    }
  }
#endif
};

// xsum[r, g] = sum_j x[r, 32g + j]
void group_sums(const float* x, int64_t num_rows, int64_t num_groups, float* xsum) {
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t g = 0; g < num_groups; ++g) {
      const float* xg = x + (r * num_groups + g) * kBlock;
      float s = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) s += xg[j];
      xsum[r * num_groups + g] = s;
    }
  }
}

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[r, n] for rows r0 .. r0+R-1 of x and one output row n.
template <typename Fmt, int R>
inline void tile_avx2(const float* x, const float* xsum, int64_t num_groups, const typename Fmt::Code* q,
                      const float* d, const float* m, float* y, int64_t y_stride) {
  const int64_t K = num_groups * kBlock;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    __m256 w[4];
    Fmt::to_float_avx2(q + g * Fmt::kCodeBytes, w);
    const __m256 dg = _mm256_broadcast_ss(d + g);
    for (int r = 0; r < R; ++r) {
      const float* xg = x + r * K + g * kBlock;
      __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
      t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), t);
      t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), t);
      t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), t);
      acc[r] = _mm256_fmadd_ps(dg, t, acc[r]);
    }
  }
  if constexpr (Fmt::kHasMin) {  // + sum_g m[g] * xsum[r, g], eight groups per FMA
    int64_t g = 0;
    for (; g + 8 <= num_groups; g += 8) {
      const __m256 mg = _mm256_loadu_ps(m + g);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(mg, _mm256_loadu_ps(xsum + r * num_groups + g), acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float tail = 0.f;
      for (int64_t gt = g; gt < num_groups; ++gt) tail += m[gt] * xsum[r * num_groups + gt];
      y[r * y_stride] = hsum(acc[r]) + tail;
    }
  } else {
    for (int r = 0; r < R; ++r) y[r * y_stride] = hsum(acc[r]);
  }
}
// y[r, n] for rows r0 .. r0+R-1 of x and one output row n (R = 5..8, Q4_1 with K small enough that the 8 rows of x
// stay in L1): the group's weights are unpacked and scaled by d once (w * d: four multiplies shared by the R rows) and
// FMA'd straight into the rows' accumulators, so a (group, row) pair costs four FMAs instead of five (tile_avx2's
// separate dot product t and its d * t). R independent accumulators keep the FMA chains overlapped.
template <typename Fmt, int R>
inline void tile_scaled_avx2(const float* x, const float* xsum, int64_t num_groups, const typename Fmt::Code* q,
                             const float* d, const float* m, float* y, int64_t y_stride) {
  const int64_t K = num_groups * kBlock;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    __m256 w[4];
    Fmt::to_float_avx2(q + g * Fmt::kCodeBytes, w);
    const __m256 dg = _mm256_broadcast_ss(d + g);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(w[i], dg);
    for (int r = 0; r < R; ++r) {
      const float* xg = x + r * K + g * kBlock;
      __m256 a = acc[r];
      a = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xg), a);
      a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), a);
      a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), a);
      a = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), a);
      acc[r] = a;
    }
  }
  if constexpr (Fmt::kHasMin) {  // + sum_g m[g] * xsum[r, g], eight groups per FMA
    int64_t g = 0;
    for (; g + 8 <= num_groups; g += 8) {
      const __m256 mg = _mm256_loadu_ps(m + g);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(mg, _mm256_loadu_ps(xsum + r * num_groups + g), acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float tail = 0.f;
      for (int64_t gt = g; gt < num_groups; ++gt) tail += m[gt] * xsum[r * num_groups + gt];
      y[r * y_stride] = hsum(acc[r]) + tail;
    }
  } else {
    for (int r = 0; r < R; ++r) y[r * y_stride] = hsum(acc[r]);
  }
}
#endif  // __AVX2__

template <typename Fmt>
void tile_scalar(const float* x, const float* xsum, int64_t num_rows, int64_t num_groups, const typename Fmt::Code* q,
                 const float* d, const float* m, float* y, int64_t y_stride) {
  const int64_t K = num_groups * kBlock;
  float acc[kWideRowTile] = {};
  float w[kBlock];
  for (int64_t g = 0; g < num_groups; ++g) {
    Fmt::to_float_scalar(q + g * Fmt::kCodeBytes, w);
    for (int64_t r = 0; r < num_rows; ++r) {
      const float* xg = x + r * K + g * kBlock;
      float t = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) t += w[j] * xg[j];
      acc[r] += d[g] * t;
      if constexpr (Fmt::kHasMin) acc[r] += m[g] * xsum[r * num_groups + g];
    }
  }
  for (int64_t r = 0; r < num_rows; ++r) y[r * y_stride] = acc[r];
}

template <typename Fmt>
void tile(const float* x, const float* xsum, int64_t num_rows, int64_t num_groups, const typename Fmt::Code* q,
          const float* d, const float* m, float* y, int64_t y_stride) {
#ifdef __AVX2__
  switch (num_rows) {
    case 8: return tile_scaled_avx2<Fmt, 8>(x, xsum, num_groups, q, d, m, y, y_stride);
    case 7: return tile_scaled_avx2<Fmt, 7>(x, xsum, num_groups, q, d, m, y, y_stride);
    case 6: return tile_avx2<Fmt, 6>(x, xsum, num_groups, q, d, m, y, y_stride);
    case 5: return tile_avx2<Fmt, 5>(x, xsum, num_groups, q, d, m, y, y_stride);
    case 4: return tile_avx2<Fmt, 4>(x, xsum, num_groups, q, d, m, y, y_stride);
    case 3: return tile_avx2<Fmt, 3>(x, xsum, num_groups, q, d, m, y, y_stride);
    case 2: return tile_avx2<Fmt, 2>(x, xsum, num_groups, q, d, m, y, y_stride);
    default: return tile_avx2<Fmt, 1>(x, xsum, num_groups, q, d, m, y, y_stride);
  }
#else
  tile_scalar<Fmt>(x, xsum, num_rows, num_groups, q, d, m, y, y_stride);
#endif
}

template <typename Fmt>
torch::Tensor quant_gemm(const torch::Tensor& x_in,  // [M, K] float32
                         const torch::Tensor& qs,    // [N, K/32, code bytes] uint8 (Q4_1) or int8 (Q8_0)
                         const torch::Tensor& d,     // [N, K/32] float32
                         const torch::Tensor* m) {   // [N, K/32] float32, Q4_1 only
  TORCH_CHECK(x_in.device().is_cpu() && qs.device().is_cpu() && d.device().is_cpu(), "quant_gemm: CPU tensors only");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "quant_gemm: x must be float32 [M, K]");
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == Fmt::kCodeBytes && qs.is_contiguous(),
              "quant_gemm: qs must be contiguous [N, K/32, ", Fmt::kCodeBytes, "]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = qs.size(0), G = qs.size(1);
  TORCH_CHECK(K == G * kBlock, "quant_gemm: x has K=", K, " but the weight has ", G, " blocks of 32 per row");
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.is_contiguous() && d.dim() == 2 && d.size(0) == N &&
                  d.size(1) == G, "quant_gemm: d must be contiguous float32 [N, K/32]");
  if (m != nullptr) {
    TORCH_CHECK(m->scalar_type() == torch::kFloat32 && m->is_contiguous() && m->dim() == 2 && m->size(0) == N &&
                    m->size(1) == G, "quant_gemm: m must be contiguous float32 [N, K/32]");
  }
  const torch::Tensor x = x_in.contiguous();
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();

  torch::Tensor xsum_t = torch::empty({Fmt::kHasMin ? M : 0, G}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xsum = xsum_t.data_ptr<float>();
  if constexpr (Fmt::kHasMin) group_sums(xp, M, G, xsum);
  const auto* qp = reinterpret_cast<const typename Fmt::Code*>(qs.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = m != nullptr ? m->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();

  const int64_t grain = std::max<int64_t>(1, kMinWorkPerTask / (G * M));
  // Loop order: a block of output rows whose codes fit in L1 (~8 KiB) x a tile of kRowTile rows of x, so both
  // stay in L1 while every (row, output) pair of the block is computed; x beyond a few rows lives in L2 and
  // re-reading all of it for every output row made batch 32 L2-bandwidth bound.
  const int64_t block_n = std::max<int64_t>(1, kCodeBlockBytes / (G * (Fmt::kCodeBytes + 8)));
  // Q4_1 rows of x go 8 at a time when they fit in L1 (measured faster there); Q8_0 (unpacking is cheaper, the LM
  // head's codes are twice the bytes) and long K stay at 4.
  // A verify step of one request (1 + num_spec_tokens rows, up to 6) goes in one tile whatever K (splitting it as
  // 4 + 1 unpacked every group twice and ran the last row alone), through tile_avx2, whose per-group dot products
  // are independent chains: tile_scaled_avx2's loop-carried accumulators made 5 rows cost like 8.
  const int64_t row_tile =
      M <= kSingleTileMaxRows ? M : (Fmt::kHasMin && K <= kWideTileMaxK ? kWideRowTile : kRowTile);
  at::parallel_for(0, N, grain, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t nb = n_begin; nb < n_end; nb += block_n) {
      const int64_t nb_end = std::min(n_end, nb + block_n);
      for (int64_t r0 = 0; r0 < M; r0 += row_tile) {
        for (int64_t n = nb; n < nb_end; ++n) {
          tile<Fmt>(xp + r0 * K, xsum + (Fmt::kHasMin ? r0 * G : 0), std::min(row_tile, M - r0), G,
                    qp + n * G * Fmt::kCodeBytes, dp + n * G, mp != nullptr ? mp + n * G : nullptr, yp + r0 * N + n,
                    N);
        }
      }
    }
  });
  return y;
}

torch::Tensor q4_1_gemm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                        const torch::Tensor& m) {
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8, "q4_1_gemm: qs must be uint8");
  return quant_gemm<Q4_1Format>(x, qs, d, &m);
}

torch::Tensor q8_0_gemm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d) {
  TORCH_CHECK(qs.scalar_type() == torch::kInt8, "q8_0_gemm: qs must be int8");
  return quant_gemm<Q8_0Format>(x, qs, d, nullptr);
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
  module.doc() = "GEMM from GGUF Q4_1 / Q8_0 block-quantized weights on CPU";
  module.def("q4_1_gemm", &q4_1_gemm, "y[M, N] = x[M, K] @ dequant(Q4_1 qs[N, K/32, 16], d, m).T",
             py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("m"));
  module.def("q8_0_gemm", &q8_0_gemm, "y[M, N] = x[M, K] @ dequant(Q8_0 qs[N, K/32, 32], d).T",
             py::arg("x"), py::arg("qs"), py::arg("d"));
  module.def("built_with_avx2", &built_with_avx2, "whether the AVX2+FMA path was compiled in");
}
