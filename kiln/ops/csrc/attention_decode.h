// The decode kernel of kiln_cpu::unified_attention (paged_attention.cpp): one item is
// one run of query tokens of a request (1 for a plain decode row, 1 + k for a verify
// step) against one KV head and one chunk of its keys, read straight from the paged
// cache; the chunks' partial results are merged per run and head (merge_partials). fp32
// arithmetic, or bf16 dot products for bf16 caches on AVX512-BF16 builds; the two passes'
// register tiles are in attention_decode_tiles.h. Included by paged_attention.cpp only.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "attention_decode_tiles.h"
#include "simd.h"

namespace kiln_attn {

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
