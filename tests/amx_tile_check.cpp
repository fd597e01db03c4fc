// The emulated tiles (kiln/ops/csrc/amx_emulated.h) bit for bit against Intel's
// description of TDPBF16PS written out plainly (`reference`) and, built with
// -DKILN_CHECK_HARDWARE on an AMX host, against the hardware's tiles: random tile shapes
// and data through tileloadd / tdpbf16ps / tilestored (tests/test_amx_emulated.py builds
// and runs it). Prints the first mismatches and exits 1 on any.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

#include "amx_config.h"

namespace {

using Config = kiln_amx::TileConfig;

// C (tile 0, M x N fp32) += A (tile 1, M x 2K bf16) B (tile 2, K x 2N bf16): the tiles are
// loaded at a row stride wider than a row, so a load must read only colsb bytes a row.
struct Case {
  int M, N, K;
  alignas(64) float c[16][32];
  alignas(64) uint16_t a[16][64];
  alignas(64) uint16_t b[16][64];
};

Config config(const Case& t) {
  Config cfg;
  cfg.rows[0] = t.M, cfg.colsb[0] = 4 * t.N;
  cfg.rows[1] = t.M, cfg.colsb[1] = 4 * t.K;
  cfg.rows[2] = t.K, cfg.colsb[2] = 4 * t.N;
  return cfg;
}

// The body both sides share, spelled once; the intrinsics' names mean the hardware's
// before amx_emulated.h is included and the emulation's after.
#define KILN_TILE_PRODUCT(t, out)                        \
  do {                                                   \
    const Config cfg = config(t);                        \
    _tile_loadconfig(&cfg);                              \
    _tile_loadd(0, (t).c, sizeof((t).c[0]));             \
    _tile_loadd(1, (t).a, sizeof((t).a[0]));             \
    _tile_loadd(2, (t).b, sizeof((t).b[0]));             \
    _tile_dpbf16ps(0, 1, 2);                             \
    _tile_stored(0, out, 64);                            \
    _tile_release();                                     \
  } while (0)

#ifdef KILN_CHECK_HARDWARE
void hardware(const Case& t, float (*out)[16]) { KILN_TILE_PRODUCT(t, out); }
#endif

}  // namespace

#include "amx_emulated.h"

namespace {

void emulated(const Case& t, float (*out)[16]) { KILN_TILE_PRODUCT(t, out); }

float fp32(uint16_t v) {
  const uint32_t bits = uint32_t{v} << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// for m: for k: for n: C[m][n] += A[m][2k] B[k][2n]; C[m][n] += A[m][2k+1] B[k][2n+1],
// in fp32 (the data here has no denormals, so DAZ and FTZ do not arise).
void reference(const Case& t, float (*out)[16]) {
  for (int m = 0; m < t.M; ++m) {
    float row[16];
    for (int n = 0; n < t.N; ++n) row[n] = t.c[m][n];
    for (int k = 0; k < t.K; ++k)
      for (int n = 0; n < t.N; ++n) {
        row[n] += fp32(t.a[m][2 * k]) * fp32(t.b[k][2 * n]);
        row[n] += fp32(t.a[m][2 * k + 1]) * fp32(t.b[k][2 * n + 1]);
      }
    for (int n = 0; n < t.N; ++n) out[m][n] = row[n];
  }
}

int compare(const char* what, const Case& t, float (*want)[16], float (*got)[16], int seen) {
  int bad = 0;
  for (int m = 0; m < t.M; ++m)
    for (int n = 0; n < t.N; ++n)
      if (std::memcmp(&want[m][n], &got[m][n], 4) != 0 && ++bad + seen <= 10)
        std::printf("%s M=%d N=%d K=%d [%d][%d]: %a, emulated %a\n", what, t.M, t.N, t.K, m,
                    n, want[m][n], got[m][n]);
  return bad;
}

uint16_t bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

int main() {
#ifdef KILN_CHECK_HARDWARE
  // Linux grants the tile data state per process on request (ARCH_REQ_XCOMP_PERM, 18).
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::puts("no permission for the AMX tile state");
    return 2;
  }
#endif
  std::mt19937 gen(46);
  std::uniform_real_distribution<float> value(-4.0f, 4.0f);
  std::uniform_int_distribution<int> size(1, 16);
  int mismatches = 0, cases = 0;
  for (; cases < 3000; ++cases) {
    static Case t;
    t.M = size(gen), t.N = size(gen), t.K = size(gen);
    for (auto& row : t.c)
      for (float& v : row) v = value(gen);
    for (auto& row : t.a)
      for (uint16_t& v : row) v = bf16(value(gen));
    for (auto& row : t.b)
      for (uint16_t& v : row) v = bf16(value(gen));
    alignas(64) float want[16][16], got[16][16];
    std::memset(got, 0xff, sizeof(got));
    emulated(t, got);
    reference(t, want);
    mismatches += compare("reference", t, want, got, mismatches);
#ifdef KILN_CHECK_HARDWARE
    hardware(t, want);
    mismatches += compare("hardware", t, want, got, mismatches);
#endif
  }
  std::printf("%d cases, %d mismatching values\n", cases, mismatches);
  return mismatches == 0 ? 0 : 1;
}
