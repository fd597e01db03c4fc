// kiln_isa on AVX2 + FMA (class avx2): a V16 is two ymm registers (lanes 0-7, 8-15).
// There is no bf16 arithmetic: weights stay bf16 in memory (half the bytes of fp32, which
// is what memory-bound decode linears pay for) and are widened to fp32 by a shift or a
// mask before the FMAs. Masks are all-ones lanes. See simd.h.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <algorithm>

namespace kiln_isa {

struct V16 { __m256 lo, hi; };
using Mask16 = V16;

inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline V16 loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void storeu(float* p, V16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline V16 add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 min(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V16 div(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 fmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 fnmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_add(V16 v) { return hsum8(_mm256_add_ps(v.lo, v.hi)); }
inline float reduce_max(V16 v) { return hmax8(_mm256_max_ps(v.lo, v.hi)); }

inline V16 round_nearest(V16 v) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(v.lo, kMode), _mm256_round_ps(v.hi, kMode)};
}
// y * 2^n for integral n, built as the float with exponent n + 127: n is first clamped to
// [-127, 127] (exponent bits 0, which make 0, to 254), as AVX512's scalef saturates.
inline __m256 pow2_8(__m256 n) {
  n = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline V16 scale_pow2(V16 y, V16 n) {
  return {_mm256_mul_ps(y.lo, pow2_8(n.lo)), _mm256_mul_ps(y.hi, pow2_8(n.hi))};
}

inline Mask16 first_lanes(int64_t n) {
  const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 lim = _mm256_set1_ps(static_cast<float>(n));
  return {_mm256_cmp_ps(lanes, lim, _CMP_LT_OQ),
          _mm256_cmp_ps(_mm256_add_ps(lanes, _mm256_set1_ps(8.f)), lim, _CMP_LT_OQ)};
}
// Lanes i with lo <= i < hi (either bound may lie outside 0..16).
inline Mask16 lanes_between(int64_t lo, int64_t hi) {
  const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm256_set1_ps(8.f);
  const __m256 l = _mm256_set1_ps(static_cast<float>(std::max<int64_t>(lo, -1)));
  const __m256 h = _mm256_set1_ps(static_cast<float>(std::min<int64_t>(hi, 17)));
  auto in = [&](__m256 x) {
    return _mm256_and_ps(_mm256_cmp_ps(x, l, _CMP_GE_OQ), _mm256_cmp_ps(x, h, _CMP_LT_OQ));
  };
  return {in(lanes), in(_mm256_add_ps(lanes, eight))};
}
inline V16 max_masked(V16 acc, Mask16 m, V16 v) {
  const V16 mx = max(acc, v);
  return {_mm256_blendv_ps(acc.lo, mx.lo, m.lo), _mm256_blendv_ps(acc.hi, mx.hi, m.hi)};
}
inline V16 zero_unmasked(Mask16 m, V16 v) {
  return {_mm256_and_ps(m.lo, v.lo), _mm256_and_ps(m.hi, v.hi)};
}

// 8 bf16 -> 8 fp32 (exact).
inline __m256 load_bf16_8(const void* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V16 load_bf16(const void* p) {
  return {load_bf16_8(p), load_bf16_8(static_cast<const uint16_t*>(p) + 8)};
}

// 8 fp32 -> 8 bf16 in the low 16 bits of each lane, rounded to nearest even (as torch).
inline __m256i round_bf16_8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}
// fp32 -> bf16 -> fp32 (the bits a bf16 tensor would hold, widened back).
inline V16 round_bf16(V16 v) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(round_bf16_8(v.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(round_bf16_8(v.hi), 16))};
}
inline void store_bf16(void* p, V16 v) {
  // packus works per 128-bit lane ([lo0-3, hi0-3, lo4-7, hi4-7]); the permute restores
  // the order. Every value is below 2^16, so the unsigned saturation never clips.
  const __m256i packed = _mm256_packus_epi32(round_bf16_8(v.lo), round_bf16_8(v.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_permute4x64_epi64(packed, 0xd8));
}

// Two vectors' bf16, 32 values (not called: AVX2 builds keep P in fp32).
inline void store_bf16x2(void* p, V16 lo, V16 hi) {
  store_bf16(p, lo);
  store_bf16(static_cast<char*>(p) + 32, hi);
}

// Lane i of the result is the sum of s[i]'s lanes, for 8 vectors.
inline __m256 reduce8(const __m256* s) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}
constexpr int kReduceOrder[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
inline V16 reduce16(V16* v) {
  __m256 s[16];
  for (int i = 0; i < 16; ++i) s[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {reduce8(s), reduce8(s + 8)};
}

// Quantized weights (linear_quant.cpp): 16 int8 / 16 packed nibbles / 16 fp16 -> fp32.
inline __m256 i8_8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline V16 load_i8(const int8_t* p) { return {i8_8(p), i8_8(p + 8)}; }
// Byte c holds column c's code for k (low nibble) and k + 16 (high nibble).
// Q4 codes in the quad layout (linear_quant.h), 64 bytes = 16 columns x 4 k: the low
// nibbles of k + e (lo) and the high ones, k + 16 + e (hi).
inline void load_u4q(const uint8_t* p, int e, V16& lo, V16& hi) {
  const __m256i m = _mm256_set1_epi32(15);
  const __m256i v0 = _mm256_srli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 8 * e);
  const __m256i v1 = _mm256_srli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), 8 * e);
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(v0, m)), _mm256_cvtepi32_ps(_mm256_and_si256(v1, m))};
  hi = {_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v0, 4), m)),
        _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v1, 4), m))};
}
inline V16 load_f16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
// The quantized linear's register tiles (16 ymm): 2 rows x 1 block of two chunk-sum sets
// and the totals (12 registers) for the direct kernel, 2 blocks for one row alone; 6 rows
// for the panel kernel.
constexpr int kQuantRows = 2, kQuantBlocks = 1, kQuantPanelRows = 6;

