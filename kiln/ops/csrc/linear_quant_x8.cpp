// kiln_cpu::linear_quant's direct Q4 kernel (and, on VNNI builds, the Q8_0 one; see
// q8_vnni_direct) for bf16 x (few rows: decode) over int8
// activations, llama.cpp's scheme (its Q8_1): x is quantized to int8 per row and
// 32-column chunk (scale max|x| / 127, round to nearest) and meets the 4-bit codes in
// integer dot products, where the fp32 kernel widens every code to a float and spends an
// FMA on it. Integer sums are exact; per chunk they are scaled once and the offset term
// uses the exact chunk sum of x:  acc += d * s_x * dot(q, q_x) + m * sum(x).
// Two builds (see linear_quant.h for the quad layout of the codes):
//   * AVX512-BF16 (and AMX): VNNI's `vpdpbusd`, 64 multiply-adds per instruction; one
//     64-byte load holds 128 codes, the low nibbles by one and, the high ones by a shift
//     and an and, both into the same int32 sums (3 uops decode 128 codes for every row).
//   * AVX2 (Zen 2/3, Haswell to Alder Lake): `vpmaddubsw` (u8 x s8 pairs to int16) per
//     8-column half, the int16 sums of a whole chunk added before one `vpmaddwd` widens
//     them (16 products of at most 15 * 127 per lane: 30480 < 2^15, never saturating).
// Plain AVX512 builds have neither here and run the exact fp32 kernel.
#include "linear_quant.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <memory>

