// kiln_cpu::linear_quant's native-bf16 kernels (AVX512-BF16 and AMX builds, bf16 x); see
// linear_quant.h for the formats. Other builds compile `bf16_gemm` as "not here".
#include "linear_quant.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <memory>

namespace kiln_quant {

#ifdef __AVX512BF16__
namespace {

// The native-bf16 panel (bf16 x, AVX512-BF16 builds): each thread converts kCodeBlocks
// column blocks, whole K, to bf16 in the packed linear's pair layout (csrc/linear_bf16.cpp)
// once per block of x rows, and runs 4 x 4 `vdpbf16ps` tiles over them (2x the direct
// kernel's multiply rate, no per-call weight copy: the panels are per-thread scratch).
// INT8 codes convert exactly (every code fits bf16's 8-bit significand) and the row
// scale applies at the end, as in the direct kernel. Q8/Q4 weights are dequantized to
// bf16, q * d (+ m) rounded once: the weight a bf16 model with these values would hold
// (bf16 activations only; fp32 activations always take the exact fp32 kernels).
constexpr int kCodeBlocks = 4;

// 16 fp32 values of k and 16 of k + 1 -> 32 bf16 interleaved (c0k, c0k+1, c1k, ...).
inline __m512i pair_bf16(V16 k0, V16 k1) {
  const __m512i seq = (__m512i)_mm512_cvtne2ps_pbh(k1, k0);  // [k0 lanes | k1 lanes]
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                       24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                       16, 0);
  return _mm512_permutexvar_epi16(idx, seq);
}

// Column block nb -> panel[K/32][16 pair rows][32 bf16].
template <int F>
void weights_to_bf16(const QArgs& a, int64_t nb, uint16_t* panel) {
  const int64_t chunks = a.K / 32;
  for (int64_t kc = 0; kc < chunks; ++kc) {
    __m512i* p = reinterpret_cast<__m512i*>(panel + kc * 512);
    const int64_t off = (nb * chunks + kc) * 16;
    if constexpr (F == kQ4) {
      const uint8_t* c = static_cast<const uint8_t*>(a.codes) + (nb * chunks + kc) * 256;
      const V16 d = kiln_isa::load_f16(a.scale16 + off), mn = kiln_isa::load_f16(a.min16 + off);
      for (int r = 0; r < 8; ++r) {  // pair rows r (k = 2r, 2r + 1) and r + 8 (+ 16)
        V16 lo0, hi0, lo1, hi1;
        const uint8_t* q = c + (r / 2) * 64;
        kiln_isa::load_u4q(q, 2 * (r % 2), lo0, hi0);
        kiln_isa::load_u4q(q, 2 * (r % 2) + 1, lo1, hi1);
        _mm512_storeu_si512(p + r, pair_bf16(kiln_isa::fmadd(lo0, d, mn),
                                             kiln_isa::fmadd(lo1, d, mn)));
        _mm512_storeu_si512(p + r + 8, pair_bf16(kiln_isa::fmadd(hi0, d, mn),
                                                 kiln_isa::fmadd(hi1, d, mn)));
      }
    } else {
      const int8_t* c = static_cast<const int8_t*>(a.codes) + (nb * chunks + kc) * 512;
      const V16 d = F == kQ8 ? kiln_isa::load_f16(a.scale16 + off) : kiln_isa::set1(1.f);
      for (int r = 0; r < 16; ++r)
        _mm512_storeu_si512(p + r, pair_bf16(kiln_isa::mul(kiln_isa::load_i8(c + 2 * r * 16), d),
                                             kiln_isa::mul(kiln_isa::load_i8(c + (2 * r + 1) * 16), d)));
    }
  }
}

// Rows m0..m0+MR (bf16 x) against the NR converted blocks starting at column block nb.
template <int F, int MR, int NR>
void bf16_tile(const QArgs& a, const uint16_t* x, const uint16_t* const* panels, int64_t m0,
               int64_t nb) {
  const int64_t chunks = a.K / 32;
  V16 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = kiln_isa::zero();
  for (int64_t kc = 0; kc < chunks; ++kc)
    for (int r = 0; r < 16; ++r) {
      __m512bh w[NR];
      for (int j = 0; j < NR; ++j)
        w[j] = (__m512bh)_mm512_loadu_si512(panels[j] + kc * 512 + r * 32);
      for (int m = 0; m < MR; ++m) {
        const kiln_isa::Pair xp = kiln_isa::load_pair(x + (m0 + m) * a.K, nullptr, kc * 32 + 2 * r);
        for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xp, w[j]);
      }
    }
  for (int j = 0; j < NR; ++j) {
    const int64_t col = (nb + j) * 16;
    for (int m = 0; m < MR; ++m) {
      V16 v = acc[m][j];
      if constexpr (F == kInt8) v = kiln_isa::mul(v, kiln_isa::loadu(a.scale32 + col));
      store_out(a, m0 + m, col, finish(a, v, col));
    }
  }
}

