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
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

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

// ---- int8 activations (opt-in: EngineConfig.cpu_activation_quant = "q8") ----------------------------------------
//
// The idea is llama.cpp's (its Q8_1 activation blocks against Q4_x weights); this is our own code. Each row of x is
// quantized per block of 32 to int8 with one float scale: dx = max|x| / 127, xq = round-half-even(x * (1 / dx))
// (xq in [-127, 127]; dx = 0 and xq = 0 for an all-zero block), and xs = dx * sum_j xq[j]. Then per (row r, group g):
//   Q4_1: y[r,n] += (d * dx) * sum_j q[j] * xq[j]  +  m * xs      (q: unsigned 4-bit codes)
//   Q8_0: y[r,n] += (d * dx) * sum_j q[j] * xq[j]                  (q: signed 8-bit codes)
// The integer dot product is exact (_mm256_maddubs_epi16: unsigned byte x signed byte, adjacent pairs summed into
// int16 without saturation for these ranges; _mm256_madd_epi16 with ones widens to int32), so the only new error is
// the rounding of x to int8 (relative ~1/254 of a block's largest |x| per element). Q8_0 codes are signed, so the
// weight goes in as |q| and its sign moves onto x (_mm256_sign_epi8); |-128| = 128 as an unsigned byte.
// A row's float operations (one 8-lane accumulator, groups in order, then the m * xs sum and one horizontal sum) do
// not depend on how many rows share the call or on the thread split: a row computed alone equals the same row inside
// a verify step of 1 + num_spec_tokens rows, bit for bit, so speculative greedy output equals plain greedy output.

constexpr int64_t kQ8RowTile = 8;  // rows of int8 x sharing one unpacked weight group (x: <= 8 x 1536 B, in L1)
constexpr int64_t kQ8ScaleChunk = 64;  // groups whose d * dx are precomputed together (a [R, 64] stack buffer)

// One block of 32 floats -> 32 int8, its scale dx and xs = dx * sum(xq). Scalar: the reference the AVX2 path matches.
inline void quantize_block_scalar(const float* x, int8_t* xq, float* dx_out, float* xs_out) {
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float dx = amax / 127.f;
  const float id = dx != 0.f ? 1.f / dx : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[j] * id));  // default rounding: half to even
    xq[j] = static_cast<int8_t>(v);
    sum += v;
  }
  *dx_out = dx;
  *xs_out = dx * static_cast<float>(sum);
}

#ifdef __AVX2__
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

inline void quantize_block_avx2(const float* x, int8_t* xq, float* dx_out, float* xs_out) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                  _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
  const float dx = hmax(mx) / 127.f;
  const __m256 id = _mm256_set1_ps(dx != 0.f ? 1.f / dx : 0.f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));  // MXCSR default: half to even
  const int32_t sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3])));
  // packs work per 128-bit lane: dwords come out as [x0:0-3, x1:0-3, x2:0-3, x3:0-3 | x0:4-7, x1:4-7, ...]
  const __m256i i8 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(i8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq), ordered);
  *dx_out = dx;
  *xs_out = dx * static_cast<float>(sum);
}
#endif

// x [M, K] -> xq [M, K] int8, dx [M, G], xs [M, G]
void quantize_rows_q8(const float* x, int64_t num_rows, int64_t num_groups, int8_t* xq, float* dx, float* xs) {
  for (int64_t b = 0; b < num_rows * num_groups; ++b) {
#ifdef __AVX2__
    quantize_block_avx2(x + b * kBlock, xq + b * kBlock, dx + b, xs + b);
#else
    quantize_block_scalar(x + b * kBlock, xq + b * kBlock, dx + b, xs + b);
#endif
  }
}

#ifdef __AVX2__
// The 32 codes of a group as bytes in weight order (Q4_1: low nibbles are weights 0-15, high nibbles 16-31), and
// the x of one row as the bytes maddubs multiplies them with (Q8_0: x carries the weight's sign).
struct Q4_1Int8 {
  static constexpr int64_t kCodeBytes = 16;
  static constexpr bool kHasMin = true;
  using Code = uint8_t;
  static inline __m256i weight_bytes(const Code* q) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i low = _mm_set1_epi8(0xF);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
  }
  static inline __m256i signed_x(__m256i x, const Code* /*q*/) { return x; }
};

