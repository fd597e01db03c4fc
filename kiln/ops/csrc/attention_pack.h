// Packing a prefill's keys and values into the tile layouts of attention_prefill.h: 16
// keys at a time, K as [D/2][16][2] (one (d, d+1) pair of the 16 keys per 64-byte row)
// and V as [8 key pairs][D][2]. Included by attention_prefill.h only.
//
// Every layer of a prefill packs its whole context again, so this runs once per key and
// layer: element by element it took 0.2 ms of a 4 ms SmolLM2 layer at 2,000 tokens (Xeon,
// amx). AVX512 builds transpose in registers (K: 16 x 16 32-bit pairs; V: two keys'
// rows interleaved by widening); the others, and shapes the vectors do not divide, copy
// element by element.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace kiln_prefill {

#ifdef __AVX512F__
inline __m256i load256(const uint16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// r[c] = row c of a 16 x 16 matrix of 32-bit elements -> r[j] = its column j.
inline void transpose16x16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: (r_i, r_i+1) pairs of columns
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + k]: rows i .. i + 3 of columns k + 4 lane
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // gather the four row groups' lanes
    const __m512i v = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
    const __m512i w = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
    const __m512i x = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    const __m512i y = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
    r[k] = _mm512_shuffle_i32x4(v, x, 0x88);
    r[k + 8] = _mm512_shuffle_i32x4(v, x, 0xdd);
    r[k + 4] = _mm512_shuffle_i32x4(w, y, 0x88);
    r[k + 12] = _mm512_shuffle_i32x4(w, y, 0xdd);
  }
}
#endif

// kt[d2][c] = the (2 d2, 2 d2 + 1) pair of key c (krow[c]: D bf16).
inline void pack_keys(const uint16_t* const* krow, int64_t D, uint16_t* kt) {
  int64_t d2 = 0;
#ifdef __AVX512F__
  for (; d2 + 16 <= D / 2; d2 += 16) {
    __m512i r[16];
    for (int c = 0; c < 16; ++c) r[c] = _mm512_loadu_si512(krow[c] + 2 * d2);
    transpose16x16(r);
    for (int j = 0; j < 16; ++j) _mm512_storeu_si512(kt + (d2 + j) * 32, r[j]);
  }
#endif
  auto* kt32 = reinterpret_cast<uint32_t*>(kt);
  for (; d2 < D / 2; ++d2)
    for (int c = 0; c < 16; ++c) std::memcpy(kt32 + d2 * 16 + c, krow[c] + 2 * d2, 4);
}

// vt[j][d] = (key 2 j's d, key 2 j + 1's d) for the 8 pairs of 16 keys (vrow[c]: D bf16).
inline void pack_values(const uint16_t* const* vrow, int64_t D, uint16_t* vt) {
  for (int j = 0; j < 8; ++j) {
    const uint16_t* a = vrow[2 * j];
    const uint16_t* b = vrow[2 * j + 1];
    uint16_t* out = vt + j * D * 2;
    int64_t d = 0;
#ifdef __AVX512F__
    for (; d + 16 <= D; d += 16) {  // widened, b's element in each 32-bit lane's high half
      const __m512i lo = _mm512_cvtepu16_epi32(load256(a + d));
      const __m512i hi = _mm512_cvtepu16_epi32(load256(b + d));
      _mm512_storeu_si512(out + 2 * d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
#endif
    for (; d < D; ++d) {
      out[2 * d] = a[d];
      out[2 * d + 1] = b[d];
    }
  }
}

}  // namespace kiln_prefill
