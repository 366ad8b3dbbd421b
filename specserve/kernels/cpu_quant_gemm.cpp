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
#include <cstring>
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
// The integer dot products are exact, so the only new error is the rounding of x to int8 (up to half a step, dx / 2,
// per element). _mm256_maddubs_epi16 multiplies unsigned bytes by signed bytes and adds adjacent pairs into int16.
//
// Q4_1 (the hot path): a product is at most 15 * 127 = 1905, so 16 products (30480) still fit in int16. The codes are
// re-laid once at load time (QuantizedWeight.int8_codes) so that eight groups share every vector: in a chunk of 8
// groups, vector v_j (j = 0..7, 32 bytes) holds codes 4j..4j+3 of groups 0..7 (4 bytes per group), and x is permuted
// the same way per call (an 8 x 8 transpose of 4-byte words per 256 bytes). Then per (row, chunk): 8 maddubs whose
// int16 results are summed lane-wise (each lane: 16 products of one group), one madd with ones (int16 pairs -> the
// eight groups' int32 dot products, one per lane), one convert, one multiply by d * dx of the 8 groups and one FMA:
// about 2.4 vector operations per (row, group) instead of 4 (one madd, convert and FMA per group) or the float path's
// 5 FMAs. The chunk's 128 code bytes unpack in 12 operations shared by the rows. In memory (per output row):
//   chunk c (128 bytes): byte 32t + 4i + e = code(group 8c + i, k = 8t + e) | code(group 8c + i, k = 8t + 4 + e) << 4
//   then the last G % 8 groups in GGUF's own 16-byte layout (one madd, convert and FMA each).
// Q8_0 (SmolLM2's LM head): signed codes, so the weight goes in as |q| and its sign moves onto x (_mm256_sign_epi8;
// |-128| = 128 as an unsigned byte). A pair sum can reach 2 * 128 * 127, so every maddubs result is widened (madd with
// ones) and summed in int32; the same interleaved layout (chunk byte 32j + 4i + e = code(group 8c + i, k = 4j + e),
// tail groups in GGUF's 32 bytes) still leaves one convert, multiply and FMA per 8 groups.
//
// A row's float operations (one 8-lane accumulator, chunks then tail groups in order, then the m * xs sum and one
// horizontal sum) do not depend on how many rows share the call or on the thread split: a row computed alone equals
// the same row inside a verify step of 1 + num_spec_tokens rows, bit for bit, so speculative greedy output equals
// plain greedy output.

constexpr int64_t kQ8RowTile = 8;      // rows of int8 x sharing one unpacked weight chunk (x: <= 8 x 1536 B, in L1)
constexpr int64_t kChunkGroups = 8;    // Q4_1 int8 layout: groups interleaved per chunk
constexpr int64_t kChunkBytes = 128;   // ... 8 groups x 32 codes x 4 bits
constexpr int64_t kTailGroupBytes = 16;

inline int64_t q4_1_int8_row_bytes(int64_t num_groups) {
  return num_groups / kChunkGroups * kChunkBytes + num_groups % kChunkGroups * kTailGroupBytes;
}

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

// xq [M, K] -> xp [M, K] in the Q4_1 int8 layout's order: per chunk of 8 groups (256 bytes, 8 x 8 words of 4 bytes
// with word (i, j) = x[group i, 4j..4j+3]), word (i, j) moves to position (j, i); the tail groups are copied as they are.
void interleave_rows(const int8_t* xq, int64_t num_rows, int64_t num_groups, int8_t* xp) {
  const int64_t K = num_groups * kBlock, chunk_end = num_groups / kChunkGroups * kChunkGroups * kBlock;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int8_t* src = xq + r * K;
    int8_t* dst = xp + r * K;
    for (int64_t c = 0; c < chunk_end; c += kChunkGroups * kBlock) {
      for (int i = 0; i < 8; ++i) {
        for (int j = 0; j < 8; ++j) std::memcpy(dst + c + 32 * j + 4 * i, src + c + 32 * i + 4 * j, 4);
      }
    }
    std::memcpy(dst + chunk_end, src + chunk_end, K - chunk_end);
  }
}