// The direct Q4 kernel for bf16 x (few rows: decode), llama.cpp's scheme: x is quantized
// to int8 per row and 32-column chunk (scale max|x| / 127, round to nearest) and meets
// the 4-bit codes in VNNI's `vpdpbusd`, 64 multiply-adds per instruction, where a bf16
// `vdpbf16ps` does 32 and needs the codes widened first. In the quad layout
// (linear_quant.h) one 64-byte load holds 128 codes: the low nibbles by one and, the high
// ones masked in place (16 q, folded back by 1/16), so 2 uops decode 128 codes. Integer
// sums are exact; per chunk they are scaled once and the offset term uses the exact
// chunk sum of x:  acc += d * s_x * (dot_lo + dot_hi / 16) + m * sum(x).
struct XQ8 {
  const int8_t* q;   // [M, K] int8
  const float* s;    // [M, K/32] scales
};

template <int MR, int NR>
void q4_vnni_direct(const QArgs& a, const XQ8& xq, int64_t m0, int64_t nb) {
  const int64_t chunks = a.K / 32;
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  const V16 sixteenth = kiln_isa::set1(1.f / 16);
  V16 acc[MR][NR];
  __m512i g[MR][NR], h[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) {
      acc[m][j] = kiln_isa::zero();
      g[m][j] = h[m][j] = _mm512_setzero_si512();
    }
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const uint8_t* c[NR];
    for (int j = 0; j < NR; ++j)
      c[j] = static_cast<const uint8_t*>(a.codes) + ((nb + j) * chunks + kc) * 256;
    for (int p = 0; p < 4; ++p) {
      prefetch_ahead<NR>(c, p * 64, 256);
      __m512i lo[NR], hi[NR];
      for (int j = 0; j < NR; ++j) {
        const __m512i v = _mm512_loadu_si512(c[j] + p * 64);
        lo[j] = _mm512_and_si512(v, low);
        hi[j] = _mm512_and_si512(v, high);
      }
      for (int m = 0; m < MR; ++m) {
        const int8_t* xk = xq.q + (m0 + m) * a.K + kc * 32 + 4 * p;
        int32_t lo_quad, hi_quad;
        std::memcpy(&lo_quad, xk, 4);
        std::memcpy(&hi_quad, xk + 16, 4);
        const __m512i xa = _mm512_set1_epi32(lo_quad), xb = _mm512_set1_epi32(hi_quad);
        for (int j = 0; j < NR; ++j) {
          g[m][j] = _mm512_dpbusd_epi32(g[m][j], lo[j], xa);
          h[m][j] = _mm512_dpbusd_epi32(h[m][j], hi[j], xb);
        }
      }
    }
    for (int j = 0; j < NR; ++j) {
      const int64_t off = ((nb + j) * chunks + kc) * 16;
      _mm_prefetch(reinterpret_cast<const char*>(a.scale16 + off + kAhead * 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(a.min16 + off + kAhead * 16), _MM_HINT_T0);
      const V16 d = kiln_isa::load_f16(a.scale16 + off), mn = kiln_isa::load_f16(a.min16 + off);
      for (int m = 0; m < MR; ++m) {
        const int64_t xc = (m0 + m) * chunks + kc;
        const V16 dot = kiln_isa::fmadd(_mm512_cvtepi32_ps(h[m][j]), sixteenth,
                                        _mm512_cvtepi32_ps(g[m][j]));
        acc[m][j] = kiln_isa::fmadd(dot, kiln_isa::mul(d, kiln_isa::set1(xq.s[xc])), acc[m][j]);
        acc[m][j] = kiln_isa::fmadd(kiln_isa::set1(a.xsum[xc]), mn, acc[m][j]);
        g[m][j] = h[m][j] = _mm512_setzero_si512();
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int m = 0; m < MR; ++m)
      store_out(a, m0 + m, (nb + j) * 16, finish(a, acc[m][j], (nb + j) * 16));
}

// x (fp32, a.xf) to int8 per row and chunk: s = max|x| / 127, q = round(x / s); an
// all-zero chunk gets s = 0 and codes 0.
void quantize_rows(const QArgs& a, int8_t* q, float* s) {
  for (int64_t i = 0; i < a.M * a.K / 32; ++i) {
    const V16 x0 = kiln_isa::loadu(a.xf + i * 32), x1 = kiln_isa::loadu(a.xf + i * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    s[i] = amax / 127.f;
    const V16 inv = kiln_isa::set1(amax > 0.f ? 127.f / amax : 0.f);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * 32),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(kiln_isa::mul(x0, inv))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * 32 + 16),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(kiln_isa::mul(x1, inv))));
  }
}

