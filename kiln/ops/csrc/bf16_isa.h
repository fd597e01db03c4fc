// bf16 arithmetic for kiln's CPU kernels, native where the build targets AVX512-BF16 and
// built from AVX512F integer and FMA instructions otherwise.
//
// The kernels are compiled once per host class (kiln/ops/cpu_kernels.py picks the flags):
//   amx          AVX512-BF16 + AMX tiles (Sapphire Rapids and later)
//   avx512_bf16  AVX512-BF16 without AMX (Zen 4, Cooper Lake)
//   avx512       AVX512F/BW without bf16 instructions (Ice Lake, Cascade Lake)
// Everything bf16-specific the kernels do goes through this header, so one source serves
// all three; without native bf16 the same math runs with fp32 FMAs (a bf16 value is the
// upper half of an fp32 one, so widening is a shift and never rounds).
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace kiln_isa {

// 16 bf16 -> 16 fp32 (exact).
inline __m512 load_bf16(const void* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 fp32 -> 16 bf16, rounded to nearest even (what vcvtneps2bf16 and torch do).
inline __m256i to_bf16(__m512 v) {
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

inline void store_bf16(void* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}

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
inline __m512 dot(__m512 acc, Pair x, WRow w) { return _mm512_dpbf16_ps(acc, x, w); }
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
inline __m512 dot(__m512 acc, Pair x, WRow w) {
  return _mm512_fmadd_ps(x.odd, w.odd, _mm512_fmadd_ps(x.even, w.even, acc));
}
#endif

}  // namespace kiln_isa