namespace kiln_quant {

#if defined(__AVX512VNNI__) || (defined(__AVX2__) && !defined(__AVX512F__))
namespace {

struct XQ8 {
  const int8_t* q;   // [M, K] int8
  const float* s;    // [M, K/32] scales
  const int32_t* sum;  // [M, K/32] sums of q (the Q8 kernel's correction; Q4: unused)
  // The Q4 VNNI kernel's x, laid out per tile of up to 8 rows (see quantize_tiles).
  const int32_t* tq = nullptr;
  const float* ts = nullptr;
  const float* tsum = nullptr;
};

// The VNNI kernels' code prefetches go to L2: at one row the weights stream from DRAM,
// and a prefetch into L1 holds one of the core's few fill buffers for a whole DRAM round
// trip (perf: the `prefetcht0`s were the Q8_0 kernel's hottest instructions). 30 layers,
// 1 row, Xeon (amx), interleaved, speed-up over bf16: Q8_0 1.00-1.08x with T0, 1.21-1.30x
// with T1 (no prefetch 1.11-1.14x; T1 at 2x or 4x the distance, or two blocks per pass,
// no better); Q4 1.46-1.85x -> 1.65-1.96x.
#ifdef __AVX512VNNI__
constexpr auto kPrefetchHint = _MM_HINT_T1;
#endif

inline int32_t quad(const int8_t* p) {  // 4 adjacent int8 of x, as one broadcastable lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#ifdef __AVX512VNNI__
// MR rows x one 16-column block: its codes are one sequential stream (chunk after chunk).
// Both nibbles of a 64-byte load (128 codes) go into the same int32 sums, so the chunk's
// epilogue per row is one convert, one multiply and two FMAs: with several rows (a verify
// step) the kernel is bound by arithmetic, and the epilogue had been 6 of every 14 ops per
// row and chunk (the high nibbles in separate sums, each converted and folded in by 1/16).
// Fewer than 4 rows keep two independent sum chains, which hide `vpdpbusd`'s latency.
template <int MR>
void q4_vnni_direct(const QArgs& a, const XQ8& xq, int64_t m0, int64_t nb) {
  constexpr int kChains = MR < 4 ? 2 : 1;
  const int64_t chunks = a.K / 32;
  const __m512i low = _mm512_set1_epi8(0x0F);
  V16 acc[MR];
  __m512i g[MR][kChains];
  for (int m = 0; m < MR; ++m) {
    acc[m] = kiln_isa::zero();
    for (int c = 0; c < kChains; ++c) g[m][c] = _mm512_setzero_si512();
  }
  const uint8_t* codes = static_cast<const uint8_t*>(a.codes) + nb * chunks * 256;
  // This tile's x (quantize_tiles): every row's values at fixed offsets from three pointers.
  const int32_t* xi = xq.tq + m0 * chunks * 8;
  const float* xs = xq.ts + m0 * chunks;
  const float* xm = xq.tsum + m0 * chunks;
  for (int64_t kc = 0; kc < chunks; ++kc, xi += 8 * MR, xs += MR, xm += MR) {
    const uint8_t* c = codes + kc * 256;
    for (int p = 0; p < 4; ++p) {
      _mm_prefetch(reinterpret_cast<const char*>(c) + p * 64 + kAheadBytes, kPrefetchHint);
      const __m512i v = _mm512_loadu_si512(c + p * 64);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int m = 0; m < MR; ++m) {
        g[m][0] = _mm512_dpbusd_epi32(g[m][0], lo, _mm512_set1_epi32(xi[2 * p * MR + m]));
        g[m][kChains - 1] = _mm512_dpbusd_epi32(g[m][kChains - 1], hi,
                                                _mm512_set1_epi32(xi[(2 * p + 1) * MR + m]));
      }
    }
    const int64_t off = (nb * chunks + kc) * 16;
    _mm_prefetch(reinterpret_cast<const char*>(a.scale16 + off) + kAheadBytes / 8, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(a.min16 + off) + kAheadBytes / 8, _MM_HINT_T0);
    const V16 d = kiln_isa::load_f16(a.scale16 + off), mn = kiln_isa::load_f16(a.min16 + off);
    for (int m = 0; m < MR; ++m) {
      __m512i dot = g[m][0];  // |dot| <= 32 * 15 * 127: exact in int32 and in fp32
      if constexpr (kChains == 2) dot = _mm512_add_epi32(dot, g[m][1]);
      acc[m] = kiln_isa::fmadd(_mm512_cvtepi32_ps(dot), kiln_isa::mul(d, kiln_isa::set1(xs[m])),
                               acc[m]);
      acc[m] = kiln_isa::fmadd(kiln_isa::set1(xm[m]), mn, acc[m]);
      for (int ch = 0; ch < kChains; ++ch) g[m][ch] = _mm512_setzero_si512();
    }
  }
  for (int m = 0; m < MR; ++m) store_out(a, m0 + m, nb * 16, finish(a, acc[m], nb * 16));
}

// x quantized as quantize_rows quantizes it (the same codes and scales), written with
// its chunk sums per tile of up to 8 rows (the tiles x8_gemm walks: rows m0..,
// MR = min(8, M - m0)), so the kernel reaches row m of chunk kc at a fixed offset from
// one pointer per array:
//   tq [kc][p][nibble][MR] int32, from m0 * chunks * 8 (the quad of k = 32kc + 4p + 16 nibble)
//   ts, tsum [kc][MR] fp32, from m0 * chunks
// With rows addressed through their own pointers, a tile of 5-8 rows spilled the
// pointers to the stack inside the inner loop (Zen 4 perf annotate); this layout and the
// shared nibble sums together took 30 layers of Q4 linears at 8 rows from 5.72 to 5.37 ms
// (hot in cache: 1.19x), at 5 rows 4.26 to 4.05, at one row no change (2 threads).
// Quantizing straight into the tiles (a second, scalar pass re-laid quantize_rows'
// output before) took a whole forward at 7 rows from 8.69 to 8.57 ms (Zen 4).
void quantize_tiles(const QArgs& a, int32_t* tq, float* ts, float* tsum) {
  const int64_t chunks = a.K / 32;
  // dword p of a tile's chunk is quad p / 2 of the chunk's first 16 codes (p even) or
  // of its last 16 (p odd): dword p / 2 + 4 (p % 2) of the 32
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  alignas(32) int32_t d[8];
  for (int64_t row = 0; row < a.M; ++row) {
    const int64_t m0 = row / 8 * 8, mr = std::min<int64_t>(8, a.M - m0);
    int32_t* dq = tq + m0 * chunks * 8 + (row - m0);
    float* ds = ts + m0 * chunks + (row - m0);
    float* dm = tsum + m0 * chunks + (row - m0);
    for (int64_t kc = 0; kc < chunks; ++kc) {
      const int64_t i = row * chunks + kc;
      const V16 x0 = kiln_isa::loadu(a.xf + i * 32), x1 = kiln_isa::loadu(a.xf + i * 32 + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const V16 inv = kiln_isa::set1(amax > 0.f ? 127.f / amax : 0.f);
      const __m128i q0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(kiln_isa::mul(x0, inv)));
      const __m128i q1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(kiln_isa::mul(x1, inv)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(d),
                         _mm256_permutevar8x32_epi32(_mm256_set_m128i(q1, q0), order));
      for (int p = 0; p < 8; ++p) dq[(kc * 8 + p) * mr] = d[p];
      ds[kc * mr] = amax / 127.f;
      dm[kc * mr] = a.xsum[i];
    }
  }
}

// Q8_0: MR rows x one 16-column block. Its codes are [kk][c] per chunk (linear_quant.h),
// so a 64-byte load holds 4 k x 16 columns; `vpermd` gathers each 4-column group's 4 k
// into one 128-bit lane and `vpshufb` transposes the 4 x 4 bytes there: each 32-bit lane
// then holds one column's 4 adjacent k, in column order (no VBMI needed: Cooper Lake has
// AVX512-BF16 without it). `vpdpbusd` multiplies unsigned by signed bytes, so the codes
// go in as q ^ 0x80 = q + 128 and each row's chunk sum is corrected by 128 * sum(q_x),
// exactly (|sum| <= 32 * 255 * 127 fits int32).
template <int MR>
void q8_vnni_direct(const QArgs& a, const XQ8& xq, int64_t m0, int64_t nb) {
  constexpr int kChains = MR == 1 ? 2 : 1;  // one row alone: two dot chains hide latency
  const int64_t chunks = a.K / 32;
  const __m512i groups = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i bytes = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  V16 acc[MR];
  __m512i g[MR][kChains];
  for (int m = 0; m < MR; ++m) {
    acc[m] = kiln_isa::zero();
    for (int c = 0; c < kChains; ++c) g[m][c] = _mm512_setzero_si512();
  }
  const int8_t* codes = static_cast<const int8_t*>(a.codes) + nb * chunks * 512;
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const int8_t* c = codes + kc * 512;
    for (int p = 0; p < 8; ++p) {  // k = 4p .. 4p + 3 of the chunk
      _mm_prefetch(reinterpret_cast<const char*>(c) + p * 64 + kAheadBytes, kPrefetchHint);
      const __m512i v = _mm512_loadu_si512(c + p * 64);
      const __m512i w = _mm512_xor_si512(
          _mm512_shuffle_epi8(_mm512_permutexvar_epi32(groups, v), bytes), flip);
      for (int m = 0; m < MR; ++m) {
        const int8_t* xk = xq.q + (m0 + m) * a.K + kc * 32 + 4 * p;
        g[m][p % kChains] = _mm512_dpbusd_epi32(g[m][p % kChains], w, _mm512_set1_epi32(quad(xk)));
      }
    }
    const int64_t off = (nb * chunks + kc) * 16;
    _mm_prefetch(reinterpret_cast<const char*>(a.scale16 + off) + kAheadBytes / 16, _MM_HINT_T0);
    const V16 d = kiln_isa::load_f16(a.scale16 + off);
    for (int m = 0; m < MR; ++m) {
      const int64_t xc = (m0 + m) * chunks + kc;
      __m512i dot = _mm512_sub_epi32(g[m][0], _mm512_set1_epi32(128 * xq.sum[xc]));
      if constexpr (kChains == 2) dot = _mm512_add_epi32(dot, g[m][1]);
      acc[m] = kiln_isa::fmadd(_mm512_cvtepi32_ps(dot), kiln_isa::mul(d, kiln_isa::set1(xq.s[xc])),
                               acc[m]);
      for (int ch = 0; ch < kChains; ++ch) g[m][ch] = _mm512_setzero_si512();
    }
  }
  for (int m = 0; m < MR; ++m) store_out(a, m0 + m, nb * 16, finish(a, acc[m], nb * 16));
}

// x (fp32, a.xf) to int8 per row and chunk: s = max|x| / 127, q = round(x / s); an
// all-zero chunk gets s = 0 and codes 0.
// With `sum` (the Q8 kernel's correction) also each chunk's sum of codes: |x / s| <= 127,
// so the int32 values are the codes themselves (the narrowing never saturates).
void quantize_rows(const QArgs& a, int8_t* q, float* s, int32_t* sum = nullptr) {
  for (int64_t i = 0; i < a.M * a.K / 32; ++i) {
    const V16 x0 = kiln_isa::loadu(a.xf + i * 32), x1 = kiln_isa::loadu(a.xf + i * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    s[i] = amax / 127.f;
    const V16 inv = kiln_isa::set1(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i r0 = _mm512_cvtps_epi32(kiln_isa::mul(x0, inv));
    const __m512i r1 = _mm512_cvtps_epi32(kiln_isa::mul(x1, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * 32), _mm512_cvtsepi32_epi8(r0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * 32 + 16), _mm512_cvtsepi32_epi8(r1));
    if (sum != nullptr) sum[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));
  }
}

using TileFn = void (*)(const QArgs&, const XQ8&, int64_t, int64_t);
// Up to 8 rows (a decode step verifying draft tokens) in one pass over a block: each
// weight chunk is decoded once for every row (3 x MR accumulators: 24 registers at 8).
constexpr TileFn kQ4Direct[8] = {q4_vnni_direct<1>, q4_vnni_direct<2>, q4_vnni_direct<3>,
                                 q4_vnni_direct<4>, q4_vnni_direct<5>, q4_vnni_direct<6>,
                                 q4_vnni_direct<7>, q4_vnni_direct<8>};
// Q8_0: 8 rows hold 8 int and 8 float accumulators, beside the code and constant registers.
constexpr TileFn kQ8Direct[8] = {q8_vnni_direct<1>, q8_vnni_direct<2>, q8_vnni_direct<3>,
                                 q8_vnni_direct<4>, q8_vnni_direct<5>, q8_vnni_direct<6>,
                                 q8_vnni_direct<7>, q8_vnni_direct<8>};

void x8_gemm(const QArgs& a, const XQ8& xq, const TileFn* tiles) {
  // Threads split the column blocks; each walks its blocks, back to back in memory, in
  // order: one sequential stream of codes (and one of scales, one of offsets).
  at::parallel_for(0, a.N / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t m = 0; m < a.M; m += 8)
        tiles[std::min<int64_t>(8, a.M - m) - 1](a, xq, m, nb);
  });
}
#else
// MR rows x NH 8-column halves starting at half h0 (16-column block h0 / 2, bytes
// (h0 % 2) * 32.. of each 64-byte quad group: 8 columns x 4 k) into out[MR][ostride].
template <int MR, int NH>
void q4_x8_halves(const QArgs& a, const XQ8& xq, int64_t m0, int64_t h0, float* out,
                  int64_t ostride) {
  const int64_t chunks = a.K / 32;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MR][NH];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NH; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const uint8_t* c[NH];
    for (int j = 0; j < NH; ++j)
      c[j] = static_cast<const uint8_t*>(a.codes) + ((h0 + j) / 2 * chunks + kc) * 256 +
             (h0 + j) % 2 * 32;
    __m256i s[MR][NH];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NH; ++j) s[m][j] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      for (int j = 0; j < NH; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(c[j]) + p * 64 + kAheadBytes, _MM_HINT_T0);
      __m256i lo[NH], hi[NH];
      for (int j = 0; j < NH; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c[j] + p * 64));
        lo[j] = _mm256_and_si256(v, low);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      for (int m = 0; m < MR; ++m) {
        const int8_t* xk = xq.q + (m0 + m) * a.K + kc * 32 + 4 * p;
        const __m256i xa = _mm256_set1_epi32(quad(xk)), xb = _mm256_set1_epi32(quad(xk + 16));
        for (int j = 0; j < NH; ++j)
          s[m][j] = _mm256_add_epi16(s[m][j], _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], xa),
                                                               _mm256_maddubs_epi16(hi[j], xb)));
      }
    }
    for (int j = 0; j < NH; ++j) {
      const int64_t off = ((h0 + j) / 2 * chunks + kc) * 16 + (h0 + j) % 2 * 8;
      _mm_prefetch(reinterpret_cast<const char*>(a.scale16 + off) + kAheadBytes / 8, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(a.min16 + off) + kAheadBytes / 8, _MM_HINT_T0);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.scale16 + off)));
      const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.min16 + off)));
      for (int m = 0; m < MR; ++m) {
        const int64_t xc = (m0 + m) * chunks + kc;
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[m][j], ones));
        acc[m][j] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(xq.s[xc])), acc[m][j]);
        acc[m][j] = _mm256_fmadd_ps(_mm256_set1_ps(a.xsum[xc]), mn, acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NH; ++j) _mm256_storeu_ps(out + m * ostride + j * 8, acc[m][j]);
}

