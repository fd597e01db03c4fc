// AMX state shared by the kernels that use tiles (linear_bf16.cpp, linear_quant_bf16.cpp,
// attention_prefill.h).
//
// Tiles need the kernel's permission per process (torch.cpu._init_amx, from Python), so
// the kernels use them only once `set_amx` has switched them on, and only from
// `min_rows` rows on: below that the register-tiled AVX512-BF16 kernel is faster (a
// 16-row tile computes 16 rows whatever the batch holds, and its loads do not overlap as
// the register kernel's do). Builds without AMX compile none of this.
//
// KILN_AMX is the switch the kernels test: defined in AMX builds (__AMX_TILE__) and in
// the emulated build for tests (KILN_AMX_EMULATE: amx_emulated.h, tiles in software on
// an AVX512-BF16 host). Every file that tests it includes this header first.
#pragma once
#if defined(__AMX_TILE__) || defined(KILN_AMX_EMULATE)
#define KILN_AMX 1
#endif
#ifdef KILN_AMX
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

#include "amx_config.h"
#include "simd.h"
#ifndef __AMX_TILE__
#include "amx_emulated.h"
#endif

namespace kiln_amx {

struct State {
  bool enabled = false;
  int64_t min_rows = 1;  // the linear's row count from which tiles run
};

// One instance per library (an inline function's static is shared across its units).
inline State& state() {
  static State s;
  return s;
}

// All eight tiles at 16 rows x 64 bytes (the attention kernel pads its rows to 16).
inline void configure_full() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// The GEMMs' tiles (linear_bf16.cpp, linear_quant_bf16.cpp): 0-3 accumulators C[a][b]
// (a: a block of rows0 / rows1 x rows, b: a 16-column weight block), 4-5 x tiles, 6-7
// weight tiles.
inline void configure_gemm(int64_t rows0, int64_t rows1) {
  TileConfig cfg;
  const int64_t rows[2] = {rows0, rows1};
  for (int a = 0; a < 2; ++a) {
    for (int b = 0; b < 2; ++b) {
      cfg.rows[a * 2 + b] = static_cast<uint8_t>(std::max<int64_t>(rows[a], 1));
      cfg.colsb[a * 2 + b] = 64;
    }
    cfg.rows[4 + a] = static_cast<uint8_t>(std::max<int64_t>(rows[a], 1));
    cfg.colsb[4 + a] = 64;
    cfg.rows[6 + a] = 16;
    cfg.colsb[6 + a] = 64;
  }
  _tile_loadconfig(&cfg);
}

// The GEMMs' row blocks: the next up to 32 rows (rows0 + rows1) with `left` rows to go, the
// tiles reconfigured only when that shape changes (a pass's last, partial block).
struct GemmRows {
  int64_t rows0 = 0, rows1 = 0;
  int64_t configured = -1;
  void next(int64_t left) {
    rows0 = std::min<int64_t>(16, left);
    rows1 = std::min<int64_t>(16, std::max<int64_t>(0, left - 16));
    if (configured != rows0 * 32 + rows1) {
      configure_gemm(rows0, rows1);
      configured = rows0 * 32 + rows1;
    }
  }
};

// One step of a 2 x 2 block: C[a][b] += A_a B_b with A_0 at a0, A_1 at a1 (when `second`;
// row stride as bytes) and B_0 at b0, B_1 at b1 (when `pair`; row stride bs bytes), into
// accumulator tiles 0-3 (C[a][b] is tile 2a + b). The GEMMs' and the prefill attention's
// inner step (configure_gemm / configure_full set the shapes).
inline void step_2x2(const void* a0, const void* a1, int64_t as, const void* b0,
                     const void* b1, int64_t bs, bool second, bool pair) {
  _tile_loadd(4, a0, as);
  _tile_loadd(6, b0, bs);
  _tile_dpbf16ps(0, 4, 6);
  if (pair) { _tile_loadd(7, b1, bs); _tile_dpbf16ps(1, 4, 7); }
  if (second) {
    _tile_loadd(5, a1, as);
    _tile_dpbf16ps(2, 5, 6);
    if (pair) _tile_dpbf16ps(3, 5, 7);
  }
}

// C = up to 32 x rows (x0: a tile of 16 rows, x1: the next when `second`; row stride xs
// bytes) times one or two (`pair`) packed 16-column weight blocks w0, w1 (one 1 KiB tile
// per 32-deep chunk), over `chunks` chunks, fp32, left in accumulator tiles 0-3 (tile
// 2a + b: row tile a x block b; store_tiles reads them out). `ahead` > 0 prefetches the
// weight tiles that many chunks ahead, for weights that stream from memory (1-4 rows:
// ~25% faster); for weights already in L2 the prefetches only take load slots (the packed
// linear at 512-2,000 rows ran 1.07-1.25x faster without them). `between(kc)` runs after
// chunk kc's products are issued (AmxPipeline's epilogue rows). configure_gemm comes first.
template <class Between>
inline void gemm_tile_run(const uint16_t* x0, const uint16_t* x1, int64_t xs,
                          const uint16_t* w0, const uint16_t* w1, bool second, bool pair,
                          int64_t chunks, int64_t ahead, Between between) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t kc = 0; kc < chunks; ++kc) {
    if (ahead > 0) {
      const char* ahead0 = reinterpret_cast<const char*>(w0 + (kc + ahead) * 512);
      const char* ahead1 = reinterpret_cast<const char*>(w1 + (kc + ahead) * 512);
      for (int line = 0; line < 1024; line += 64) {
        _mm_prefetch(ahead0 + line, _MM_HINT_T0);
        if (pair) _mm_prefetch(ahead1 + line, _MM_HINT_T0);
      }
    }
    step_2x2(x0 + kc * 32, x1 + kc * 32, xs, w0 + kc * 512, w1 + kc * 512, 64, second, pair);
    between(kc);
  }
}