// Code of weight k (0..31) of group g in one output row of the Q4_1 int8 layout (the scalar path reads it this way).
inline int32_t q4_1_int8_code(const uint8_t* row, int64_t num_groups, int64_t g, int64_t k) {
  const int64_t num_chunked = num_groups / kChunkGroups * kChunkGroups;
  if (g >= num_chunked) {
    const uint8_t b = row[num_groups / kChunkGroups * kChunkBytes + (g - num_chunked) * kTailGroupBytes + k % 16];
    return k < 16 ? (b & 0xF) : (b >> 4);
  }
  const int64_t j = k / 4;  // word of the group; words 2t and 2t + 1 share bytes (low and high nibble)
  const uint8_t b = row[g / kChunkGroups * kChunkBytes + 32 * (j / 2) + 4 * (g % kChunkGroups) + k % 4];
  return j % 2 ? (b >> 4) : (b & 0xF);
}

// Code of weight k (0..31) of group g in one output row of the Q8_0 int8 layout.
inline int32_t q8_0_int8_code(const int8_t* row, int64_t num_groups, int64_t g, int64_t k) {
  if (g >= num_groups / kChunkGroups * kChunkGroups) return row[g * kBlock + k];
  return row[g / kChunkGroups * kChunkGroups * kBlock + 32 * (k / 4) + 4 * (g % kChunkGroups) + k % 4];
}

#ifdef __AVX2__
// y[r, n] = hsum(acc[r]) (+ sum_g m[g] * xs[r, g] for Q4_1, eight groups per FMA): the end of every int8 tile.
template <int R>
inline void finish_rows(__m256 acc[R], const float* m, const float* xs, int64_t num_groups, float* y,
                        int64_t y_stride) {
  if (m == nullptr) {
    for (int r = 0; r < R; ++r) y[r * y_stride] = hsum(acc[r]);
    return;
  }
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
}

// Q4_1, int8 layout: y[r, n] for rows r0 .. r0+R-1 of the interleaved int8 x (xp) and one output row n.
template <int R>
inline void tile_q4_1_q8_avx2(const int8_t* xp, const float* dx, const float* xs, int64_t num_groups,
                              const uint8_t* codes, const float* d, const float* m, float* y, int64_t y_stride) {
  const int64_t K = num_groups * kBlock, num_chunks = num_groups / kChunkGroups;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low = _mm256_set1_epi8(0xF);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < num_chunks; ++c) {
    __m256i w[8];  // w[j]: codes 4j..4j+3 of the chunk's 8 groups
    for (int t = 0; t < 4; ++t) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c * kChunkBytes + 32 * t));
      w[2 * t] = _mm256_and_si256(b, low);
      w[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    }
    const __m256 dc = _mm256_loadu_ps(d + c * kChunkGroups);
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xp + r * K + c * kChunkGroups * kBlock;
      __m256i s = _mm256_maddubs_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr)));
      for (int j = 1; j < 8; ++j) {  // int16 lanes: at most 16 products of 15 * 127, no overflow
        const __m256i xj = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32 * j));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[j], xj));
      }
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));  // lane i: group 8c + i
      const __m256 scale = _mm256_mul_ps(dc, _mm256_loadu_ps(dx + r * num_groups + c * kChunkGroups));
      acc[r] = _mm256_fmadd_ps(dot, scale, acc[r]);
    }
  }
  const __m128i low128 = _mm_set1_epi8(0xF);
  for (int64_t g = num_chunks * kChunkGroups; g < num_groups; ++g) {  // tail groups, GGUF layout
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
        codes + num_chunks * kChunkBytes + (g - num_chunks * kChunkGroups) * kTailGroupBytes));
    const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low128), _mm_and_si128(b, low128));
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + r * K + g * kBlock));
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d[g] * dx[r * num_groups + g]), acc[r]);
    }
  }
  finish_rows<R>(acc, m, xs, num_groups, y, y_stride);
}

// Q8_0, int8 layout: y[r, n] for rows r0 .. r0+R-1 of the interleaved int8 x (xp) and one output row n.
template <int R>
inline void tile_q8_0_q8_avx2(const int8_t* xp, const float* dx, int64_t num_groups, const int8_t* codes,
                              const float* d, float* y, int64_t y_stride) {
  const int64_t K = num_groups * kBlock, num_chunks = num_groups / kChunkGroups;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int8_t* qc = codes + c * kChunkGroups * kBlock;
    alignas(32) uint8_t magnitude[kChunkGroups * kBlock];  // |q| of the chunk, shared by the R rows
    for (int j = 0; j < 8; ++j) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qc + 32 * j));
      _mm256_store_si256(reinterpret_cast<__m256i*>(magnitude + 32 * j), _mm256_abs_epi8(q));
    }
    const __m256 dc = _mm256_loadu_ps(d + c * kChunkGroups);
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xp + r * K + c * kChunkGroups * kBlock;
      __m256i s = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {  // int32 lanes: a pair sum (<= 2 * 128 * 127) is widened before adding
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qc + 32 * j));
        const __m256i x = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32 * j)), q);
        const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(magnitude + 32 * j));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
      }
      const __m256 scale = _mm256_mul_ps(dc, _mm256_loadu_ps(dx + r * num_groups + c * kChunkGroups));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
    }
  }
  for (int64_t g = num_chunks * kChunkGroups; g < num_groups; ++g) {  // tail groups, GGUF layout
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * kBlock));
    const __m256i w = _mm256_abs_epi8(q);
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + r * K + g * kBlock));
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_sign_epi8(x, q)), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d[g] * dx[r * num_groups + g]), acc[r]);
    }
  }
  finish_rows<R>(acc, nullptr, nullptr, num_groups, y, y_stride);
}