// out[MR][ostride] (fp32 sums of `blocks` whole 16-column blocks from nb) -> y.
void store_blocks(const QArgs& a, const float* out, int64_t ostride, int64_t m0, int64_t mr,
                  int64_t nb, int64_t blocks) {
  for (int64_t m = 0; m < mr; ++m)
    for (int64_t j = 0; j < blocks; ++j) {
      const int64_t col = (nb + j) * 16;
      store_out(a, m0 + m, col, finish(a, kiln_isa::loadu(out + m * ostride + j * 16), col));
    }
}

// x (fp32, a.xf) to int8 per row and chunk: s = max|x| / 127, q = round(x / s); an
// all-zero chunk gets s = 0 and codes 0.
void quantize_rows(const QArgs& a, int8_t* q, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  // packs work per 128-bit lane; this puts the four rows of 8 back in order
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < a.M * a.K / 32; ++i) {
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int t = 0; t < 4; ++t) {
      v[t] = _mm256_loadu_ps(a.xf + i * 32 + 8 * t);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[t]));
    }
    const float amax = kiln_isa::hmax8(mx);
    s[i] = amax / 127.f;
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i r[4];
    for (int t = 0; t < 4; ++t) r[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], inv));
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]),
                                         _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * 32),
                        _mm256_permutevar8x32_epi32(w, order));
  }
}

