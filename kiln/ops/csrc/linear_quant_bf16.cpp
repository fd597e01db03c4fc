// kiln_cpu::linear_quant's native-bf16 panel (AVX512-BF16 and AMX builds, bf16 x); see
// linear_quant.h for the formats. Other builds compile `bf16_panel` as "not here".
#include "linear_quant.h"
#include "amx.h"

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
// Accumulators in registers: KILN_UNROLL (simd.h). kSilu: panels are NR / 2 gate blocks
// from nb on, then their up blocks; y [M, N / 2] = silu(g) * u, g and u rounded to bf16 as
// the plain tile stores them (the same bits as silu_and_mul after it).
template <int F, int MR, int NR, bool kSilu = false>
void bf16_tile(const QArgs& a, const uint16_t* x, const uint16_t* const* panels, int64_t m0,
               int64_t nb) {
  const int64_t chunks = a.K / 32;
  V16 acc[MR][NR];
  KILN_UNROLL
  for (int m = 0; m < MR; ++m)
    KILN_UNROLL
    for (int j = 0; j < NR; ++j) acc[m][j] = kiln_isa::zero();
  for (int64_t kc = 0; kc < chunks; ++kc)
    for (int r = 0; r < 16; ++r) {
      __m512bh w[NR];
      KILN_UNROLL
      for (int j = 0; j < NR; ++j)
        w[j] = (__m512bh)_mm512_loadu_si512(panels[j] + kc * 512 + r * 32);
      KILN_UNROLL
      for (int m = 0; m < MR; ++m) {
        const kiln_isa::Pair xp = kiln_isa::load_pair(x + (m0 + m) * a.K, nullptr, kc * 32 + 2 * r);
        KILN_UNROLL
        for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xp, w[j]);
      }
    }
  const auto out = [&](int m, int j, int64_t col) {
    V16 v = acc[m][j];
    if constexpr (F == kInt8) v = kiln_isa::mul(v, kiln_isa::loadu(a.scale32 + col));
    return finish(a, v, col);
  };
  if constexpr (kSilu) {
    constexpr int G = NR / 2;
    auto* y = static_cast<c10::BFloat16*>(a.y);
    KILN_UNROLL
    for (int j = 0; j < G; ++j) {
      const int64_t col = (nb + j) * 16;
      KILN_UNROLL
      for (int m = 0; m < MR; ++m) {
        const V16 g = kiln_isa::round_bf16(out(m, j, col));
        const V16 u = kiln_isa::round_bf16(out(m, j + G, col + a.N / 2));
        kiln_isa::store_bf16(y + (m0 + m) * (a.N / 2) + col, kiln_isa::silu_mul(g, u));
      }
    }
  } else {
    KILN_UNROLL
    for (int j = 0; j < NR; ++j) {
      const int64_t col = (nb + j) * 16;
      KILN_UNROLL
      for (int m = 0; m < MR; ++m) store_out(a, m0 + m, col, out(m, j, col));
    }
  }
}

using Bf16TileFn = void (*)(const QArgs&, const uint16_t*, const uint16_t* const*, int64_t,
                            int64_t);
template <int F, int NR>
constexpr Bf16TileFn kBf16Row[4] = {bf16_tile<F, 1, NR>, bf16_tile<F, 2, NR>,
                                    bf16_tile<F, 3, NR>, bf16_tile<F, 4, NR>};
template <int F>
constexpr const Bf16TileFn* kBf16Tiles[kCodeBlocks] = {kBf16Row<F, 1>, kBf16Row<F, 2>,
                                                       kBf16Row<F, 3>, kBf16Row<F, 4>};
// [gate blocks - 1][rows - 1]: SiLU tiles of one or two gate blocks and their up blocks.
template <int F, int G>
constexpr Bf16TileFn kBf16SiluRow[4] = {
    bf16_tile<F, 1, 2 * G, true>, bf16_tile<F, 2, 2 * G, true>, bf16_tile<F, 3, 2 * G, true>,
    bf16_tile<F, 4, 2 * G, true>};