// f(std::integral_constant<int, R>{}) for R = num_rows (1..8): the tiles are unrolled over their rows.
template <typename F>
inline void with_row_count(int64_t num_rows, F&& f) {
  switch (num_rows) {
    case 8: return f(std::integral_constant<int, 8>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}
#endif  // __AVX2__

// Scalar int8 tiles (CPUs without AVX2): the same integer dot products, each row on its own, x in GGUF order.
void tile_q4_1_q8_scalar(const int8_t* xq, const float* dx, const float* xs, int64_t num_rows, int64_t num_groups,
                         const uint8_t* codes, const float* d, const float* m, float* y, int64_t y_stride) {
  const int64_t K = num_groups * kBlock;
  for (int64_t r = 0; r < num_rows; ++r) {
    float acc = 0.f;
    for (int64_t g = 0; g < num_groups; ++g) {
      int32_t dot = 0;
      for (int64_t k = 0; k < kBlock; ++k) dot += q4_1_int8_code(codes, num_groups, g, k) * xq[r * K + g * kBlock + k];
      acc += static_cast<float>(dot) * (d[g] * dx[r * num_groups + g]) + m[g] * xs[r * num_groups + g];
    }
    y[r * y_stride] = acc;
  }
}

void tile_q8_0_q8_scalar(const int8_t* xq, const float* dx, int64_t num_rows, int64_t num_groups, const int8_t* q,
                         const float* d, float* y, int64_t y_stride) {
  const int64_t K = num_groups * kBlock;
  for (int64_t r = 0; r < num_rows; ++r) {
    float acc = 0.f;
    for (int64_t g = 0; g < num_groups; ++g) {
      int32_t dot = 0;
      for (int64_t k = 0; k < kBlock; ++k) dot += q8_0_int8_code(q, num_groups, g, k) * xq[r * K + g * kBlock + k];
      acc += static_cast<float>(dot) * (d[g] * dx[r * num_groups + g]);
    }
    y[r * y_stride] = acc;
  }
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

void check_q8_args(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d, const torch::Tensor* m,
                   int64_t row_bytes) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && d.device().is_cpu(), "quant_gemm_q8: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) % kBlock == 0,
              "quant_gemm_q8: x must be float32 [M, K] with K a multiple of 32");
  const int64_t N = codes.size(0), G = x.size(1) / kBlock;
  TORCH_CHECK(codes.is_contiguous() && codes.numel() == N * row_bytes,
              "quant_gemm_q8: the codes must be contiguous with ", row_bytes, " bytes per output row for K=", x.size(1));
  for (const torch::Tensor* t : {&d, m}) {
    if (t == nullptr) continue;
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == G, "quant_gemm_q8: d and m must be contiguous float32 [N, K/32]");
  }
}

// Runs tile(n, r0, num_rows) for every output row n and tile of up to kQ8RowTile rows, threads over N.
template <typename Tile>
void for_each_tile(int64_t M, int64_t N, int64_t G, int64_t row_bytes, const Tile& tile) {
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerTask / (G * M));
  const int64_t block_n = std::max<int64_t>(1, kCodeBlockBytes / (row_bytes + 8 * G));
  at::parallel_for(0, N, grain, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t nb = n_begin; nb < n_end; nb += block_n) {
      const int64_t nb_end = std::min(n_end, nb + block_n);
      for (int64_t r0 = 0; r0 < M; r0 += kQ8RowTile) {
        for (int64_t n = nb; n < nb_end; ++n) tile(n, r0, std::min(kQ8RowTile, M - r0));
      }
    }
  });
}