// 4 rows x 1 column block: 8 accumulator registers, 4 for the widened weight row and 2
// for the broadcast pair fit the 16 ymm registers (4 x 4 blocks would spill). Two blocks
// for a single row measured no faster: a one-row product streams weights from memory.
constexpr int kGemmRows = 4, kGemmBlocks = 1;
// From kPanelFrom rows on, the linear widens each weight block into an fp32 panel and
// runs a kPanelRows x 16 tile over it (12 accumulators, 2 panel registers, 1 broadcast).
// Measured here (Zen 3, 2 threads, SmolLM2's five shapes, interleaved A/B): the panel is
// 1.0-1.1x the 4 x 1 tile at 24-32 rows, 1.1-1.25x at 64-512 (about an fp32 sgemm's
// speed), and 0.7-0.9x at 8-16 rows (the lm_head still at 16), hence 24.
#define KILN_PANEL_GEMM 1
constexpr int kPanelRows = 6;
constexpr int64_t kPanelFrom = 24;

constexpr bool kNativeBf16 = false;
struct WRow { V16 even, odd; };
struct Pair { __m256 even, odd; };
// Each 32-bit word holds column n's (w[k], w[k+1]): w[k] is the low half.
inline WRow load_wrow(const uint16_t* p) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const __m256i high = _mm256_set1_epi32(~0xffff);
  return {{_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
           _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))},
          {_mm256_castsi256_ps(_mm256_and_si256(a, high)),
           _mm256_castsi256_ps(_mm256_and_si256(b, high))}};
}
inline Pair load_pair(const uint16_t*, const float* xf, int64_t k) {
  return {_mm256_set1_ps(xf[k]), _mm256_set1_ps(xf[k + 1])};
}
inline V16 dot(V16 acc, Pair x, WRow w) {
  return {_mm256_fmadd_ps(x.odd, w.odd.lo, _mm256_fmadd_ps(x.even, w.even.lo, acc.lo)),
          _mm256_fmadd_ps(x.odd, w.odd.hi, _mm256_fmadd_ps(x.even, w.even.hi, acc.hi))};
}

}  // namespace kiln_isa
