// The decode kernel of kiln_cpu::unified_attention (paged_attention.cpp): one item is
// one run of query tokens of a request (1 for a plain decode row, 1 + k for a verify
// step) against one KV head and one chunk of its keys, read straight from the paged
// cache; the chunks' partial results are merged per run and head (merge_partials). fp32
// arithmetic, or bf16 dot products for bf16 caches on AVX512-BF16 builds (scores_bf16).
// Included by paged_attention.cpp only.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace kiln_attn {

using kiln_isa::V16;
namespace isa = kiln_isa;

inline V16 load16(const float* p) { return isa::loadu(p); }
inline V16 load16(const c10::BFloat16* p) { return isa::load_bf16(p); }
inline void store16(float* p, V16 v) { isa::storeu(p, v); }
inline void store16(c10::BFloat16* p, V16 v) { isa::store_bf16(p, v); }

constexpr int kMaxChunks = 16;  // head_size <= 256
constexpr int kMaxGroup = 32;   // query vectors per item (query heads per KV head x tokens)

// exp for x <= 0 (softmax after subtracting the max): Cephes' expf polynomial on the
// reduced argument, scaled by 2^n; about 1 ulp, like the vectorised exp SDPA uses.
inline V16 exp_nonpositive(V16 x) {
  x = isa::max(x, isa::set1(-87.3f));
  const V16 n = isa::round_nearest(isa::mul(x, isa::set1(1.44269504088896341f)));
  V16 r = isa::fnmadd(n, isa::set1(0.693359375f), x);
  r = isa::fnmadd(n, isa::set1(-2.12194440e-4f), r);
  V16 p = isa::set1(1.9875691500E-4f);
  p = isa::fmadd(p, r, isa::set1(1.3981999507E-3f));
  p = isa::fmadd(p, r, isa::set1(8.3334519073E-3f));
  p = isa::fmadd(p, r, isa::set1(4.1665795894E-2f));
  p = isa::fmadd(p, r, isa::set1(1.6666665459E-1f));
  p = isa::fmadd(p, r, isa::set1(5.0000001201E-1f));
  const V16 y = isa::add(isa::fmadd(isa::mul(p, r), r, r), isa::set1(1.f));
  return isa::scale_pow2(y, n);
}

// The softmax-weighted sum of V for RT query rows (scores s, row stride `padded`), CH
// chunks of 16 per row: RT x CH accumulators held in registers (compile-time loops), each
// summed over the keys in order, so a row's result does not depend on the tile it is in.
template <typename T, int RT, int CH>
void pv_rows(const float* s, int64_t padded, const T* const* rows, std::ptrdiff_t to_value,
             int64_t len, float* const* outs) {
  V16 acc[RT][CH];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CH; ++c) acc[r][c] = isa::zero();
  for (int64_t j = 0; j < len; ++j) {
    if (j + 8 < len)  // V rows are scattered like K rows (see attend_one)
      for (int64_t b = 0; b < CH * 16 * static_cast<int64_t>(sizeof(T)); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rows[j + 8] + to_value) + b, _MM_HINT_T0);
    const T* v = rows[j] + to_value;
    V16 vv[CH];
    for (int c = 0; c < CH; ++c) vv[c] = load16(v + c * 16);
    for (int r = 0; r < RT; ++r) {
      const V16 p = isa::set1(s[r * padded + j]);
      for (int c = 0; c < CH; ++c) acc[r][c] = isa::fmadd(p, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CH; ++c) store16(outs[r] + c * 16, acc[r][c]);
}

// Accumulators per tile: 16 of AVX512's 32 registers; AVX2 (V16 is two ymm) 8 of 16.
constexpr int kPvAccumulators = std::is_class_v<V16> ? 8 : 16;

alignas(64) constexpr float kZeroRow[16 * kMaxChunks] = {};