torch::Tensor q4_1_gemm_q8(const torch::Tensor& x,      // [M, K] float32, quantized here per block of 32
                           const torch::Tensor& codes,  // [N, q4_1_int8_row_bytes(K/32)] uint8, the int8 layout
                           const torch::Tensor& d,      // [N, K/32] float32
                           const torch::Tensor& m) {    // [N, K/32] float32
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.dim() == 2, "q4_1_gemm_q8: codes must be uint8 [N, bytes]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / kBlock;
  const int64_t row_bytes = q4_1_int8_row_bytes(G);
  check_q8_args(x, codes, d, &m, row_bytes);
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const std::vector<torch::Tensor> xq_dx_xs = quantize_q8(x);
  const float* dx = xq_dx_xs[1].data_ptr<float>();
  const float* xs = xq_dx_xs[2].data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#ifdef __AVX2__
  torch::Tensor xp_t = torch::empty_like(xq_dx_xs[0]);
  interleave_rows(xq_dx_xs[0].data_ptr<int8_t>(), M, G, xp_t.data_ptr<int8_t>());
  const int8_t* xp = xp_t.data_ptr<int8_t>();
  for_each_tile(M, N, G, row_bytes, [&](int64_t n, int64_t r0, int64_t rows) {
    with_row_count(rows, [&](auto r) {
      tile_q4_1_q8_avx2<decltype(r)::value>(xp + r0 * K, dx + r0 * G, xs + r0 * G, G, cp + n * row_bytes, dp + n * G,
                                            mp + n * G, yp + r0 * N + n, N);
    });
  });
#else
  const int8_t* xq = xq_dx_xs[0].data_ptr<int8_t>();
  for_each_tile(M, N, G, row_bytes, [&](int64_t n, int64_t r0, int64_t rows) {
    tile_q4_1_q8_scalar(xq + r0 * K, dx + r0 * G, xs + r0 * G, rows, G, cp + n * row_bytes, dp + n * G, mp + n * G,
                        yp + r0 * N + n, N);
  });
#endif
  return y;
}

torch::Tensor q8_0_gemm_q8(const torch::Tensor& x,      // [M, K] float32, quantized here per block of 32
                           const torch::Tensor& codes,  // [N, K] int8, the int8 layout (QuantizedWeight.int8_codes)
                           const torch::Tensor& d) {    // [N, K/32] float32
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.dim() == 2, "q8_0_gemm_q8: codes must be int8 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / kBlock;
  check_q8_args(x, codes, d, nullptr, G * kBlock);
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const std::vector<torch::Tensor> xq_dx_xs = quantize_q8(x);
  const float* dx = xq_dx_xs[1].data_ptr<float>();
  const int8_t* qp = codes.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#ifdef __AVX2__
  torch::Tensor xp_t = torch::empty_like(xq_dx_xs[0]);
  interleave_rows(xq_dx_xs[0].data_ptr<int8_t>(), M, G, xp_t.data_ptr<int8_t>());
  const int8_t* xp = xp_t.data_ptr<int8_t>();
  for_each_tile(M, N, G, G * kBlock, [&](int64_t n, int64_t r0, int64_t rows) {
    with_row_count(rows, [&](auto r) {
      tile_q8_0_q8_avx2<decltype(r)::value>(xp + r0 * K, dx + r0 * G, G, qp + n * K, dp + n * G, yp + r0 * N + n, N);
    });
  });
#else
  const int8_t* xq = xq_dx_xs[0].data_ptr<int8_t>();
  for_each_tile(M, N, G, G * kBlock, [&](int64_t n, int64_t r0, int64_t rows) {
    tile_q8_0_q8_scalar(xq + r0 * K, dx + r0 * G, rows, G, qp + n * K, dp + n * G, yp + r0 * N + n, N);
  });
#endif
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
  module.def("quantize_q8", &quantize_q8, "x[M, K] -> (xq int8 [M, K], dx [M, K/32], xs = dx * sum xq [M, K/32])",
             py::arg("x"));
  module.def("q4_1_gemm_q8", &q4_1_gemm_q8, "q4_1_gemm with x quantized to int8 per block of 32 (integer dots); "
             "codes in the int8 layout (QuantizedWeight.int8_codes)", py::arg("x"), py::arg("codes"), py::arg("d"),
             py::arg("m"));
  module.def("q8_0_gemm_q8", &q8_0_gemm_q8, "q8_0_gemm with x quantized to int8 per block of 32 (integer dots); "
             "codes in the int8 layout (QuantizedWeight.int8_codes)", py::arg("x"), py::arg("codes"), py::arg("d"));
  module.def("built_with_avx2", &built_with_avx2, "whether the AVX2+FMA path was compiled in");
}
