// Causal attention over a paged KV cache on CPU, read in place (no gather of K/V into contiguous tensors).
//
// Layout (one layer):
//   q        [num_tokens, num_heads, head_dim]               f32, packed ragged batch
//   k_cache  [num_blocks, block_size, num_kv_heads, head_dim] f32, v_cache the same
//   sequence s owns packed rows cu[s] .. cu[s+1]-1 (cu = query_start_loc); its row j sits at absolute position
//   seq_lens[s] - q_len_s + j and attends to KV positions 0 .. that position; KV position p of s lives at
//   k_cache[block_tables[s][p / block_size], p % block_size]. GQA: query head h reads kv head h / (H / KVH).
//
//   Example (block_size 4, block table of s = [7, 2], seq_len 6, q_len 2): rows at positions 4, 5; position 5
//   lives at k_cache[2, 1]; row 0 (position 4) sees positions 0..4, row 1 sees 0..5.
//
// Work item = (sequence, kv head, tile of up to kMaxTileRows query rows). Its query vectors are the G = H / KVH
// query heads of that kv head for every row of the tile (G * rows vectors), so each K/V row is read once per tile.
// KV positions are walked in chunks of kChunk; per chunk:
//   scores[i, c] = (scale * q_i) . k_c            (AVX2: eight positions at once, reduced with one hadd tree)
//   masked (c past q_i's position) -> -inf
//   online softmax (Milakov & Gimelshein 2018; FlashAttention): m' = max(m, max_c s), alpha = exp(m - m'),
//   l = alpha * l + sum_c exp(s - m'), acc = alpha * acc + sum_c exp(s - m') * v_c
// and out_i = acc_i / l_i at the end. Items are handed out longest first from an atomic counter inside one
// at::parallel_for over the threads (torch's intra-op pool, so torch.set_num_threads applies).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChunk = 32;          // KV positions per online-softmax update (multiple of 8)
constexpr int64_t kMaxTileRows = 16;    // query rows per work item
constexpr int64_t kMaxTileVectors = 64; // query vectors (rows * G) per work item, to keep acc in L1/L2
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct WorkItem {
  int64_t seq;
  int64_t kv_head;
  int64_t row_begin;  // packed token index of the tile's first row
  int64_t row_end;
  int64_t pos_begin;  // absolute position of row_begin
  int64_t cost;
};

struct Problem {
  const float* q;
  int64_t q_stride_t, q_stride_h;
  const float* k_cache;
  const float* v_cache;
  int64_t cache_block_stride, cache_slot_stride;  // in floats: one block, one slot (token) of a block
  const int64_t* block_tables;
  int64_t max_blocks;
  int64_t block_size;
  int64_t num_heads, num_kv_heads, head_dim, group;  // group = num_heads / num_kv_heads
  float scale;
  float* out;  // [T, H, D] contiguous
};

inline const float* kv_row(const Problem& P, const float* cache, int64_t seq, int64_t pos, int64_t kv_head) {
  const int64_t block = P.block_tables[seq * P.max_blocks + pos / P.block_size];
  return cache + block * P.cache_block_stride + (pos % P.block_size) * P.cache_slot_stride + kv_head * P.head_dim;
}

// Scratch reused by every item one thread runs.
struct Scratch {
  std::vector<float> qbuf, acc, scores, m, l;
  std::vector<int64_t> qpos;
  explicit Scratch(int64_t vectors, int64_t head_dim)
      : qbuf(vectors * head_dim), acc(vectors * head_dim), scores(vectors * kChunk), m(vectors), l(vectors),
        qpos(vectors) {}
};

// ---------------------------------------------------------------------------------------------- scalar path

void run_item_scalar(const Problem& P, const WorkItem& w, Scratch& S) {
  const int64_t D = P.head_dim, G = P.group;
  const int64_t rows = w.row_end - w.row_begin;
  const int64_t nq = rows * G;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = r * G + g;
      const float* src = P.q + (w.row_begin + r) * P.q_stride_t + (w.kv_head * G + g) * P.q_stride_h;
      for (int64_t d = 0; d < D; ++d) S.qbuf[i * D + d] = src[d] * P.scale;
      S.qpos[i] = w.pos_begin + r;
      S.m[i] = kNegInf;
      S.l[i] = 0.f;
    }
  }
  std::fill(S.acc.begin(), S.acc.begin() + nq * D, 0.f);
  const int64_t kv_len = w.pos_begin + rows;  // last row sees positions 0 .. kv_len - 1
  for (int64_t p = 0; p < kv_len; ++p) {
    const float* k = kv_row(P, P.k_cache, w.seq, p, w.kv_head);
    const float* v = kv_row(P, P.v_cache, w.seq, p, w.kv_head);
    for (int64_t i = 0; i < nq; ++i) {
      if (p > S.qpos[i]) continue;
      const float* qi = S.qbuf.data() + i * D;
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qi[d] * k[d];
      const float m_new = std::max(S.m[i], s);
      const float alpha = std::exp(S.m[i] - m_new);
      const float e = std::exp(s - m_new);
      S.m[i] = m_new;
      S.l[i] = S.l[i] * alpha + e;
      float* a = S.acc.data() + i * D;
      for (int64_t d = 0; d < D; ++d) a[d] = a[d] * alpha + e * v[d];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = r * G + g;
      float* dst = P.out + ((w.row_begin + r) * P.num_heads + w.kv_head * G + g) * D;
      const float inv = 1.f / S.l[i];
      for (int64_t d = 0; d < D; ++d) dst[d] = S.acc[i * D + d] * inv;
    }
  }
}

