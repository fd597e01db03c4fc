// The prefill kernel's two products on AMX tiles (attention_prefill.h; amx builds only).
//
// The packed layouts of attention_prefill.h are already AMX B tiles: a 16-key tile's K
// [D/2][16][2] gives, per 32-dim chunk, 16 rows of 64 bytes (one (d, d+1) pair of 16
// keys each), and V's key pairs [pair][D][2] give, per 16-dim block, rows of 64 bytes at
// a stride of one key pair (4 D bytes). So S = Q K^T and O += P V run as 2 x 2 blocks of
// 16 x 16 fp32 accumulator tiles (tmm0-3) over A tiles of queries or probabilities
// (tmm4-5) and B tiles of keys or values (tmm6-7): amx.h's step_2x2, as the linears.
// Shapes: rows % 16 == 0 (the item's rows are padded), keys % 32 == 0, D % 32 == 0.
// The caller configures the tiles (kiln_amx::configure_full) and releases them.
#pragma once
#include <cstdint>

#include "amx.h"
#ifdef KILN_AMX

namespace kiln_prefill_amx {

// s[r][j] = q_r . k_j for rows x keys; q rows contiguous (D bf16 each), s rows of
// s_stride floats; kp: the packed tiles of the first key.
inline void qk(const uint16_t* q, int64_t rows, const uint16_t* kp, int64_t D, int64_t keys,
               float* s, int64_t s_stride) {
  const int64_t qs = D * 2, ss = s_stride * 4;
  for (int64_t r = 0; r < rows; r += 32) {
    const bool two = r + 16 < rows;
    const uint16_t* q0 = q + r * D;
    const uint16_t* q1 = q0 + 16 * D;
    for (int64_t k = 0; k < keys; k += 32) {
      const uint16_t* k0 = kp + k * D;  // 16-key tiles of 16 D elements
      const uint16_t* k1 = k0 + 16 * D;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t d = 0; d < D; d += 32)
        kiln_amx::step_2x2(q0 + d, q1 + d, qs, k0 + 16 * d, k1 + 16 * d, 64, two, true);
      float* s0 = s + r * s_stride + k;
      _tile_stored(0, s0, ss);
      _tile_stored(1, s0 + 16, ss);
      if (two) {
        _tile_stored(2, s0 + 16 * s_stride, ss);
        _tile_stored(3, s0 + 16 * s_stride + 16, ss);
      }
    }
  }
}

// o[r] += sum_j p_r[j] v_j for rows x keys; p rows of p_stride bf16, o rows of D floats;
// vp: the packed pairs of the first key.
inline void pv(const uint16_t* p, int64_t p_stride, int64_t rows, const uint16_t* vp,
               int64_t D, int64_t keys, float* o) {
  const int64_t ps = p_stride * 2, os = D * 4, vs = D * 4;
  for (int64_t r = 0; r < rows; r += 32) {
    const bool two = r + 16 < rows;
    const uint16_t* p0 = p + r * p_stride;
    const uint16_t* p1 = p0 + 16 * p_stride;
    for (int64_t b = 0; b < D; b += 32) {  // two 16-dim blocks
      float* o0 = o + r * D + b;
      float* o1 = o0 + 16 * D;
      _tile_loadd(0, o0, os);
      _tile_loadd(1, o0 + 16, os);
      if (two) { _tile_loadd(2, o1, os); _tile_loadd(3, o1 + 16, os); }
      for (int64_t k = 0; k < keys; k += 32) {  // 16 key pairs per B tile
        const uint16_t* v = vp + k * D + 2 * b;
        kiln_amx::step_2x2(p0 + k, p1 + k, ps, v, v + 32, vs, two, true);
      }
      _tile_stored(0, o0, os);
      _tile_stored(1, o0 + 16, os);
      if (two) { _tile_stored(2, o1, os); _tile_stored(3, o1 + 16, os); }
    }
  }
}

}  // namespace kiln_prefill_amx
#endif
