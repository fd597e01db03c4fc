// AMX tiles in software, for tests on hosts without them (builds with -DKILN_AMX_EMULATE;
// amx.h includes this instead of the hardware's tiles).
//
// Why: the AMX paths (the tile GEMMs, the quantized panel's tiles, the prefill attention's
// products) run only on an AMX host, and most hosts kiln is developed and tested on have
// none; the emulated build runs the same kernel code, tile for tile, on any AVX512-BF16
// host, so its logic (tile shapes, row blocks, epilogues, the row split) is tested
// everywhere. It is a test double, slow (about 500 fused multiply-adds per tile product):
// never a speed path, and the real instructions run wherever the CPU has them.
//
// Semantics, from Intel's description of each instruction (palette 1):
//   * the configuration gives tile t rows[t] rows of colsb[t] bytes (at most 16 x 64);
//     using an unconfigured tile, or a product whose shapes do not chain, is a fault on
//     the hardware (#UD) and aborts here, naming the instruction;
//   * a load reads rows[t] x colsb[t] bytes and zeroes the rest of the tile;
//   * TDPBF16PS: C[m][n] += A[m][2k] * B[k][2n], then += A[m][2k + 1] * B[k][2n + 1], for
//     k over colsb(A) / 4 pairs, in fp32 (a bf16 product is exact in fp32, so a fused
//     multiply-add rounds it as the separate add would). bf16 denormal inputs read as
//     zero (DAZ), as on the hardware; denormal sums are not flushed (FTZ), so results
//     can differ from the hardware's in the last bits there.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "amx_config.h"

namespace kiln_amx_emu {

struct Tiles {
  bool configured = false;
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  alignas(64) uint8_t data[8][16][64] = {};
};

// Tiles are each core's architectural state: one set per thread.
inline Tiles& tiles() {
  static thread_local Tiles t;
  return t;
}

[[noreturn]] inline void fault(const char* what, int t) {
  std::fprintf(stderr, "kiln AMX emulation: %s (tile %d): the hardware would fault (#UD)\n",
               what, t);
  std::abort();
}

inline void check(const char* what, int t) {
  if (t < 0 || t > 7) fault(what, t);
  const Tiles& s = tiles();
  if (!s.configured || s.rows[t] == 0 || s.colsb[t] == 0) fault(what, t);
}

inline void loadconfig(const void* config) {
  kiln_amx::TileConfig c;
  std::memcpy(&c, config, sizeof(c));
  Tiles& s = tiles();
  s = Tiles{};
  if (c.palette == 0) return;  // tiles off, as after a release
  if (c.palette != 1) fault("tile config: palette other than 1", -1);
  for (int t = 0; t < 8; ++t) {
    const uint16_t colsb = c.colsb[t];
    const uint8_t rows = c.rows[t];
    if (rows > 16 || colsb > 64 || (rows == 0) != (colsb == 0))
      fault("tile config: a tile over 16 rows x 64 bytes, or half configured", t);
    s.rows[t] = rows;
    s.colsb[t] = colsb;
  }
  s.configured = true;
}

inline void release() { tiles() = Tiles{}; }

inline void zero(int t) {
  check("tilezero", t);
  std::memset(tiles().data[t], 0, sizeof(tiles().data[t]));
}

inline void load(int t, const void* base, int64_t stride) {
  check("tileloadd", t);
  Tiles& s = tiles();
  std::memset(s.data[t], 0, sizeof(s.data[t]));
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(s.data[t][r], static_cast<const uint8_t*>(base) + r * stride, s.colsb[t]);
}

inline void store(int t, void* base, int64_t stride) {
  check("tilestored", t);
  const Tiles& s = tiles();
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.data[t][r], s.colsb[t]);
}

inline float bf16_daz(uint16_t v) {
  const uint32_t bits = (v & 0x7f80) == 0 ? (v & 0x8000u) << 16 : uint32_t{v} << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline void dpbf16ps(int c, int a, int b) {
  check("tdpbf16ps dst", c), check("tdpbf16ps src1", a), check("tdpbf16ps src2", b);
  Tiles& s = tiles();
  const int M = s.rows[c], N = s.colsb[c] / 4, K = s.colsb[a] / 4;  // K: bf16 pairs
  if (s.rows[a] != M || s.colsb[b] != s.colsb[c] || s.rows[b] != K || c == a || c == b ||
      a == b || s.colsb[c] % 4 != 0 || s.colsb[a] % 4 != 0)
    fault("tdpbf16ps: shapes that do not chain, or a tile used twice", c);
  float even[16][16], odd[16][16];  // B's pairs as fp32: [k][n]
  for (int k = 0; k < K; ++k) {
    const auto* row = reinterpret_cast<const uint16_t*>(s.data[b][k]);
    for (int n = 0; n < N; ++n) {
      even[k][n] = bf16_daz(row[2 * n]);
      odd[k][n] = bf16_daz(row[2 * n + 1]);
    }
  }
  for (int m = 0; m < M; ++m) {
    auto* acc = reinterpret_cast<float*>(s.data[c][m]);
    const auto* x = reinterpret_cast<const uint16_t*>(s.data[a][m]);
    for (int k = 0; k < K; ++k) {
      const float x0 = bf16_daz(x[2 * k]), x1 = bf16_daz(x[2 * k + 1]);
      for (int n = 0; n < N; ++n) acc[n] += x0 * even[k][n];
      for (int n = 0; n < N; ++n) acc[n] += x1 * odd[k][n];
    }
  }
}

}  // namespace kiln_amx_emu

// The intrinsics' names, as the kernels call them (tile numbers are immediates there).
#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) ::kiln_amx_emu::loadconfig(config)
#define _tile_release() ::kiln_amx_emu::release()
#define _tile_zero(t) ::kiln_amx_emu::zero(t)
#define _tile_loadd(t, base, stride) ::kiln_amx_emu::load(t, base, stride)
#define _tile_stored(t, base, stride) ::kiln_amx_emu::store(t, base, stride)
#define _tile_dpbf16ps(c, a, b) ::kiln_amx_emu::dpbf16ps(c, a, b)