// ------------------------------------------------------------------------------------------------ AVX2 path
#ifdef __AVX2__

// exp(x) for x <= 0 (Cephes expf range reduction + degree-5 polynomial, ~1 ulp); -inf and x < -88.37 give 0.
inline __m256 exp_avx2(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-88.3762626647949f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);  // also true for -inf
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), lo);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);  // n = round(x / ln 2)
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);  // r = x - n ln 2, ln 2 split in two for precision
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));  // e^r
  __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  n = _mm256_max_epi32(n, _mm256_setzero_si256());
  const __m256 pow2n = _mm256_castsi256_ps(_mm256_slli_epi32(n, 23));  // 2^n (0 when n <= -127)
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, pow2n));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// lane j of the result = horizontal sum of a[j]
inline __m256 hsum8(const __m256 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]);  // [a0 01, a1 01, a0 23, a1 23 | same for lanes 4-7]
  const __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // [a0 0-3, a1 0-3, a2 0-3, a3 0-3 | a0 4-7, ..., a3 4-7]
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// acc[0 .. 8 NV) = alpha * acc + sum_{c < n} p[c] * v[c][0 .. 8 NV)
template <int NV>
inline void accumulate_v(float* acc, float alpha, const float* p, const float* const* v, int64_t n, int64_t off) {
  __m256 a[NV];
  const __m256 al = _mm256_set1_ps(alpha);
  for (int j = 0; j < NV; ++j) a[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * j), al);
  for (int64_t c = 0; c < n; ++c) {
    const __m256 pc = _mm256_broadcast_ss(p + c);
    const float* vc = v[c] + off;
    for (int j = 0; j < NV; ++j) a[j] = _mm256_fmadd_ps(pc, _mm256_loadu_ps(vc + 8 * j), a[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(acc + 8 * j, a[j]);
}

using AccumulateFn = void (*)(float*, float, const float*, const float* const*, int64_t, int64_t);
constexpr AccumulateFn kAccumulate[9] = {nullptr,          accumulate_v<1>, accumulate_v<2>,
                                         accumulate_v<3>,  accumulate_v<4>, accumulate_v<5>,
                                         accumulate_v<6>,  accumulate_v<7>, accumulate_v<8>};

void run_item_avx2(const Problem& P, const WorkItem& w, Scratch& S) {
  const int64_t D = P.head_dim, G = P.group;
  const int64_t rows = w.row_end - w.row_begin;
  const int64_t nq = rows * G;
  const __m256 scale = _mm256_set1_ps(P.scale);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = r * G + g;
      const float* src = P.q + (w.row_begin + r) * P.q_stride_t + (w.kv_head * G + g) * P.q_stride_h;
      for (int64_t d = 0; d < D; d += 8) {
        _mm256_storeu_ps(S.qbuf.data() + i * D + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), scale));
      }
      S.qpos[i] = w.pos_begin + r;
      S.m[i] = kNegInf;
      S.l[i] = 0.f;
    }
  }
  std::fill(S.acc.begin(), S.acc.begin() + nq * D, 0.f);

  const int64_t kv_len = w.pos_begin + rows;  // the tile's last row sees positions 0 .. kv_len - 1
  const float* kp[kChunk];
  const float* vp[kChunk];
  float* scores = S.scores.data();
  for (int64_t c0 = 0; c0 < kv_len; c0 += kChunk) {
    const int64_t n = std::min(kChunk, kv_len - c0);  // valid positions in this chunk
    const int64_t n8 = (n + 7) & ~int64_t(7);
    for (int64_t c = 0; c < n8; ++c) {
      const int64_t p = c0 + std::min(c, n - 1);  // pad the last group of 8 with a real row; masked below
      kp[c] = kv_row(P, P.k_cache, w.seq, p, w.kv_head);
      vp[c] = kv_row(P, P.v_cache, w.seq, p, w.kv_head);
    }
    // scores[i, c] for eight positions at a time: K rows of the group stay in L1 across the query vectors
    for (int64_t c = 0; c < n8; c += 8) {
      for (int64_t i = 0; i < nq; ++i) {
        const float* qi = S.qbuf.data() + i * D;
        __m256 a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qi + d);
          for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[c + j] + d), a[j]);
        }
        _mm256_storeu_ps(scores + i * kChunk + c, hsum8(a));
      }
    }
    for (int64_t i = 0; i < nq; ++i) {
      // positions this vector sees in the chunk: c0 .. min(c0 + n, qpos + 1) - 1
      const int64_t seen = std::min(n, S.qpos[i] + 1 - c0);
      if (seen <= 0) continue;  // the whole chunk is in this row's future
      float* s = scores + i * kChunk;
      for (int64_t c = seen; c < n8; ++c) s[c] = kNegInf;
      __m256 mx = _mm256_loadu_ps(s);
      for (int64_t c = 8; c < n8; c += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + c));
      const float m_new = std::max(S.m[i], hmax(mx));
      const float alpha = S.m[i] == kNegInf ? 0.f : std::exp(S.m[i] - m_new);
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t c = 0; c < n8; c += 8) {
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + c), mv));
        _mm256_storeu_ps(s + c, e);
        sum = _mm256_add_ps(sum, e);
      }
      S.m[i] = m_new;
      S.l[i] = S.l[i] * alpha + hsum(sum);
      float* acc = S.acc.data() + i * D;
      for (int64_t off = 0; off < D; off += 64) {
        const int64_t nv = std::min<int64_t>(8, (D - off) / 8);
        kAccumulate[nv](acc + off, alpha, s, vp, seen, off);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = r * G + g;
      float* dst = P.out + ((w.row_begin + r) * P.num_heads + w.kv_head * G + g) * D;
      const __m256 inv = _mm256_set1_ps(1.f / S.l[i]);
      for (int64_t d = 0; d < D; d += 8) {
        _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(S.acc.data() + i * D + d), inv));
      }
    }
  }
}
#endif  // __AVX2__