template <typename T, int N, int CH>
void pv_tail(int64_t rem, const float* s, int64_t padded, const T* const* rows,
             std::ptrdiff_t to_value, int64_t len, float* const* outs) {
  if constexpr (N > 0) {
    if (rem == N) return pv_rows<T, N, CH>(s, padded, rows, to_value, len, outs);
    pv_tail<T, N - 1, CH>(rem, s, padded, rows, to_value, len, outs);
  }
}

template <typename T, int CH>
void pv_all(const float* s, int64_t padded, int64_t n_rows, const T* const* rows,
            std::ptrdiff_t to_value, int64_t len, float* const* outs) {
  constexpr int RT = kPvAccumulators / CH > 0 ? kPvAccumulators / CH : 1;
  int64_t g = 0;
  for (; g + RT <= n_rows; g += RT)
    pv_rows<T, RT, CH>(s + g * padded, padded, rows, to_value, len, outs + g);
  pv_tail<T, RT - 1, CH>(n_rows - g, s + g * padded, padded, rows, to_value, len, outs + g);
}

// Where one decode item's query vectors are and how far each sees: `rows` consecutive
// query tokens of one request (a verify step's 1 + k tokens; 1 for a plain decode row)
// times the `group` query heads of one KV head. Token r sees keys first .. total - rows + r
// (total: the last token's length), so vector v = r * group + g has len - (rows - 1 - r)
// keys. Sharing the item across the tokens reads each key and value row once for all of
// them, where one item per token read the context rows + 1 times.
struct Run {
  const void* q;    // token 0's query rows
  void* out;        // token 0's output rows
  int64_t q_token_stride, out_token_stride, q_head_stride;
  int64_t rows;
};

// The scores of one item's nv query vectors (scale folded into q), sixteen keys at a
// time: each block of keys widened to fp32 once for all vectors (bf16: into kf, an
// L1-sized scratch; fp32 rows are read in place). Keys past the end read a zero row:
// their lanes are masked out of the softmax, and the loop stays branch-free.
template <typename T, int CH, typename Prefetch>
void scores_fp32(const T* qp, const Run& run, int64_t head, int64_t group, int64_t nv,
                 int64_t D, const T* const* rows, int64_t len, int64_t padded, float scale,
                 float* scores, const Prefetch& prefetch_row) {
  const int64_t chunks = CH > 0 ? CH : D / 16;
  V16 qv[kMaxGroup][kMaxChunks];
  for (int64_t v = 0; v < nv; ++v) {
    const int64_t r = v / group, h = head * group + v % group;
    for (int64_t c = 0; c < chunks; ++c)
      qv[v][c] = isa::mul(load16(qp + r * run.q_token_stride + h * run.q_head_stride + c * 16),
                          isa::set1(scale));
  }
  alignas(64) float kf[16 * 16 * kMaxChunks];
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    for (int64_t j = j0 + 16; j < std::min<int64_t>(len, j0 + 32); ++j) prefetch_row(rows[j]);
    const float* keys[16];
    for (int i = 0; i < 16; ++i) {
      keys[i] = kZeroRow;
      if (j0 + i >= len) continue;
      if constexpr (std::is_same_v<T, float>) {
        keys[i] = rows[j0 + i];
      } else {
        for (int64_t c = 0; c < chunks; ++c)
          isa::storeu(kf + i * D + c * 16, load16(rows[j0 + i] + c * 16));
        keys[i] = kf + i * D;
      }
    }
    for (int64_t g = 0; g < nv; ++g) {
      V16 acc[16];  // in reduce16's order, so that lane i of the sums is key j0 + i
      for (int i = 0; i < 16; ++i) {
        const float* k = keys[isa::kReduceOrder[i]];
        acc[i] = isa::zero();
        for (int64_t c = 0; c < chunks; ++c)
          acc[i] = isa::fmadd(qv[g][c], isa::loadu(k + c * 16), acc[i]);
      }
      isa::storeu(scores + g * padded + j0, isa::reduce16(acc));
    }
  }
}