using HalvesFn = void (*)(const QArgs&, const XQ8&, int64_t, int64_t, float*, int64_t);
// 1..4 rows over one block (both halves at once: 2 x MR int16 sums, 4 code registers).
constexpr HalvesFn kRows[4] = {q4_x8_halves<1, 2>, q4_x8_halves<2, 2>, q4_x8_halves<3, 2>,
                               q4_x8_halves<4, 2>};
// 5..8 rows (a decode step verifying draft tokens), one half at a time: each chunk's
// codes are decoded once for every row, in the 16 ymm registers.
constexpr HalvesFn kTall[4] = {q4_x8_halves<5, 1>, q4_x8_halves<6, 1>, q4_x8_halves<7, 1>,
                               q4_x8_halves<8, 1>};

void x8_gemm(const QArgs& a, const XQ8& xq) {
  // Threads split the column blocks; each walks its blocks, which lie back to back in
  // memory, in order: one sequential stream of codes (and one of scales, one of offsets).
  at::parallel_for(0, a.N / 16, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float out[8 * 16];
    for (int64_t nb = begin; nb < end; ++nb) {
      if (a.M > 4 && a.M <= 8) {
        kTall[a.M - 5](a, xq, 0, 2 * nb, out, 16);
        kTall[a.M - 5](a, xq, 0, 2 * nb + 1, out + 8, 16);
        store_blocks(a, out, 16, 0, a.M, nb, 1);
        continue;
      }
      for (int64_t m = 0; m < a.M; m += 4) {
        const int64_t mr = std::min<int64_t>(4, a.M - m);
        kRows[mr - 1](a, xq, m, 2 * nb, out, 16);
        store_blocks(a, out, 16, m, mr, nb, 1);
      }
    }
  });
}
#endif

}  // namespace

