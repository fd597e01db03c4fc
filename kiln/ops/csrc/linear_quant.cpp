// kiln_cpu::linear_quant — y = x @ dequant(w).T (+ b) over weights kept quantized.
//
// Why it exists: decode-sized linears are memory-bound, so a weight that takes fewer
// bytes is read faster; the weight is dequantized inside the kernel, in registers, and
// never materialised per call. Formats (kiln/quantization/packing.py packs them once at
// load; N % 16 == 0, K % 32 == 0; nb = 16-column block, kc = 32-deep K chunk):
//   kInt8     int8 codes, one fp32 scale per output column (weight-only int8):
//               codes int8 [N/16, K/32, 32, 16]: codes[nb, kc, kk, c] = q[16nb + c, 32kc + kk]
//               scales fp32 [N];                  w = q * s
//   kQ8       the same codes, one fp16 scale per column and chunk (GGUF Q8_0):
//               scales fp16 [N/16, K/32, 16];     w = q * d
//   kQ4       4-bit codes, fp16 scale and offset per column and chunk (GGUF Q4_1, Q4_0):
//               codes uint8 [N/16, K/32, 16, 16]: byte (j, c) = q[., 32kc + j]
//                                                  | q[., 32kc + j + 16] << 4
//               scales, mins fp16 [N/16, K/32, 16]; w = q * d + m
// x is fp32 or bf16 (widened to fp32 once per call); the output has x's dtype and is
// rounded once, after the bias. Accumulation is fp32.
//
// Two kernels, picked by row count (`panel_from`, from the tuning table):
//   * direct (few rows): kQuantRows x kQuantBlocks register tiles; per chunk the integer
//     codes meet x in fp32 FMAs, then the chunk's sum is scaled (and the offset term
//     m * sum(x over the chunk) added) once, so dequantizing costs one op per 16 codes;
//   * panel (many rows): each thread dequantizes one 16-column block, whole K, into an
//     fp32 scratch panel (L2-resident, per thread: no per-layer copy) once per block of x
//     rows that fits L2 beside it, and runs a kQuantPanelRows x 16 tile over it.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <memory>

#include "simd.h"