struct Q8_0Int8 {
  static constexpr int64_t kCodeBytes = 32;
  static constexpr bool kHasMin = false;
  using Code = int8_t;
  static inline __m256i weight_bytes(const Code* q) {
    return _mm256_abs_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  }
  static inline __m256i signed_x(__m256i x, const Code* q) {
    return _mm256_sign_epi8(x, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  }
};

// scale[r, i] = d[g0 + i] * dx[r, g0 + i] for i < num: one multiply per 8 (row, group) pairs instead of a scalar
// multiply and a broadcast per pair in the inner loop (the same IEEE products either way).
template <int R>
inline void group_scales(const float* d, const float* dx, int64_t num_groups, int64_t g0, int64_t num,
                         float* scale) {
  for (int r = 0; r < R; ++r) {
    const float* dxr = dx + r * num_groups + g0;
    float* sr = scale + r * kQ8ScaleChunk;
    int64_t i = 0;
    for (; i + 8 <= num; i += 8) {
      _mm256_storeu_ps(sr + i, _mm256_mul_ps(_mm256_loadu_ps(d + g0 + i), _mm256_loadu_ps(dxr + i)));
    }
    for (; i < num; ++i) sr[i] = d[g0 + i] * dxr[i];
  }
}

// y[r, n] for rows r0 .. r0+R-1 of the int8 x and one output row n: per (group, row) one maddubs, one madd, one
// convert and one FMA; the group's codes are unpacked once for the R rows.
template <typename Fmt, int R>
inline void tile_q8_avx2(const int8_t* xq, const float* dx, const float* xs, int64_t num_groups,
                         const typename Fmt::Code* q, const float* d, const float* m, float* y, int64_t y_stride) {
  const int64_t K = num_groups * kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float scale[R * kQ8ScaleChunk];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < num_groups; g0 += kQ8ScaleChunk) {
    const int64_t num = std::min(kQ8ScaleChunk, num_groups - g0);
    group_scales<R>(d, dx, num_groups, g0, num, scale);
    for (int64_t i = 0; i < num; ++i) {
      const int64_t g = g0 + i;
      const typename Fmt::Code* qg = q + g * Fmt::kCodeBytes;
      const __m256i w = Fmt::weight_bytes(qg);
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + g * kBlock));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, Fmt::signed_x(x, qg)), ones);  // 8 x int32
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(scale + r * kQ8ScaleChunk + i), acc[r]);
      }
    }
  }
  if constexpr (Fmt::kHasMin) {  // + sum_g m[g] * xs[r, g], eight groups per FMA
    int64_t g = 0;
    for (; g + 8 <= num_groups; g += 8) {
      const __m256 mg = _mm256_loadu_ps(m + g);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(mg, _mm256_loadu_ps(xs + r * num_groups + g), acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float tail = 0.f;
      for (int64_t gt = g; gt < num_groups; ++gt) tail += m[gt] * xs[r * num_groups + gt];
      y[r * y_stride] = hsum(acc[r]) + tail;
    }
  } else {
    for (int r = 0; r < R; ++r) y[r * y_stride] = hsum(acc[r]);
  }
}
#endif  // __AVX2__

// Scalar int8 path (CPUs without AVX2): the same integer dot products, each row on its own.
template <typename Fmt>
void tile_q8_scalar(const int8_t* xq, const float* dx, const float* xs, int64_t num_rows, int64_t num_groups,
                    const typename Fmt::Code* q, const float* d, const float* m, float* y, int64_t y_stride) {
  const int64_t K = num_groups * kBlock;
  float w[kBlock];
  for (int64_t r = 0; r < num_rows; ++r) {
    float acc = 0.f;
    for (int64_t g = 0; g < num_groups; ++g) {
      Fmt::to_float_scalar(q + g * Fmt::kCodeBytes, w);  // small integers, exact as float
      const int8_t* xg = xq + r * K + g * kBlock;
      int32_t dot = 0;
      for (int64_t j = 0; j < kBlock; ++j) dot += static_cast<int32_t>(w[j]) * xg[j];
      acc += static_cast<float>(dot) * (d[g] * dx[r * num_groups + g]);
      if constexpr (Fmt::kHasMin) acc += m[g] * xs[r * num_groups + g];
    }
    y[r * y_stride] = acc;
  }
}