#ifdef __AVX512BF16__
// bf16 caches on AVX512-BF16 builds (head sizes of whole 32s): both passes in `vdpbf16ps`
// (32 products of bf16 pairs per instruction, exact, summed in fp32), where the fp32
// kernel widens every key and value to fp32 and spends a 16-lane FMA per 16 products.
// The scores come straight from the bf16 rows, the scale multiplying their sums (it was
// in q: the same up to rounding); the softmax weights are rounded to bf16 for the V pass,
// as SDPA's reduced-precision path rounds them for its PV product (here unnormalised:
// exp(score - the chunk's max), normalised when the chunks merge).
// SmolLM2's heads (9 / 3 of 64), Zen 4, 2 threads, us per layer, fp32 kernel -> this:
//   300 keys: 1 row 13.3 -> 10.4, 5 rows 36.6 -> 24.7, 7 rows 44.4 -> 30.6;
//   1000 keys: 1 row 71.4 -> 54.9, 5 rows 175 -> 85, 7 rows 190 -> 104.
template <int CH, typename Prefetch>
void scores_bf16(const c10::BFloat16* qp, const Run& run, int64_t head, int64_t group,
                 int64_t nv, const c10::BFloat16* const* rows, int64_t len, int64_t padded,
                 float scale, float* scores, const Prefetch& prefetch_row) {
  constexpr int kPairs = CH / 2;  // 32 bf16 per __m512bh
  __m512bh qb[kMaxGroup][kPairs > 0 ? kPairs : 1];
  for (int64_t v = 0; v < nv; ++v) {
    const int64_t r = v / group, h = head * group + v % group;
    const c10::BFloat16* q = qp + r * run.q_token_stride + h * run.q_head_stride;
    for (int c = 0; c < kPairs; ++c) qb[v][c] = (__m512bh)_mm512_loadu_si512(q + c * 32);
  }
  const V16 s = isa::set1(scale);
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    for (int64_t j = j0 + 16; j < std::min<int64_t>(len, j0 + 32); ++j) prefetch_row(rows[j]);
    const c10::BFloat16* keys[16];
    for (int i = 0; i < 16; ++i)  // keys past the end: a zero row (masked in the softmax)
      keys[i] = j0 + i < len ? rows[j0 + i] : reinterpret_cast<const c10::BFloat16*>(kZeroRow);
    for (int64_t g = 0; g < nv; ++g) {
      V16 acc[16];  // in reduce16's order, so that lane i of the sums is key j0 + i
      for (int i = 0; i < 16; ++i) {
        const c10::BFloat16* k = keys[isa::kReduceOrder[i]];
        acc[i] = isa::zero();
        for (int c = 0; c < kPairs; ++c)
          acc[i] = _mm512_dpbf16_ps(acc[i], qb[g][c], (__m512bh)_mm512_loadu_si512(k + c * 32));
      }
      isa::storeu(scores + g * padded + j0, isa::mul(isa::reduce16(acc), s));
    }
  }
}

