// The register tiles of the CPU decode kernel (attention_decode.h): a decode item's two
// passes over one chunk of keys, the scores of its query vectors (scores_fp32, or
// scores_bf16 in `vdpbf16ps` for bf16 caches on AVX512-BF16 builds) and the
// softmax-weighted sum of V (pv_all, pv_all_bf16), with the shapes they share (Run, the
// accumulator budget). Included by attention_decode.h only.
#pragma once
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <type_traits>

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
    if (j + 8 < len)  // V rows are scattered like K rows (see attend_chunk)
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

}  // namespace kiln_attn
