// SIMD vocabulary of kiln's CPU kernels: 16 fp32 lanes (`V16`), bf16 loads and stores, and
// the bf16 pair dot product of the packed linear, for each ISA class the kernels are built
// for (kiln/ops/cpu_kernels.py picks the flags):
//   amx          AVX512-BF16 + AMX tiles (Sapphire Rapids and later)
//   avx512_bf16  AVX512-BF16 without AMX (Zen 4, Cooper Lake)
//   avx512       AVX512F/BW without bf16 instructions (Ice Lake, Cascade Lake)
//   avx2         AVX2 + FMA (Zen 2/3, Haswell to Alder Lake)
// The kernels are written once against this vocabulary; simd_avx512.h maps it one to one
// onto AVX512 intrinsics (one register per V16), simd_avx2.h onto pairs of AVX2 registers.
// Without native bf16 the math runs with fp32 FMAs: a bf16 value is the upper half of an
// fp32 one, so widening is a shift and never rounds.
//
// Each header provides, in namespace kiln_isa:
//   V16, Mask16; zero, set1, loadu, storeu, add, sub, mul, div, fmadd (a*b+c),
//   fnmadd (c-a*b), max, min, reduce_add, reduce_max, round_nearest,
//   scale_pow2 (y * 2^n, n integral; AVX512: 2^floor(n) for any n);
//   first_lanes(n) (lanes < n), lanes_between(lo, hi), max_masked, zero_unmasked;
//   load_bf16 / store_bf16 (16 values, round to nearest even), round_bf16 (fp32 -> bf16
//   -> fp32), store_bf16x2 (two vectors; one 64-byte store on AVX512-BF16);
//   reduce16(v): lane i = sum of v[kReduceOrder[i]]'s lanes;
//   WRow / Pair / load_wrow / load_pair / dot: one 64-byte row of a packed weight tile
//   (16 columns x a (k, k+1) pair) against one input row's pair, into a V16 of sums;
//   kNativeBf16 (load_pair reads the bf16 row, else its fp32 copy);
//   kGemmRows x kGemmBlocks: the linear's register tile (rows x 16-column blocks).
// AVX512 builds also: widen_bf16, floor_fraction (t - floor(t)).
// Below them, written once for all: exp2, exp2_bf16, silu_mul, and line-aligned scratch
// (Aligned64, AlignedVector, aligned_buffer).
#pragma once
#include <immintrin.h>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

// Put before every loop over a register tile's accumulator array (and the loops that fill
// and drain it): left rolled, GCC kept the array on the stack outside the product loop,
// zeroed there, copied in and out around it and read back from memory for the stores,
// about 80 memory operations per 512 `vdpbf16ps` of a 4 x 4 tile. Zen 4, avx512_bf16:
// the prefill attention 12.5-12.9 -> 12.0-12.3 ms a layer at 2,000 tokens, the packed
// and the quantized panel linears 1-5% faster at 32-2,000 rows (docs/cpu-kernels.md).
// Tiles here have at most 8 rows or blocks, so 8 unrolls each loop whole.
#define KILN_UNROLL _Pragma("GCC unroll 8")

#if defined(__AVX512F__)
#include "simd_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "simd_avx2.h"
#else
#error "kiln's CPU kernels need AVX2 with FMA or AVX512 (see kiln/ops/cpu_kernels.py)"
#endif

namespace kiln_isa {

// The polynomial with coefficients c (highest power first) at r.
template <int N>
inline V16 horner(V16 r, const float (&c)[N]) {
  V16 p = set1(c[0]);
  for (int i = 1; i < N; ++i) p = fmadd(p, r, set1(c[i]));
  return p;
}

// 2^t for finite t (below -126 it flushes to 0 or a denormal, above 127 it saturates:
// scale_pow2 takes care of both): 2^n times a polynomial in the fraction r = t - n,
// |r| <= 1/2, fitted for relative error.
template <int N>
inline V16 exp2_poly(V16 t, const float (&c)[N]) {
  const V16 n = round_nearest(t);
  return scale_pow2(horner(sub(t, n), c), n);
}

// Degree 4, relative error under 2.7e-6: more than a bf16 result or a bf16-rounded
// softmax weight keeps, at a third of a libm-accurate exp's cost.
inline constexpr float kExp2Degree4[] = {9.5605198e-3f, 5.5917123e-2f, 2.4024982e-1f,
                                         6.9312196e-1f, 9.9999919e-1f};
inline V16 exp2(V16 t) { return exp2_poly(t, kExp2Degree4); }

// Degree 3, relative error under 7.5e-5 (fifty times below a bf16 rounding): for values
// that are rounded to bf16 or only weigh such values (the prefill attention's P and its
// sums), one FMA fewer.
//   * AVX512: the fraction is r = t - floor(t) in [0, 1), one vreduceps, and scalef takes
//     2^floor(t) from t itself, where rounding and subtracting took three uops. With the
//     softmax's paired bf16 stores, its pass over a row ran 1.3x faster (Xeon, amx).
//   * AVX2: r = t - round(t), |r| <= 1/2, and the exponent is added to the bits.
// Both polynomials are fitted for relative error on their interval (under 7.5e-5).
#ifdef __AVX512F__
inline constexpr float kExp2Degree3[] = {7.8024521e-2f, 2.2606716e-1f, 6.9583356e-1f,
                                         9.9992520e-1f};
inline V16 exp2_bf16(V16 t) { return scale_pow2(horner(floor_fraction(t), kExp2Degree3), t); }
#else
inline constexpr float kExp2Degree3[] = {5.5171669e-2f, 2.4261114e-1f, 6.9326097e-1f,
                                         9.9992806e-1f};
inline V16 exp2_bf16(V16 t) { return exp2_poly(t, kExp2Degree3); }
#endif

// SwiGLU's activation, silu(g) * u = g * u / (1 + e^-g), e^-g = 2^(-g log2 e): saturated
// at 2^127 for g below -88 (the result 0 in bf16), 0 above +88 (the sigmoid 1). One
// definition for the pointwise op and the GEMMs that fuse it (amx.h's SiluEpilogue): the
// two give the same bits.
inline V16 silu_mul(V16 g, V16 u) {
  const V16 e = exp2(mul(g, set1(-1.44269504f)));
  return div(mul(g, u), add(set1(1.f), e));
}

// Allocator for scratch vectors that tiles and vector loads read whole cache lines of:
// malloc aligns to 16 bytes, and a buffer 16 bytes off a line makes every 64-byte tile
// row or vector touch two lines (an AMX tile load of 16 rows, 32 lines).
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <class U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
template <class T>
using AlignedVector = std::vector<T, Aligned64<T>>;

// An uninitialised line-aligned buffer of n T (per-call panels and scratch).
struct AlignedDelete {
  void operator()(void* p) const { ::operator delete(p, std::align_val_t{64}); }
};
template <class T>
using AlignedBuffer = std::unique_ptr<T[], AlignedDelete>;
template <class T>
AlignedBuffer<T> aligned_buffer(size_t n) {
  return AlignedBuffer<T>(static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})));
}

}  // namespace kiln_isa