// The weighted sum of V for RT vectors from bf16 softmax weights (p, row stride `padded`:
// rounded as SDPA rounds them before its reduced-precision PV product), two keys
// per `vdpbf16ps`: V rows j and j + 1 interleaved (unpack lo/hi per 128-bit lane), so
// accumulator lanes hold the dims in that order, put back once at the end.
template <int RT, int CH>
void pv_rows_bf16(const uint16_t* p, int64_t padded, const c10::BFloat16* const* rows,
                  std::ptrdiff_t to_value, int64_t len, float* const* outs) {
  constexpr int kHalf = CH / 2;  // 32-dim zmm per row
  V16 acc[RT][CH];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CH; ++c) acc[r][c] = isa::zero();
  const auto* zero = reinterpret_cast<const c10::BFloat16*>(kZeroRow);
  for (int64_t j = 0; j < len; j += 2) {
    for (int64_t f = j + 8; f < std::min<int64_t>(len, j + 10); ++f)
      for (int64_t b = 0; b < CH * 32; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rows[f] + to_value) + b, _MM_HINT_T0);
    const c10::BFloat16* a = rows[j] + to_value;
    const c10::BFloat16* b = j + 1 < len ? rows[j + 1] + to_value : zero;
    __m512bh lo[kHalf], hi[kHalf];
    for (int c = 0; c < kHalf; ++c) {
      const __m512i x = _mm512_loadu_si512(a + c * 32), y = _mm512_loadu_si512(b + c * 32);
      lo[c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
      hi[c] = (__m512bh)_mm512_unpackhi_epi16(x, y);
    }
    for (int r = 0; r < RT; ++r) {
      int32_t pair;  // p[j], p[j + 1]: zero past the vector's keys (padded is even)
      std::memcpy(&pair, p + r * padded + j, 4);
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < kHalf; ++c) {
        acc[r][2 * c] = _mm512_dpbf16_ps(acc[r][2 * c], lo[c], pp);
        acc[r][2 * c + 1] = _mm512_dpbf16_ps(acc[r][2 * c + 1], hi[c], pp);
      }
    }
  }
  // lo lane 4L + t is dim 8L + t of its 32, hi lane 4L + t is dim 8L + 4 + t
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < kHalf; ++c) {
      store16(outs[r] + c * 32, _mm512_permutex2var_ps(acc[r][2 * c], first, acc[r][2 * c + 1]));
      store16(outs[r] + c * 32 + 16,
              _mm512_permutex2var_ps(acc[r][2 * c], second, acc[r][2 * c + 1]));
    }
}

template <int N, int CH>
void pv_tail_bf16(int64_t rem, const uint16_t* p, int64_t padded,
                  const c10::BFloat16* const* rows, std::ptrdiff_t to_value, int64_t len,
                  float* const* outs) {
  if constexpr (N > 0) {
    if (rem == N) return pv_rows_bf16<N, CH>(p, padded, rows, to_value, len, outs);
    pv_tail_bf16<N - 1, CH>(rem, p, padded, rows, to_value, len, outs);
  }
}

template <int CH>
void pv_all_bf16(const uint16_t* p, int64_t padded, int64_t n_rows,
                 const c10::BFloat16* const* rows, std::ptrdiff_t to_value, int64_t len,
                 float* const* outs) {
  constexpr int RT = 24 / CH > 0 ? 24 / CH : 1;  // 24 accumulators beside 2 x CH / 2 of V
  int64_t g = 0;
  for (; g + RT <= n_rows; g += RT)
    pv_rows_bf16<RT, CH>(p + g * padded, padded, rows, to_value, len, outs + g);
  pv_tail_bf16<RT - 1, CH>(n_rows - g, p + g * padded, padded, rows, to_value, len, outs + g);
}
#endif

// Keys per decode item. A run's keys are cut into chunks of kKeyChunk counted from its
// first key, one item per (run, KV head, chunk): a lone request still spreads over every
// thread (3 KV heads on 2 threads left one thread twice the work), and no key or value row
// is read twice (cutting the run's tokens apart instead read the context once per piece).
// The cut depends on the keys alone, never on the batch or the run's token count, so a
// token's result is bit for bit what it gets as a lone decode row. 128: 64 paid more
// chunk starts (each waits on its first rows), 256 left a 300-key request unbalanced
// (556 vs 344 keys per thread); SmolLM2 decode at 300-600 keys, Zen 4.
constexpr int64_t kKeyChunk = 128;

// The keys of the chunk starting at key k0 of a run that sees `keys` keys.
inline int64_t chunk_keys(int64_t keys, int64_t k0) { return std::min(kKeyChunk, keys - k0); }