template <int F>
constexpr const Bf16TileFn* kBf16SiluTiles[2] = {kBf16SiluRow<F, 1>, kBf16SiluRow<F, 2>};

#ifdef KILN_AMX
// With AMX the converted blocks, already in the B tiles' layout, run on tiles: up to 32
// rows against converted blocks j and j + 1 of a thread's column blocks, in
// kiln_amx::AmxPipeline's order (each block's epilogue runs while the next block's tiles
// compute). On a 2-vCPU Sapphire Rapids class Xeon the register tiles above ran a
// 2,000-row prefill's Q4 linears at about a fifth of the tiles' rate.
template <int F>
struct QuantEpilogue {
  const QArgs* a;

  void operator()(const kiln_amx::AmxBlock& t, int64_t r0, int64_t r1) const {
    for (int64_t r = r0; r < r1; ++r)
      for (int b = 0; b < (t.pair ? 2 : 1); ++b) {
        const int64_t col = (t.nb + b) * 16;
        V16 v = kiln_isa::loadu(t.c[r / 16 * 2 + b][r % 16]);
        if constexpr (F == kInt8) v = kiln_isa::mul(v, kiln_isa::loadu(a->scale32 + col));
        store_out(*a, t.m0 + r, col, finish(*a, v, col));
      }
  }
};

// The x bytes one pass of converted blocks serves. Each pass converts the thread's whole
// share of the weight again, and on tiles the conversion, not the x reads, bounds a pass:
// 2-vCPU Xeon (amx), SmolLM2's four shapes, 4 layers, Q4 at 512 / 2,000 rows: 12.1 / 45-49
// ms with 256 KiB passes, 9.6-10.5 / 41-42 with 1 MiB, 9.7-10.3 / 48-52 with 4 MiB.
constexpr int64_t kAmxPassXBytes = 4 * kPanelXBytes;

// kSilu: a thread's units are gate blocks (I / 16 of them), each converted beside its up
// block into panels 2j and 2j + 1; otherwise its units are column blocks, panel j each.
template <int F, bool kSilu, class Epilogue>
void amx_panel_gemm(const QArgs& a, const uint16_t* x, Epilogue epilogue) {
  constexpr int64_t NB = kCodeBlocks, kGrain = kSilu ? NB / 2 : NB;
  const int64_t half = a.N / 32, units = kSilu ? half : a.N / 16;
  const int64_t fit = std::max<int64_t>(32, kAmxPassXBytes / (a.K * 2) / 32 * 32);
  at::parallel_for(0, units, kGrain, [&](int64_t begin, int64_t end) {
    const auto buf = kiln_isa::aligned_buffer<uint16_t>(NB * a.K * 16);
    const auto panel = [&](int64_t j) { return buf.get() + j * a.K * 16; };
    kiln_amx::GemmRows rb;
    kiln_amx::AmxPipeline<Epilogue> pipe(epilogue);
    const int64_t chunks = a.K / 32;
    for (int64_t mb = 0; mb < a.M; mb += fit) {
      const int64_t me = std::min(a.M, mb + fit);
      for (int64_t u = begin; u < end; u += kGrain) {
        const int64_t nu = std::min<int64_t>(kGrain, end - u);
        // The pending block reads its accumulators' copy, not the panels: they may change.
        for (int64_t j = 0; j < nu; ++j) {
          if constexpr (kSilu) {
            weights_to_bf16<F>(a, u + j, panel(2 * j));
            weights_to_bf16<F>(a, u + j + half, panel(2 * j + 1));
          } else {
            weights_to_bf16<F>(a, u + j, panel(j));
          }
        }
        const int64_t np = kSilu ? 2 * nu : nu;
        for (int64_t m = mb; m < me; m += 32) {
          rb.next(me - m);  // may reconfigure: the pending block is already stored
          const uint16_t* x0 = x + m * a.K;
          for (int64_t j = 0; j < np; j += 2) {
            const bool two = j + 1 < np;
            pipe.run(x0, x0 + 16 * a.K, a.K * 2, panel(j), panel(two ? j + 1 : j), chunks, 0,
                     m, rb, kSilu ? u + j / 2 : u + j, two);
          }
        }
      }
    }
    pipe.flush();
    _tile_release();
  });
}
#endif