namespace {

using kiln_isa::V16;

enum Fmt : int64_t { kInt8 = 0, kQ8 = 1, kQ4 = 2 };

struct QArgs {
  const float* xf;     // [M, K]
  const float* xsum;   // [M, K/32], kQ4 only: each chunk's sum of x
  const void* codes;
  const float* scale32;     // kInt8
  const uint16_t* scale16;  // kQ8, kQ4
  const uint16_t* min16;    // kQ4
  const float* bias;        // fp32 [N] or null
  void* y;
  bool y_bf16;
  int64_t M, K, N;
};

inline void store_out(const QArgs& a, int64_t row, int64_t col, V16 v) {
  if (a.y_bf16)
    kiln_isa::store_bf16(static_cast<c10::BFloat16*>(a.y) + row * a.N + col, v);
  else
    kiln_isa::storeu(static_cast<float*>(a.y) + row * a.N + col, v);
}

inline V16 finish(const QArgs& a, V16 acc, int64_t col) {
  return a.bias == nullptr ? acc : kiln_isa::add(acc, kiln_isa::loadu(a.bias + col));
}

// Each block's codes stream from memory in their own run of chunks; the hardware
// prefetcher does not follow that many streams, so each loop asks for the line kAhead
// chunks ahead in every block (measured: 3.8 -> 2.x ms of quantized linears per SmolLM2
// decode step).
constexpr int64_t kAhead = 4;

template <int NR, class T>
inline void prefetch_ahead(const T* const* c, int64_t at, int64_t chunk_bytes) {
  for (int j = 0; j < NR; ++j)
    _mm_prefetch(reinterpret_cast<const char*>(c[j]) + at + kAhead * chunk_bytes, _MM_HINT_T0);
}

// Rows m0..m0+MR against column blocks nb..nb+NR. Two sets of chunk sums (even and odd
// k for int8 codes, low and high nibbles for Q4) double the independent FMA chains: with
// one set a single row is bound by FMA latency, not by loads or throughput.
template <int F, int MR, int NR>
void direct(const QArgs& a, int64_t m0, int64_t nb) {
  const int64_t chunks = a.K / 32;
  const float* x[MR];
  for (int m = 0; m < MR; ++m) x[m] = a.xf + (m0 + m) * a.K;
  V16 acc[MR][NR], g[MR][NR], h[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = g[m][j] = h[m][j] = kiln_isa::zero();
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const int64_t k0 = kc * 32;
    if constexpr (F == kQ4) {
      const uint8_t* c[NR];
      for (int j = 0; j < NR; ++j)
        c[j] = static_cast<const uint8_t*>(a.codes) + ((nb + j) * chunks + kc) * 256;
      for (int jj = 0; jj < 16; ++jj) {
        V16 lo[NR], hi[NR];
        if (jj % 4 == 0) prefetch_ahead<NR>(c, jj * 16, 256);
        for (int j = 0; j < NR; ++j) kiln_isa::load_u4(c[j] + jj * 16, lo[j], hi[j]);
        for (int m = 0; m < MR; ++m) {
          const V16 xa = kiln_isa::set1(x[m][k0 + jj]), xb = kiln_isa::set1(x[m][k0 + jj + 16]);
          for (int j = 0; j < NR; ++j) {
            g[m][j] = kiln_isa::fmadd(xa, lo[j], g[m][j]);
            h[m][j] = kiln_isa::fmadd(xb, hi[j], h[m][j]);
          }
        }
      }
    } else {
      const int8_t* c[NR];
      for (int j = 0; j < NR; ++j)
        c[j] = static_cast<const int8_t*>(a.codes) + ((nb + j) * chunks + kc) * 512;
      for (int kk = 0; kk < 32; kk += 2) {
        V16 w0[NR], w1[NR];
        if (kk % 4 == 0) prefetch_ahead<NR>(c, kk * 16, 512);
        for (int j = 0; j < NR; ++j) {
          w0[j] = kiln_isa::load_i8(c[j] + kk * 16);
          w1[j] = kiln_isa::load_i8(c[j] + (kk + 1) * 16);
        }
        for (int m = 0; m < MR; ++m) {
          const V16 xa = kiln_isa::set1(x[m][k0 + kk]), xb = kiln_isa::set1(x[m][k0 + kk + 1]);
          for (int j = 0; j < NR; ++j) {
            g[m][j] = kiln_isa::fmadd(xa, w0[j], g[m][j]);
            h[m][j] = kiln_isa::fmadd(xb, w1[j], h[m][j]);
          }
        }
      }
    }
    if constexpr (F != kInt8) {  // fold the chunk: acc += d * (g + h) (+ m * sum(x))
      for (int j = 0; j < NR; ++j) {
        const int64_t off = ((nb + j) * chunks + kc) * 16;
        _mm_prefetch(reinterpret_cast<const char*>(a.scale16 + off + kAhead * 16), _MM_HINT_T0);
        if constexpr (F == kQ4)
          _mm_prefetch(reinterpret_cast<const char*>(a.min16 + off + kAhead * 16), _MM_HINT_T0);
        const V16 d = kiln_isa::load_f16(a.scale16 + off);
        const V16 mn = F == kQ4 ? kiln_isa::load_f16(a.min16 + off) : kiln_isa::zero();
        for (int m = 0; m < MR; ++m) {
          acc[m][j] = kiln_isa::fmadd(kiln_isa::add(g[m][j], h[m][j]), d, acc[m][j]);
          if constexpr (F == kQ4)
            acc[m][j] = kiln_isa::fmadd(kiln_isa::set1(a.xsum[(m0 + m) * chunks + kc]), mn,
                                        acc[m][j]);
          g[m][j] = h[m][j] = kiln_isa::zero();
        }
      }
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t col = (nb + j) * 16;
    for (int m = 0; m < MR; ++m) {
      V16 v = acc[m][j];
      if constexpr (F == kInt8)
        v = kiln_isa::mul(kiln_isa::add(g[m][j], h[m][j]), kiln_isa::loadu(a.scale32 + col));
      store_out(a, m0 + m, col, finish(a, v, col));
    }
  }
}

using DirectFn = void (*)(const QArgs&, int64_t, int64_t);

template <int F, int MR>
DirectFn direct_for_blocks(int nr) {
  switch (nr) {
    case 4: if constexpr (kiln_isa::kQuantBlocks1 >= 4) return direct<F, MR, 4>;
            [[fallthrough]];
    case 3: if constexpr (kiln_isa::kQuantBlocks1 >= 3) return direct<F, MR, 3>;
            [[fallthrough]];
    case 2: if constexpr (kiln_isa::kQuantBlocks1 >= 2) return direct<F, MR, 2>;
            [[fallthrough]];
    default: return direct<F, MR, 1>;
  }
}

template <int F>
DirectFn direct_fn(int mr, int nr) {
  static_assert(kiln_isa::kQuantRows <= 4 && kiln_isa::kQuantBlocks1 <= 4,
                "direct_fn covers tiles of up to 4 rows x 4 blocks");
  switch (mr) {
    case 4: if constexpr (kiln_isa::kQuantRows >= 4) return direct_for_blocks<F, 4>(nr);
            [[fallthrough]];
    case 3: if constexpr (kiln_isa::kQuantRows >= 3) return direct_for_blocks<F, 3>(nr);
            [[fallthrough]];
    case 2: return direct_for_blocks<F, 2>(nr);
    default: return direct_for_blocks<F, 1>(nr);
  }
}

template <int F>
void direct_gemm(const QArgs& a) {
  constexpr int MR = kiln_isa::kQuantRows;
  // One row reads each weight once: the widest tile (kQuantBlocks1) keeps more loads in
  // flight; several rows share each weight load over kQuantBlocks blocks.
  const int NR = a.M == 1 ? kiln_isa::kQuantBlocks1 : kiln_isa::kQuantBlocks;
  // Threads split the column blocks: each weight byte is read by one thread only.
  at::parallel_for(0, a.N / 16, NR, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; nb += NR) {
      const int nr = static_cast<int>(std::min<int64_t>(NR, end - nb));
      for (int64_t m = 0; m < a.M; m += MR)
        direct_fn<F>(static_cast<int>(std::min<int64_t>(MR, a.M - m)), nr)(a, m, nb);
    }
  });
}