// One vector's partial over one chunk: the unnormalised softmax-weighted sum of V (D
// floats), then the max score m and the sum s of exp(score - m) over its live keys.
inline int64_t partial_floats(int64_t D) { return D + 2; }

// Contiguous runs of items per thread, cut by work, not by item count (a context's last
// chunk is short; a causal prompt's late tiles see more keys): item i goes to the thread
// whose share holds its middle. cost_upto[i] is the work of items 0..i; returns the
// threads + 1 bounds (thread t runs items bounds[t] .. bounds[t + 1] - 1).
inline std::vector<int64_t> split_by_cost(const std::vector<int64_t>& cost_upto) {
  const auto n_items = static_cast<int64_t>(cost_upto.size());
  const int64_t cost = n_items ? cost_upto.back() : 0;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  std::vector<int64_t> bounds(threads + 1, n_items);
  bounds[0] = 0;
  for (int64_t i = 0, t = 1; i < n_items && t < threads; ++i) {
    const int64_t mid2 = cost_upto[i] + (i ? cost_upto[i - 1] : 0);  // twice the middle
    while (t < threads && mid2 * threads >= 2 * t * cost) bounds[t++] = i;
  }
  return bounds;
}

// The key count of each of one run's nv vectors (token r of `rows` sees the last token's
// keys less rows - 1 - r).
inline void vector_lens(const Run& run, int64_t group, int64_t len, int64_t* lens) {
  for (int64_t v = 0; v < run.rows * group; ++v) lens[v] = len - (run.rows - 1 - v / group);
}

// f(j, row) for the K rows of keys at .. at + n - 1 of one KV head, block by block (no
// per-key division).
template <typename T, typename F>
void for_key_rows(const T* kc, const int32_t* blocks, int64_t at, int64_t n,
                  int64_t block_size, int64_t kv_heads, int64_t head, int64_t D, F&& f) {
  for (int64_t j = 0, b = at / block_size, o0 = at % block_size; j < n; ++b, o0 = 0) {
    const T* base = kc + (static_cast<int64_t>(blocks[b]) * block_size * kv_heads + head) * D;
    for (int64_t o = o0; o < block_size && j < n; ++o, ++j) f(j, base + o * kv_heads * D);
  }
}

// Asks for the K and V rows of keys at .. at + n - 1 of one KV head into L2: all at once,
// so that their DRAM round trips overlap instead of each waiting its turn.
template <typename T>
void prefetch_chunk(const T* kc, std::ptrdiff_t to_value, const int32_t* blocks, int64_t at,
                    int64_t n, int64_t block_size, int64_t kv_heads, int64_t head, int64_t D) {
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  for_key_rows(kc, blocks, at, n, block_size, kv_heads, head, D, [&](int64_t, const T* row) {
    for (int64_t b = 0; b < row_bytes; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(row + to_value) + b, _MM_HINT_T1);
    }
  });
}