// c[t] = accumulator tile t (0-3), 16 x 16 fp32 each.
inline void store_tiles(float (*c)[16][16]) {
  _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
}

// One 32-row x 2-block tile's place in y, and its fp32 results (the accumulator tiles).
// Its rows r in [0, rows0 + rows1) are row r % 16 of row tile r / 16 (rows1 > 0 only
// when rows0 = 16), row m0 + r of y.
struct AmxBlock {
  int64_t m0 = 0, rows0 = 0, rows1 = 0, nb = 0;
  bool pair = false;
  alignas(64) float c[4][16][16];
};

// A thread's tiles in order, software-pipelined: block i's products are issued with block
// i - 1's epilogue (vector work) a few rows after each 32-deep chunk, then block i's
// accumulators are stored. `Epilogue` is called as epilogue(block, r0, r1) for rows
// [r0, r1) of a finished block (linear_bf16_amx.h, linear_quant_bf16.cpp).
//   * Done in order (store, epilogue, next block), the core waited on every block's last
//     products before its epilogue and the tiles idled through it, a large share at
//     K = 576 (18 chunks a block).
//   * Run whole after a block's products were issued, the epilogue's ~500 instructions
//     filled the reorder buffer behind the tile products, and the next block's products
//     waited for them: at K = 576 the GEMMs ran 1.3x faster with no epilogue at all
//     (2-vCPU Xeon, amx). Spread over the chunks, each piece fits beside one chunk's
//     four products (64 cycles of tile work): SmolLM2's shapes at 2,000 rows ran
//     1.04-1.21x faster (SwiGLU's gate_up the most), with the same bits.
template <class Epilogue>
class AmxPipeline {
 public:
  explicit AmxPipeline(Epilogue epilogue) : epilogue_(epilogue) {}

  // Block (m0, nb) of rb's rows: gemm_tile_run's products with the pending block's
  // epilogue spread over the chunks, then this block's results stored.
  void run(const uint16_t* x0, const uint16_t* x1, int64_t xs, const uint16_t* w0,
           const uint16_t* w1, int64_t chunks, int64_t ahead, int64_t m0,
           const GemmRows& rb, int64_t nb, bool pair) {
    const AmxBlock& prev = blocks_[next_ ^ 1];
    const int64_t rows = pending_ ? prev.rows0 + prev.rows1 : 0;
    const int64_t step = (rows + chunks - 1) / chunks;
    int64_t done = 0;
    gemm_tile_run(x0, x1, xs, w0, w1, rb.rows1 > 0, pair, chunks, ahead, [&](int64_t) {
      if (done < rows) {
        const int64_t end = std::min(rows, done + step);
        epilogue_(prev, done, end);
        done = end;
      }
    });
    AmxBlock& cur = blocks_[next_];
    cur.m0 = m0, cur.rows0 = rb.rows0, cur.rows1 = rb.rows1, cur.nb = nb, cur.pair = pair;
    store_tiles(cur.c);
    pending_ = true;
    next_ ^= 1;
  }

  // The last block's epilogue; before the tiles are reconfigured or released.
  void flush() {
    const AmxBlock& prev = blocks_[next_ ^ 1];
    if (pending_) epilogue_(prev, 0, prev.rows0 + prev.rows1);
    pending_ = false;
  }

 private:
  Epilogue epilogue_;
  AmxBlock blocks_[2];
  int next_ = 0;
  bool pending_ = false;
};

// SwiGLU over a [gate | up] weight in a GEMM's epilogue (y [M, I], I = 16 * half): tile
// 2a holds the gate's block t.nb for row tile a, tile 2a + 1 the up projection's block
// t.nb + half. `scale` (int8 weights: one per column, applied to the products) or null.
// Each half is rounded to bf16 first, where the separate linear rounds its output, and
// silu_mul is kiln_cpu::silu_and_mul's: the same bits as the two steps
// (linear_bf16_amx.h, linear_quant_bf16.cpp).
struct SiluEpilogue {
  uint16_t* y;
  int64_t half;
  const float* scale = nullptr;

  __m512 rounded(const float* c, int64_t col) const {
    __m512 v = _mm512_load_ps(c);
    if (scale != nullptr) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale + col));
    return kiln_isa::round_bf16(v);
  }

  void operator()(const AmxBlock& t, int64_t r0, int64_t r1) const {
    const int64_t I = half * 16;
    for (int64_t r = r0; r < r1; ++r)
      kiln_isa::store_bf16(y + (t.m0 + r) * I + t.nb * 16,
                           kiln_isa::silu_mul(rounded(t.c[r / 16 * 2][r % 16], t.nb * 16),
                                              rounded(t.c[r / 16 * 2 + 1][r % 16],
                                                      (t.nb + half) * 16)));
  }
};

}  // namespace kiln_amx
#endif