using Q4DirectFn = void (*)(const QArgs&, const XQ8&, int64_t, int64_t);
template <int MR>
constexpr Q4DirectFn kQ4Row[4] = {q4_vnni_direct<MR, 1>, q4_vnni_direct<MR, 2>,
                                  q4_vnni_direct<MR, 3>, q4_vnni_direct<MR, 4>};
constexpr const Q4DirectFn* kQ4Direct[4] = {kQ4Row<1>, kQ4Row<2>, kQ4Row<3>, kQ4Row<4>};
// 5..8 rows (a decode step verifying draft tokens) in one pass over one column block:
// each weight chunk is decoded once for every row (3 x MR accumulators: 24 registers at
// MR = 8), where tiles of 4 rows decoded it twice.
constexpr Q4DirectFn kQ4Tall[4] = {q4_vnni_direct<5, 1>, q4_vnni_direct<6, 1>,
                                   q4_vnni_direct<7, 1>, q4_vnni_direct<8, 1>};

void q4_direct_gemm(const QArgs& a) {
  std::unique_ptr<int8_t[]> q(new int8_t[a.M * a.K]);
  std::unique_ptr<float[]> s(new float[a.M * a.K / 32]);
  quantize_rows(a, q.get(), s.get());
  const XQ8 xq{q.get(), s.get()};
  if (a.M > 4 && a.M <= 8) {
    at::parallel_for(0, a.N / 16, 1, [&](int64_t begin, int64_t end) {
      for (int64_t nb = begin; nb < end; ++nb) kQ4Tall[a.M - 5](a, xq, 0, nb);
    });
    return;
  }
  constexpr int MR = 4;
  const int NR = a.M == 1 ? 4 : 2;  // as direct_gemm: one row keeps more loads in flight
  at::parallel_for(0, a.N / 16, NR, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; nb += NR) {
      const int64_t nr = std::min<int64_t>(NR, end - nb);
      for (int64_t m = 0; m < a.M; m += MR)
        kQ4Direct[std::min<int64_t>(MR, a.M - m) - 1][nr - 1](a, xq, m, nb);
    }
  });
}

using Bf16TileFn = void (*)(const QArgs&, const uint16_t*, const uint16_t* const*, int64_t,
                            int64_t);
template <int F, int NR>
constexpr Bf16TileFn kBf16Row[4] = {bf16_tile<F, 1, NR>, bf16_tile<F, 2, NR>,
                                    bf16_tile<F, 3, NR>, bf16_tile<F, 4, NR>};
template <int F>
constexpr const Bf16TileFn* kBf16Tiles[kCodeBlocks] = {kBf16Row<F, 1>, kBf16Row<F, 2>,
                                                       kBf16Row<F, 3>, kBf16Row<F, 4>};

template <int F>
void bf16_panel_gemm(const QArgs& a, const uint16_t* x) {
  constexpr int64_t MR = 4, NB = kCodeBlocks;
  const int64_t fit = std::max<int64_t>(MR, kPanelXBytes / (a.K * 2) / MR * MR);
  const int64_t blocks = (a.M + fit - 1) / fit;
  const int64_t block = ((a.M + blocks - 1) / blocks + MR - 1) / MR * MR;
  at::parallel_for(0, a.N / 16, NB, [&](int64_t begin, int64_t end) {
    std::unique_ptr<uint16_t[]> buf(new uint16_t[NB * a.K * 16]);
    const uint16_t* panels[NB];
    for (int j = 0; j < NB; ++j) panels[j] = buf.get() + j * a.K * 16;
    for (int64_t mb = 0; mb < a.M; mb += block) {
      const int64_t me = std::min(a.M, mb + block);
      for (int64_t nb = begin; nb < end; nb += NB) {
        const int64_t nr = std::min<int64_t>(NB, end - nb);
        for (int j = 0; j < nr; ++j) weights_to_bf16<F>(a, nb + j, buf.get() + j * a.K * 16);
        for (int64_t m = mb; m < me; m += MR)
          kBf16Tiles<F>[nr - 1][std::min<int64_t>(MR, me - m) - 1](a, x, panels, m, nb);
      }
    }
  });
}

}  // namespace

bool bf16_gemm(const QArgs& a, const uint16_t* x, int64_t fmt, bool panel) {
  if (panel) {
    switch (fmt) {
      case kInt8: bf16_panel_gemm<kInt8>(a, x); return true;
      case kQ8: bf16_panel_gemm<kQ8>(a, x); return true;
      default: bf16_panel_gemm<kQ4>(a, x); return true;
    }
  }
  if (fmt != kQ4) return false;
  q4_direct_gemm(a);
  return true;
}
#else
bool bf16_gemm(const QArgs&, const uint16_t*, int64_t, bool) { return false; }
#endif

}  // namespace kiln_quant