// Column block nb, whole K, dequantized into panel[K][16].
template <int F>
void dequant_block(const QArgs& a, int64_t nb, float* panel) {
  const int64_t chunks = a.K / 32;
  const V16 s = F == kInt8 ? kiln_isa::loadu(a.scale32 + nb * 16) : kiln_isa::zero();
  for (int64_t kc = 0; kc < chunks; ++kc) {
    float* p = panel + kc * 32 * 16;
    const int64_t off = (nb * chunks + kc) * 16;
    if constexpr (F == kQ4) {
      const uint8_t* c = static_cast<const uint8_t*>(a.codes) + (nb * chunks + kc) * 256;
      const V16 d = kiln_isa::load_f16(a.scale16 + off), mn = kiln_isa::load_f16(a.min16 + off);
      for (int jj = 0; jj < 16; ++jj) {
        V16 lo, hi;
        kiln_isa::load_u4(c + jj * 16, lo, hi);
        kiln_isa::storeu(p + jj * 16, kiln_isa::fmadd(lo, d, mn));
        kiln_isa::storeu(p + (jj + 16) * 16, kiln_isa::fmadd(hi, d, mn));
      }
    } else {
      const int8_t* c = static_cast<const int8_t*>(a.codes) + (nb * chunks + kc) * 512;
      const V16 d = F == kQ8 ? kiln_isa::load_f16(a.scale16 + off) : s;
      for (int kk = 0; kk < 32; ++kk)
        kiln_isa::storeu(p + kk * 16, kiln_isa::mul(kiln_isa::load_i8(c + kk * 16), d));
    }
  }
}