torch::Tensor as_long(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "paged_attention: ", name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == torch::kLong || t.scalar_type() == torch::kInt, "paged_attention: ", name,
              " must be int64 or int32, got ", t.scalar_type());
  return t.to(torch::kLong).contiguous();
}

void check_cache(const torch::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.device().is_cpu() && cache.scalar_type() == torch::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), name,
              " must be a contiguous [num_blocks, block_size, num_kv_heads, head_dim] tensor");
}

}  // namespace

torch::Tensor paged_attention(const torch::Tensor& q_in,          // [T, H, D]
                              const torch::Tensor& k_cache,       // [num_blocks, block_size, KVH, D]
                              const torch::Tensor& v_cache,       // [num_blocks, block_size, KVH, D]
                              const torch::Tensor& block_tables_in,  // [S, max_blocks]
                              const torch::Tensor& seq_lens_in,      // [S]
                              const torch::Tensor& query_start_loc_in,  // [S + 1]
                              double scale) {
  TORCH_CHECK(q_in.device().is_cpu() && q_in.scalar_type() == torch::kFloat && q_in.dim() == 3,
              "paged_attention: q must be a float32 CPU tensor [num_tokens, num_heads, head_dim]");
  check_cache(k_cache, "paged_attention: k_cache");
  check_cache(v_cache, "paged_attention: v_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_attention: k_cache and v_cache shapes differ");
  const torch::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "paged_attention: cache head_dim ", k_cache.size(3), " != q head_dim ", D);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "paged_attention: num_heads ", H, " is not a multiple of num_kv_heads ", KVH);
  const torch::Tensor block_tables = as_long(block_tables_in, "block_tables");
  const torch::Tensor seq_lens = as_long(seq_lens_in, "seq_lens");
  const torch::Tensor cu = as_long(query_start_loc_in, "query_start_loc");
  const int64_t S = seq_lens.numel();
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == S, "paged_attention: block_tables must be [",
              S, ", max_blocks]");
  TORCH_CHECK(cu.numel() == S + 1, "paged_attention: query_start_loc must have num_seqs + 1 entries");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t* cup = cu.data_ptr<int64_t>();

  auto out = torch::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t G = H / KVH;
  const int64_t tile_rows = std::max<int64_t>(1, std::min(kMaxTileRows, kMaxTileVectors / G));
  std::vector<WorkItem> items;
  int64_t covered_end = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t begin = cup[s], end = cup[s + 1];
    const int64_t q_len = end - begin;
    TORCH_CHECK(begin >= covered_end && end <= T && q_len >= 0, "paged_attention: query_start_loc must be "
                "non-decreasing and within num_tokens");
    TORCH_CHECK(sl[s] >= q_len, "paged_attention: seq_lens[", s, "] = ", sl[s], " < query length ", q_len);
    TORCH_CHECK(sl[s] <= max_blocks * block_size, "paged_attention: seq_lens[", s, "] = ", sl[s],
                " exceeds the block table (", max_blocks, " blocks of ", block_size, ")");
    for (int64_t b = 0; b < (sl[s] + block_size - 1) / block_size; ++b) {
      const int64_t id = bt[s * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_attention: block id ", id, " of sequence ", s, " out of range");
    }
    covered_end = end;
    const int64_t pos0 = sl[s] - q_len;
    for (int64_t r = begin; r < end; r += tile_rows) {
      const int64_t r_end = std::min(end, r + tile_rows);
      const int64_t pos_begin = pos0 + (r - begin);
      const int64_t cost = (r_end - r) * G * (pos_begin + (r_end - r));
      for (int64_t h = 0; h < KVH; ++h) items.push_back({s, h, r, r_end, pos_begin, cost});
    }
  }
  if (covered_end < T) out.narrow(0, covered_end, T - covered_end).zero_();  // rows no sequence owns
  if (items.empty()) return out;
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  Problem P{q.data_ptr<float>(), q.stride(0), q.stride(1), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
            block_size * KVH * D, KVH * D, bt, max_blocks, block_size, H, KVH, D, G, static_cast<float>(scale),
            out.data_ptr<float>()};