// The register panel. A thread's units are column blocks (kCodeBlocks a tile), or with
// kSilu gate blocks (two a tile), each converted with its up block: panels j and nu + j.
template <int F, bool kSilu>
void register_panel_gemm(const QArgs& a, const uint16_t* x) {
  constexpr int64_t MR = 4, NB = kCodeBlocks, kGrain = kSilu ? NB / 2 : NB;
  const int64_t half = a.N / 32, units = kSilu ? half : a.N / 16;
  const int64_t fit = std::max<int64_t>(MR, kPanelXBytes / (a.K * 2) / MR * MR);
  const int64_t blocks = (a.M + fit - 1) / fit;
  const int64_t block = ((a.M + blocks - 1) / blocks + MR - 1) / MR * MR;
  at::parallel_for(0, units, kGrain, [&](int64_t begin, int64_t end) {
    const auto buf = kiln_isa::aligned_buffer<uint16_t>(NB * a.K * 16);
    uint16_t* panels[NB];
    for (int j = 0; j < NB; ++j) panels[j] = buf.get() + j * a.K * 16;
    for (int64_t mb = 0; mb < a.M; mb += block) {
      const int64_t me = std::min(a.M, mb + block);
      for (int64_t u = begin; u < end; u += kGrain) {
        const int64_t nu = std::min<int64_t>(kGrain, end - u);
        for (int j = 0; j < nu; ++j) {
          weights_to_bf16<F>(a, u + j, panels[j]);
          if constexpr (kSilu) weights_to_bf16<F>(a, u + j + half, panels[nu + j]);
        }
        const Bf16TileFn* tiles = kSilu ? kBf16SiluTiles<F>[nu - 1] : kBf16Tiles<F>[nu - 1];
        for (int64_t m = mb; m < me; m += MR)
          tiles[std::min<int64_t>(MR, me - m) - 1](a, x, panels, m, u);
      }
    }
  });
}

template <int F>
void bf16_panel_gemm(const QArgs& a, const uint16_t* x) {
#ifdef KILN_AMX
  if (kiln_amx::state().enabled && a.M >= kiln_amx::state().min_rows) {
    amx_panel_gemm<F, false>(a, x, QuantEpilogue<F>{&a});
    return;
  }
#endif
  register_panel_gemm<F, false>(a, x);
}

// SiLU in the epilogue, into a.y ([M, N / 2]): on tiles (AMX) or in the register tiles.
template <int F>
void panel_silu(const QArgs& a, const uint16_t* x) {
#ifdef KILN_AMX
  if (kiln_amx::state().enabled && a.M >= kiln_amx::state().min_rows) {
    const float* scale = F == kInt8 ? a.scale32 : nullptr;
    amx_panel_gemm<F, true>(
        a, x, kiln_amx::SiluEpilogue{static_cast<uint16_t*>(a.y), a.N / 32, scale});
    return;
  }
#endif
  register_panel_gemm<F, true>(a, x);
}

}  // namespace

bool bf16_panel_silu(const QArgs& a, const uint16_t* x, int64_t fmt) {
  switch (fmt) {
    case kInt8: panel_silu<kInt8>(a, x); return true;
    case kQ8: panel_silu<kQ8>(a, x); return true;
    default: panel_silu<kQ4>(a, x); return true;
  }
}

bool bf16_panel(const QArgs& a, const uint16_t* x, int64_t fmt) {
  switch (fmt) {
    case kInt8: bf16_panel_gemm<kInt8>(a, x); return true;
    case kQ8: bf16_panel_gemm<kQ8>(a, x); return true;
    default: bf16_panel_gemm<kQ4>(a, x); return true;
  }
}
#else
bool bf16_panel(const QArgs&, const uint16_t*, int64_t) { return false; }
bool bf16_panel_silu(const QArgs&, const uint16_t*, int64_t) { return false; }
#endif

}  // namespace kiln_quant