template <int R>
void panel_rows(const QArgs& a, const float* panel, int64_t m0, int64_t nb) {
  const float* x[R];
  V16 acc[R];
  for (int m = 0; m < R; ++m) {
    x[m] = a.xf + (m0 + m) * a.K;
    acc[m] = kiln_isa::zero();
  }
  for (int64_t k = 0; k < a.K; ++k) {
    const V16 w = kiln_isa::loadu(panel + k * 16);
    for (int m = 0; m < R; ++m) acc[m] = kiln_isa::fmadd(kiln_isa::set1(x[m][k]), w, acc[m]);
  }
  for (int m = 0; m < R; ++m) store_out(a, m0 + m, nb * 16, finish(a, acc[m], nb * 16));
}

using PanelFn = void (*)(const QArgs&, const float*, int64_t, int64_t);
template <int... R>
constexpr PanelFn kPanelTable[] = {panel_rows<R>...};
constexpr const PanelFn* kPanel = kPanelTable<1, 2, 3, 4, 5, 6, 7, 8>;  // kPanel[rows - 1]
static_assert(kiln_isa::kQuantPanelRows <= 8, "kPanel covers tiles of 1 to 8 rows");

constexpr int64_t kPanelXBytes = 256 * 1024;  // the x rows one panel pass reuses

template <int F>
void panel_gemm(const QArgs& a) {
  constexpr int64_t R = kiln_isa::kQuantPanelRows;
  // Row blocks of equal size (whole tiles) whose x fits kPanelXBytes.
  const int64_t fit = std::max<int64_t>(R, kPanelXBytes / (a.K * 4) / R * R);
  const int64_t blocks = (a.M + fit - 1) / fit;
  const int64_t block = ((a.M + blocks - 1) / blocks + R - 1) / R * R;
  at::parallel_for(0, a.N / 16, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> panel(new float[a.K * 16]);
    for (int64_t mb = 0; mb < a.M; mb += block) {
      const int64_t me = std::min(a.M, mb + block);
      for (int64_t nb = begin; nb < end; ++nb) {
        dequant_block<F>(a, nb, panel.get());
        for (int64_t m = mb; m < me; m += R)
          kPanel[std::min<int64_t>(R, me - m) - 1](a, panel.get(), m, nb);
      }
    }
  });
}

