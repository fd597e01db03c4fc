// kiln_isa on AVX512 (classes amx, avx512_bf16, avx512): one zmm register per V16, each
// operation one intrinsic. Native bf16 (`vdpbf16ps`, `vcvtneps2bf16`) where the build
// targets AVX512-BF16; AVX512F integer and FMA instructions otherwise. See simd.h.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace kiln_isa {

using V16 = __m512;
using Mask16 = __mmask16;

inline V16 zero() { return _mm512_setzero_ps(); }
inline V16 set1(float v) { return _mm512_set1_ps(v); }
inline V16 loadu(const float* p) { return _mm512_loadu_ps(p); }
inline void storeu(float* p, V16 v) { _mm512_storeu_ps(p, v); }
inline V16 add(V16 a, V16 b) { return _mm512_add_ps(a, b); }
inline V16 sub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
inline V16 mul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
inline V16 max(V16 a, V16 b) { return _mm512_max_ps(a, b); }
inline V16 min(V16 a, V16 b) { return _mm512_min_ps(a, b); }
inline V16 div(V16 a, V16 b) { return _mm512_div_ps(a, b); }
inline V16 fmadd(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
inline V16 fnmadd(V16 a, V16 b, V16 c) { return _mm512_fnmadd_ps(a, b, c); }
inline float reduce_add(V16 v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(V16 v) { return _mm512_reduce_max_ps(v); }
inline V16 round_nearest(V16 v) {
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline V16 scale_pow2(V16 y, V16 n) { return _mm512_scalef_ps(y, n); }  // y * 2^floor(n)
// t - floor(t), in [0, 1): one vreduceps (AVX512DQ, which every AVX512 class has).
inline V16 floor_fraction(V16 t) {
  return _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}

inline Mask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<Mask16>(0xffff) : static_cast<Mask16>((1u << n) - 1);
}
// max(acc, v) in the lanes of `m`, acc elsewhere.
inline V16 max_masked(V16 acc, Mask16 m, V16 v) { return _mm512_mask_max_ps(acc, m, acc, v); }
inline V16 zero_unmasked(Mask16 m, V16 v) { return _mm512_maskz_mov_ps(m, v); }
// Lanes i with lo <= i < hi (either bound may lie outside 0..16).
inline Mask16 lanes_between(int64_t lo, int64_t hi) {
  const auto upto = [](int64_t n) { return n <= 0 ? 0u : n >= 16 ? 0xffffu : (1u << n) - 1; };
  return static_cast<Mask16>(upto(hi) & ~upto(lo));
}

// 16 bf16 -> 16 fp32 (exact).
inline V16 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline V16 load_bf16(const void* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 fp32 -> 16 bf16, rounded to nearest even (what vcvtneps2bf16 and torch do).
inline __m256i to_bf16(V16 v) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
#endif
}

inline void store_bf16(void* p, V16 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}

// Two vectors -> 32 bf16 (lo's first), one 64-byte store: the same bits as two store_bf16.
inline void store_bf16x2(void* p, V16 lo, V16 hi) {
#ifdef __AVX512BF16__
  _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
#else
  store_bf16(p, lo);
  store_bf16(static_cast<char*>(p) + 32, hi);
#endif
}

// fp32 -> bf16 -> fp32: where a separate op's bf16 output would have rounded (the AMX
// GEMMs' fused SwiGLU epilogues round each half first).
inline V16 round_bf16(V16 v) { return widen_bf16(to_bf16(v)); }

// Transposed sums in four halving stages of two-source permutes. The stages deliver
// sources in bit-reversed lane order, so feeding them bit-reversed makes lane i the sum
// of the i-th vector of the caller's order.
constexpr int kReduceOrder[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

inline V16 pair_sum(V16 a, V16 b, const __m512i& lo, const __m512i& hi) {
  return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
}

inline V16 reduce16(V16* v) {
  const __m512i lo1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i lo2 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i lo3 = _mm512_setr_epi32(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
  const __m512i lo4 = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
  const __m512i lo[4] = {lo1, lo2, lo3, lo4};
  const int step[4] = {8, 4, 2, 1};
  for (int stage = 0, count = 16; stage < 4; ++stage, count /= 2) {
    const __m512i hi = _mm512_add_epi32(lo[stage], _mm512_set1_epi32(step[stage]));
    for (int i = 0; i < count / 2; ++i) v[i] = pair_sum(v[2 * i], v[2 * i + 1], lo[stage], hi);
  }
  return v[0];
}

// Quantized weights (linear_quant.cpp): 16 int8 / 16 packed nibbles / 16 fp16 -> fp32.
inline V16 load_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// Byte c holds column c's code for k (low nibble) and k + 16 (high nibble).
// Q4 codes in the quad layout (linear_quant.h), 64 bytes = 16 columns x 4 k: the low
// nibbles of k + e (lo) and the high ones, k + 16 + e (hi).
inline void load_u4q(const uint8_t* p, int e, V16& lo, V16& hi) {
  const __m512i v = _mm512_srli_epi32(_mm512_loadu_si512(p), 8 * e);
  const __m512i m = _mm512_set1_epi32(15);
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, m));
  hi = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4), m));
}
inline V16 load_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// The quantized linear's register tiles: rows x 16-column blocks for the direct kernel
// (two sets of chunk sums and the totals: 3 x 8 of the 32 registers), blocks for one
// row alone, rows for the fp32 panel kernel.
constexpr int kQuantRows = 4, kQuantBlocks = 2, kQuantPanelRows = 8;

// 4 rows x 4 column blocks: 16 accumulators of the 32 zmm registers.
constexpr int kGemmRows = 4, kGemmBlocks = 4;

// One 64-byte row of a packed weight tile: 16 output columns x a (k, k+1) pair.
// `Pair` is one input row's (x[k], x[k+1]); `dot` adds x[k] * w[k] + x[k+1] * w[k+1]
// into each column's fp32 sum.
#ifdef __AVX512BF16__
constexpr bool kNativeBf16 = true;
using WRow = __m512bh;
using Pair = __m512bh;
inline WRow load_wrow(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
// x points at the bf16 row (xf, the fp32 copy, is unused).
inline Pair load_pair(const uint16_t* x, const float*, int64_t k) {
  uint32_t pair;
  std::memcpy(&pair, x + k, 4);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
}
inline V16 dot(V16 acc, Pair x, WRow w) { return _mm512_dpbf16_ps(acc, x, w); }
#else
constexpr bool kNativeBf16 = false;
struct WRow { __m512 even, odd; };
struct Pair { __m512 even, odd; };
inline WRow load_wrow(const uint16_t* p) {
  const __m512i v = _mm512_loadu_si512(p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(~0xffff)))};
}
// xf is the row widened to fp32 once per call (cheaper than widening per column block).
inline Pair load_pair(const uint16_t*, const float* xf, int64_t k) {
  return {_mm512_set1_ps(xf[k]), _mm512_set1_ps(xf[k + 1])};
}
inline V16 dot(V16 acc, Pair x, WRow w) {
  return _mm512_fmadd_ps(x.odd, w.odd, _mm512_fmadd_ps(x.even, w.even, acc));
}
#endif

}  // namespace kiln_isa