// One (run, KV head, chunk): keys k0 .. k0 + kKeyChunk - 1 of the run's window, in two
// passes (scores sixteen keys at a time, then the exp-weighted sum of V). Each vector's
// arithmetic is the same as it would be alone: its keys in the same lanes and order, the
// keys past its own length masked out of the softmax and weighted by an exact zero in
// the V pass. Writes nv partials (partial_floats(D) apart) at `part`.
// CH: the head size in 16-lane chunks when known at compile time (1, 2, 4, 8), 0 for
// any other multiple of 16. A runtime chunk count left the score loop's 16 accumulators
// in memory with a branch per chunk: the whole op took 1.3x as long for a decode row
// over 300 keys, 1.5x for 5 verify rows (Zen 4, bf16, heads of 64).
template <typename T, int CH>
void attend_chunk(const Run& run, const T* kc, const T* vc, const int32_t* blocks,
                  int64_t first, int64_t total, int64_t k0, int64_t block_size,
                  int64_t kv_heads, int64_t head, int64_t group, int64_t D, float scale,
                  float softcap, float* part, std::vector<float>& scores,
                  std::vector<const T*>& rows) {
#ifdef __AVX512BF16__
  constexpr bool kBf16Dots = std::is_same_v<T, c10::BFloat16> && CH > 0 && CH % 2 == 0;
#else
  constexpr bool kBf16Dots = false;
#endif
  // This chunk's keys (the last token's, which sees the most), and each vector's live ones.
  const int64_t len = chunk_keys(total - first, k0), nv = run.rows * group;
  const int64_t chunks = CH > 0 ? CH : D / 16, padded = (len + 15) / 16 * 16;
  const int64_t stride = partial_floats(D);
  int64_t lens[kMaxGroup];
  vector_lens(run, group, total - first, lens);
  for (int64_t v = 0; v < nv; ++v) lens[v] = std::clamp<int64_t>(lens[v] - k0, 0, len);
  const T* qp = static_cast<const T*>(run.q);
  float* outs[kMaxGroup];
  for (int64_t v = 0; v < nv; ++v) outs[v] = part + v * stride;
  // fp32 scores, then (bf16 dots) the exp weights as bf16 behind them
  scores.resize(nv * padded + (kBf16Dots ? nv * padded / 2 : 0));
  [[maybe_unused]] auto* probs = reinterpret_cast<uint16_t*>(scores.data() + nv * padded);
  // Row addresses once; V rows sit at the same offsets in the value cache.
  rows.resize(len);
  const int64_t at = first + k0;
  for_key_rows(kc, blocks, at, len, block_size, kv_heads, head, D,
               [&](int64_t j, const T* row) { rows[j] = row; });
  const std::ptrdiff_t to_value = vc - kc;
  // The rows of one KV head lie kv_heads * D apart inside a block and the blocks anywhere:
  // no hardware prefetcher follows that, and each row missed costs a DRAM round trip (the
  // KV of a long context does not stay in cache between layers). So each loop asks for
  // the rows it will read next (the keys of the next group of 16, the value 8 rows on)
  // into L1; the caller has asked for all of the chunk's K and V rows into L2
  // (prefetch_chunk, from decode_impl).
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  auto prefetch_row = [row_bytes](const T* row) {
    for (int64_t b = 0; b < row_bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
  };
  for (int64_t j = 0; j < std::min<int64_t>(len, 16); ++j) prefetch_row(rows[j]);
#ifdef __AVX512BF16__
  if constexpr (kBf16Dots)
    scores_bf16<CH>(qp, run, head, group, nv, rows.data(), len, padded, scale, scores.data(),
                    prefetch_row);
  else
#endif
    scores_fp32<T, CH>(qp, run, head, group, nv, D, rows.data(), len, padded, scale,
                       scores.data(), prefetch_row);
  // The V pass prefetches 8 rows ahead: its first 8 load while the softmax runs.
  for (int64_t j = 0; j < std::min<int64_t>(len, 8); ++j) prefetch_row(rows[j] + to_value);
  if (softcap > 0.f) {  // the scale is already in the scores
    for (int64_t g = 0; g < nv; ++g)
      for (int64_t j = 0; j < lens[g]; ++j) {
        float& x = scores[g * padded + j];
        x = softcap * std::tanh(x / softcap);
      }
  }
  // exp(score - max) per vector, unnormalised: the chunks' partials are merged (and
  // normalised) once every chunk is in (merge_partials).
  for (int64_t g = 0; g < nv; ++g) {
    float* s = scores.data() + g * padded;
    const int64_t n = lens[g];
    auto live = [n](int64_t j) { return isa::first_lanes(std::max<int64_t>(0, n - j)); };
    V16 mx = isa::set1(-INFINITY);
    for (int64_t j = 0; j < padded; j += 16) mx = isa::max_masked(mx, live(j), isa::loadu(s + j));
    // no live key here (a token shorter than the chunk's start): all-zero weights
    const float top = n > 0 ? isa::reduce_max(mx) : 0.f;
    const V16 m = isa::set1(top);
    V16 sum = isa::zero();
    for (int64_t j = 0; j < padded; j += 16) {
      const V16 e = isa::zero_unmasked(live(j), exp_nonpositive(isa::sub(isa::loadu(s + j), m)));
      sum = isa::add(sum, e);
#ifdef __AVX512BF16__
      if constexpr (kBf16Dots) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + g * padded + j),
                            (__m256i)_mm512_cvtneps_pbh(e));
        continue;
      }
#endif
      isa::storeu(s + j, e);
    }
    outs[g][D] = n > 0 ? top : -INFINITY;
    outs[g][D + 1] = isa::reduce_add(sum);
  }