#ifdef __AVX512BF16__
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
      for (int r = 0; r < 8; ++r) {
        V16 lo0, hi0, lo1, hi1;
        kiln_isa::load_u4(c + 2 * r * 16, lo0, hi0);
        kiln_isa::load_u4(c + (2 * r + 1) * 16, lo1, hi1);
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

// The direct Q4 kernel for bf16 x (the default activations): four uops turn 16 bytes of
// codes into 16 bf16 pairs and one `vdpbf16ps` per row multiplies 32 of them, where the
// fp32 path spends five uops and two FMAs per row (measured: the one-row Q4 kernel is
// bound by those uops, not by memory). Each code q becomes the bf16 of 128 + q, whose bit
// pattern is 0x4300 | q (exact: 7 mantissa bits): the chunk's dot product then carries
// 128 * sum(x) too, which the fold subtracts with the offset term:
//   acc += d * dot + (m - 128 d) * sum(x).
inline __m512bh q4_pairs(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i t = _mm512_slli_epi32(b, 12);  // code k + 16 (high nibble) -> bits 16..19
  const __m512i codes = _mm512_ternarylogic_epi32(b, t, _mm512_set1_epi32(0x000F000F), 0xA8);
  return (__m512bh)_mm512_or_si512(codes, _mm512_set1_epi32(0x43004300));
}

template <int MR, int NR>
void q4_bf16_direct(const QArgs& a, const uint32_t* xq, int64_t m0, int64_t nb) {
  const int64_t chunks = a.K / 32;
  V16 acc[MR][NR], g[MR][NR], h[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = g[m][j] = h[m][j] = kiln_isa::zero();
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const uint8_t* c[NR];
    for (int j = 0; j < NR; ++j)
      c[j] = static_cast<const uint8_t*>(a.codes) + ((nb + j) * chunks + kc) * 256;
    for (int jj = 0; jj < 16; jj += 2) {
      if (jj % 4 == 0) prefetch_ahead<NR>(c, jj * 16, 256);
      __m512bh w0[NR], w1[NR];
      for (int j = 0; j < NR; ++j) {
        w0[j] = q4_pairs(c[j] + jj * 16);
        w1[j] = q4_pairs(c[j] + (jj + 1) * 16);
      }
      for (int m = 0; m < MR; ++m) {
        const uint32_t* xr = xq + ((m0 + m) * chunks + kc) * 16 + jj;
        const __m512bh xa = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[0]));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[1]));
        for (int j = 0; j < NR; ++j) {
          g[m][j] = _mm512_dpbf16_ps(g[m][j], xa, w0[j]);
          h[m][j] = _mm512_dpbf16_ps(h[m][j], xb, w1[j]);
        }
      }
    }
    for (int j = 0; j < NR; ++j) {
      const int64_t off = ((nb + j) * chunks + kc) * 16;
      _mm_prefetch(reinterpret_cast<const char*>(a.scale16 + off + kAhead * 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(a.min16 + off + kAhead * 16), _MM_HINT_T0);
      const V16 d = kiln_isa::load_f16(a.scale16 + off);
      const V16 mn = kiln_isa::fnmadd(kiln_isa::set1(128.f), d, kiln_isa::load_f16(a.min16 + off));
      for (int m = 0; m < MR; ++m) {
        acc[m][j] = kiln_isa::fmadd(kiln_isa::add(g[m][j], h[m][j]), d, acc[m][j]);
        acc[m][j] = kiln_isa::fmadd(kiln_isa::set1(a.xsum[(m0 + m) * chunks + kc]), mn, acc[m][j]);
        g[m][j] = h[m][j] = kiln_isa::zero();
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int m = 0; m < MR; ++m)
      store_out(a, m0 + m, (nb + j) * 16, finish(a, acc[m][j], (nb + j) * 16));
}

using Q4DirectFn = void (*)(const QArgs&, const uint32_t*, int64_t, int64_t);
template <int MR>
constexpr Q4DirectFn kQ4Row[4] = {q4_bf16_direct<MR, 1>, q4_bf16_direct<MR, 2>,
                                  q4_bf16_direct<MR, 3>, q4_bf16_direct<MR, 4>};
constexpr const Q4DirectFn* kQ4Direct[4] = {kQ4Row<1>, kQ4Row<2>, kQ4Row<3>, kQ4Row<4>};

void q4_bf16_gemm(const QArgs& a, const uint16_t* x) {
  const int64_t chunks = a.K / 32;
  // x as the bf16 pairs the kernel broadcasts: (x[32kc + jj], x[32kc + jj + 16]).
  std::unique_ptr<uint32_t[]> xq(new uint32_t[a.M * chunks * 16]);
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t kc = 0; kc < chunks; ++kc)
      for (int jj = 0; jj < 16; ++jj) {
        const uint16_t* xr = x + m * a.K + kc * 32 + jj;
        xq[(m * chunks + kc) * 16 + jj] = xr[0] | (static_cast<uint32_t>(xr[16]) << 16);
      }
  constexpr int MR = 4;
  const int NR = a.M == 1 ? 4 : 2;  // as direct_gemm: one row keeps more loads in flight
  at::parallel_for(0, a.N / 16, NR, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; nb += NR) {
      const int64_t nr = std::min<int64_t>(NR, end - nb);
      for (int64_t m = 0; m < a.M; m += MR)
        kQ4Direct[std::min<int64_t>(MR, a.M - m) - 1][nr - 1](a, xq.get(), m, nb);
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
#endif

template <int F>
void run(const QArgs& a, bool panel, const at::Tensor& x) {
#ifdef __AVX512BF16__
  if (x.scalar_type() == at::kBFloat16) {
    const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
    if (panel) {
      bf16_panel_gemm<F>(a, xb);
      return;
    }
    if constexpr (F == kQ4) {
      q4_bf16_gemm(a, xb);
      return;
    }
  }
#endif
  if (panel) panel_gemm<F>(a);
  else direct_gemm<F>(a);
}

}  // namespace

at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins,
                        const c10::optional<at::Tensor>& bias, int64_t fmt,
                        int64_t panel_from) {
  TORCH_CHECK(fmt == kInt8 || fmt == kQ8 || fmt == kQ4, "linear_quant: unknown format ", fmt);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "linear_quant: x must be fp32 or bf16 [M, K]");
  const int64_t chunk_bytes = fmt == kQ4 ? 256 : 512;
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == chunk_bytes && codes.is_contiguous() &&
                  codes.element_size() == 1,
              "linear_quant: codes must be [N/16, K/32, ", chunk_bytes, "] bytes");
  const int64_t N = codes.size(0) * 16, K = codes.size(1) * 32, M = x.size(0);
  TORCH_CHECK(x.size(1) == K, "linear_quant: x has ", x.size(1), " columns, weight ", K);
  if (fmt == kInt8) {
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == N &&
                scales.is_contiguous(), "linear_quant: int8 scales must be fp32 [N]");
  } else {
    TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.numel() == N * K / 32 &&
                scales.is_contiguous(), "linear_quant: scales must be fp16 [N/16, K/32, 16]");
  }
  const bool has_min = mins.has_value() && mins->defined();
  TORCH_CHECK(fmt != kQ4 || (has_min && mins->scalar_type() == at::kHalf &&
                             mins->numel() == N * K / 32 && mins->is_contiguous()),
              "linear_quant: Q4 needs fp16 mins [N/16, K/32, 16]");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  // x widened and the Q4 chunk sums taken here, not through ATen ops: at decode sizes
  // their dispatch cost more than the loops (measured 0.2 ms per SmolLM2 step).
  const auto xc = x.contiguous();
  std::unique_ptr<float[]> xwide, xsum;
  const float* xf = nullptr;
  if (x.scalar_type() == at::kFloat) {
    xf = xc.data_ptr<float>();
  } else {
    xwide.reset(new float[M * K]);  // K % 32 == 0: whole V16s
    const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr());
    for (int64_t i = 0; i < M * K; i += 16) kiln_isa::storeu(xwide.get() + i, kiln_isa::load_bf16(xb + i));
    xf = xwide.get();
  }
  if (fmt == kQ4) {
    xsum.reset(new float[M * K / 32]);
    for (int64_t i = 0; i < M * K / 32; ++i)
      xsum[i] = kiln_isa::reduce_add(kiln_isa::add(kiln_isa::loadu(xf + i * 32),
                                                   kiln_isa::loadu(xf + i * 32 + 16)));
  }
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  QArgs a{xf,
          xsum.get(),
          codes.data_ptr(),
          fmt == kInt8 ? scales.data_ptr<float>() : nullptr,
          fmt == kInt8 ? nullptr : reinterpret_cast<const uint16_t*>(scales.data_ptr()),
          fmt == kQ4 ? reinterpret_cast<const uint16_t*>(mins->data_ptr()) : nullptr,
          b.defined() ? b.data_ptr<float>() : nullptr,
          y.data_ptr(), x.scalar_type() == at::kBFloat16, M, K, N};
  const bool panel = panel_from > 0 && M >= panel_from;
  switch (fmt) {
    case kInt8: run<kInt8>(a, panel, xc); break;
    case kQ8: run<kQ8>(a, panel, xc); break;
    default: run<kQ4>(a, panel, xc); break;
  }
  return y;
}

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("linear_quant(Tensor x, Tensor codes, Tensor scales, Tensor? mins, Tensor? bias, "
        "int fmt, int panel_from) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("linear_quant", &linear_quant);
}