bool q4_x8_gemm(const QArgs& a) {
#ifdef __AVX512VNNI__
  const int64_t n = a.M * a.K / 32;
  std::unique_ptr<int32_t[]> tq(new int32_t[n * 8]);
  std::unique_ptr<float[]> ts(new float[n]), tsum(new float[n]);
  quantize_tiles(a, tq.get(), ts.get(), tsum.get());
  x8_gemm(a, XQ8{nullptr, nullptr, nullptr, tq.get(), ts.get(), tsum.get()}, kQ4Direct);
#else
  std::unique_ptr<int8_t[]> q(new int8_t[a.M * a.K]);
  std::unique_ptr<float[]> s(new float[a.M * a.K / 32]);
  quantize_rows(a, q.get(), s.get());
  x8_gemm(a, XQ8{q.get(), s.get(), nullptr});
#endif
  return true;
}

#ifdef __AVX512VNNI__
bool q8_x8_gemm(const QArgs& a) {
  const int64_t n = a.M * a.K / 32;
  std::unique_ptr<int8_t[]> q(new int8_t[a.M * a.K]);
  std::unique_ptr<float[]> s(new float[n]);
  std::unique_ptr<int32_t[]> sum(new int32_t[n]);
  quantize_rows(a, q.get(), s.get(), sum.get());
  x8_gemm(a, XQ8{q.get(), s.get(), sum.get()}, kQ8Direct);
  return true;
}
#else
bool q8_x8_gemm(const QArgs&) { return false; }  // maddubs would saturate on q + 128
#endif
#else
bool q4_x8_gemm(const QArgs&) { return false; }
bool q8_x8_gemm(const QArgs&) { return false; }
#endif

}  // namespace kiln_quant