#ifdef __AVX2__
  const bool vector_path = D % 8 == 0;
#else
  const bool vector_path = false;
#endif
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t num_workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  std::atomic<int64_t> next{0};
  // one task per worker; each pulls items longest first (dynamic scheduling balances ragged batches)
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(tile_rows * G, D);
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
#ifdef __AVX2__
        if (vector_path) {
          run_item_avx2(P, items[i], scratch);
          continue;
        }
#endif
        run_item_scalar(P, items[i], scratch);
      }
    }
  });
  (void)vector_path;
  return out;
}

void write_kv(const torch::Tensor& k_in,         // [T, KVH, D]
              const torch::Tensor& v_in,         // [T, KVH, D]
              torch::Tensor& k_cache,            // [num_blocks, block_size, KVH, D]
              torch::Tensor& v_cache,
              const torch::Tensor& slot_mapping_in) {  // [T], -1 = skip
  check_cache(k_cache, "write_kv: k_cache");
  check_cache(v_cache, "write_kv: v_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "write_kv: k_cache and v_cache shapes differ");
  const int64_t KVH = k_cache.size(2), D = k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (const torch::Tensor* t : {&k_in, &v_in}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kFloat && t->dim() == 3 && t->size(1) == KVH &&
                    t->size(2) == D,
                "write_kv: k and v must be float32 CPU tensors [num_tokens, ", KVH, ", ", D, "]");
  }
  const torch::Tensor slots = as_long(slot_mapping_in, "slot_mapping");
  const int64_t T = k_in.size(0);
  TORCH_CHECK(v_in.size(0) == T && slots.numel() == T, "write_kv: k, v and slot_mapping disagree on num_tokens");
  const torch::Tensor k = k_in.stride(2) == 1 && k_in.stride(1) == D ? k_in : k_in.contiguous();
  const torch::Tensor v = v_in.stride(2) == 1 && v_in.stride(1) == D ? v_in : v_in.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t row = KVH * D;  // a token's K (or V) over all kv heads is contiguous in both source and cache
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = sp[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "write_kv: slot ", slot, " out of range (", num_slots, " slots)");
    std::memcpy(kc + slot * row, kp + t * k.stride(0), row * sizeof(float));
    std::memcpy(vc + slot * row, vp + t * v.stride(0), row * sizeof(float));
  }
}

bool built_with_avx2() {
#ifdef __AVX2__
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "causal attention read in place from a paged KV cache on CPU";
  module.def("paged_attention", &paged_attention,
             "out[T, H, D] = causal GQA attention of packed q[T, H, D] over the paged k/v caches",
             py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
             py::arg("query_start_loc"), py::arg("scale"));
  module.def("write_kv", &write_kv, "k/v[T, KVH, D] -> cache slots slot_mapping[T] (slot -1: skipped)",
             py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"));
  module.def("built_with_avx2", &built_with_avx2, "whether the AVX2+FMA path was compiled in");
}