template <typename Fmt>
void tile_q8(const int8_t* xq, const float* dx, const float* xs, int64_t num_rows, int64_t num_groups,
             const typename Fmt::Code* q, const float* d, const float* m, float* y, int64_t y_stride) {
#ifdef __AVX2__
  using F = std::conditional_t<Fmt::kHasMin, Q4_1Int8, Q8_0Int8>;
  switch (num_rows) {
    case 8: return tile_q8_avx2<F, 8>(xq, dx, xs, num_groups, q, d, m, y, y_stride);
    case 7: return tile_q8_avx2<F, 7>(xq, dx, xs, num_groups, q, d, m, y, y_stride);
    case 6: return tile_q8_avx2<F, 6>(xq, dx, xs, num_groups, q, d, m, y, y_stride);
    case 5: return tile_q8_avx2<F, 5>(xq, dx, xs, num_groups, q, d, m, y, y_stride);
    case 4: return tile_q8_avx2<F, 4>(xq, dx, xs, num_groups, q, d, m, y, y_stride);
    case 3: return tile_q8_avx2<F, 3>(xq, dx, xs, num_groups, q, d, m, y, y_stride);
    case 2: return tile_q8_avx2<F, 2>(xq, dx, xs, num_groups, q, d, m, y, y_stride);
    default: return tile_q8_avx2<F, 1>(xq, dx, xs, num_groups, q, d, m, y, y_stride);
  }
#else
  tile_q8_scalar<Fmt>(xq, dx, xs, num_rows, num_groups, q, d, m, y, y_stride);
#endif
}

// x [M, K] float32 -> (xq [M, K] int8, dx [M, K/32] float32, xs [M, K/32] float32)
std::vector<torch::Tensor> quantize_q8(const torch::Tensor& x_in) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32,
              "quantize_q8: x must be float32 [M, K] on CPU");
  TORCH_CHECK(x_in.size(1) % kBlock == 0, "quantize_q8: K must be a multiple of 32");
  const torch::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), G = x.size(1) / kBlock;
  torch::Tensor xq = torch::empty({M, G * kBlock}, x.options().dtype(torch::kInt8));
  torch::Tensor dx = torch::empty({M, G}, x.options());
  torch::Tensor xs = torch::empty({M, G}, x.options());
  quantize_rows_q8(x.data_ptr<float>(), M, G, xq.data_ptr<int8_t>(), dx.data_ptr<float>(), xs.data_ptr<float>());
  return {xq, dx, xs};
}

template <typename Fmt>
torch::Tensor quant_gemm_q8(const torch::Tensor& x_in,  // [M, K] float32, quantized here per block of 32
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
  torch::Tensor y = torch::empty({M, N}, x_in.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const std::vector<torch::Tensor> xq_dx_xs = quantize_q8(x_in);
  const int8_t* xq = xq_dx_xs[0].data_ptr<int8_t>();
  const float* dx = xq_dx_xs[1].data_ptr<float>();
  const float* xs = xq_dx_xs[2].data_ptr<float>();
  const auto* qp = reinterpret_cast<const typename Fmt::Code*>(qs.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = m != nullptr ? m->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();

  const int64_t grain = std::max<int64_t>(1, kMinWorkPerTask / (G * M));
  const int64_t block_n = std::max<int64_t>(1, kCodeBlockBytes / (G * (Fmt::kCodeBytes + 8)));
  at::parallel_for(0, N, grain, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t nb = n_begin; nb < n_end; nb += block_n) {
      const int64_t nb_end = std::min(n_end, nb + block_n);
      for (int64_t r0 = 0; r0 < M; r0 += kQ8RowTile) {
        for (int64_t n = nb; n < nb_end; ++n) {
          tile_q8<Fmt>(xq + r0 * K, dx + r0 * G, xs + r0 * G, std::min(kQ8RowTile, M - r0), G,
                       qp + n * G * Fmt::kCodeBytes, dp + n * G, mp != nullptr ? mp + n * G : nullptr,
                       yp + r0 * N + n, N);
        }
      }
    }
  });
  return y;
}

torch::Tensor q4_1_gemm_q8(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                           const torch::Tensor& m) {
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8, "q4_1_gemm_q8: qs must be uint8");
  return quant_gemm_q8<Q4_1Format>(x, qs, d, &m);
}

torch::Tensor q8_0_gemm_q8(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d) {
  TORCH_CHECK(qs.scalar_type() == torch::kInt8, "q8_0_gemm_q8: qs must be int8");
  return quant_gemm_q8<Q8_0Format>(x, qs, d, nullptr);
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
  module.def("quantize_q8", &quantize_q8, "x[M, K] -> (xq int8 [M, K], dx [M, K/32], xs = dx * sum xq [M, K/32])",
             py::arg("x"));
  module.def("q4_1_gemm_q8", &q4_1_gemm_q8, "q4_1_gemm with x quantized to int8 per block of 32 (integer dots)",
             py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("m"));
  module.def("q8_0_gemm_q8", &q8_0_gemm_q8, "q8_0_gemm with x quantized to int8 per block of 32 (integer dots)",
             py::arg("x"), py::arg("qs"), py::arg("d"));
  module.def("built_with_avx2", &built_with_avx2, "whether the AVX2+FMA path was compiled in");
}