#ifdef __AVX512BF16__
  if constexpr (kBf16Dots) {
    return pv_all_bf16<CH>(probs, padded, nv, rows.data(), to_value, len, outs);
  }
#endif
  if constexpr (CH > 0) {
    return pv_all<T, CH>(scores.data(), padded, nv, rows.data(), to_value, len, outs);
  }
  V16 acc[kMaxGroup][kMaxChunks];  // other head sizes: runtime loops (accumulators in memory)
  for (int64_t g = 0; g < nv; ++g)
    for (int64_t c = 0; c < chunks; ++c) acc[g][c] = isa::zero();
  for (int64_t j = 0; j < len; ++j) {
    if (j + 8 < len) prefetch_row(rows[j + 8] + to_value);
    const T* v = rows[j] + to_value;
    for (int64_t c = 0; c < chunks; ++c) {
      const V16 vv = load16(v + c * 16);
      for (int64_t g = 0; g < nv; ++g)
        acc[g][c] = isa::fmadd(isa::set1(scores[g * padded + j]), vv, acc[g][c]);
    }
  }
  for (int64_t g = 0; g < nv; ++g)
    for (int64_t c = 0; c < chunks; ++c) store16(outs[g] + c * 16, acc[g][c]);
}

// A run's output for one KV head from its chunks' partials (chunk k's nv partials at
// part + k * nv * partial_floats(D)): per vector, the chunks it has keys in, each weighted
// by exp(its max - the overall max), in chunk order; then divided by the weighted sums.
template <typename T>
void merge_partials(const Run& run, int64_t total_len, int64_t head, int64_t group,
                    int64_t D, const float* part) {
  const int64_t nv = run.rows * group, stride = partial_floats(D);
  int64_t lens[kMaxGroup];
  vector_lens(run, group, total_len, lens);
  for (int64_t v = 0; v < nv; ++v) {
    const int64_t r = v / group, h = head * group + v % group;
    const int64_t nk = (lens[v] + kKeyChunk - 1) / kKeyChunk;
    const float* p = part + v * stride;
    float m = -INFINITY;
    for (int64_t k = 0; k < nk; ++k) m = std::max(m, p[k * nv * stride + D]);
    alignas(64) float acc[16 * kMaxChunks];
    float den = 0.f;
    for (int64_t k = 0; k < nk; ++k) {
      const float* pk = p + k * nv * stride;
      const float w = std::exp(pk[D] - m);
      den += w * pk[D + 1];
      for (int64_t c = 0; c < D; c += 16)
        isa::storeu(acc + c, isa::fmadd(isa::set1(w), isa::loadu(pk + c),
                                        k ? isa::loadu(acc + c) : isa::zero()));
    }
    const V16 inv = isa::set1(1.f / den);
    T* out = static_cast<T*>(run.out) + r * run.out_token_stride + h * run.q_head_stride;
    for (int64_t c = 0; c < D; c += 16) store16(out + c, isa::mul(isa::loadu(acc + c), inv));
  }
}

}  // namespace kiln_attn
