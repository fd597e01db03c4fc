// The prefill kernel of kiln_cpu::unified_attention (paged_attention.cpp) for bf16 caches:
// one request's new query rows against its keys, read from the paged cache, in tiles with
// an online softmax (flash attention's scheme), causal blocks skipped. Included by
// paged_attention.cpp only.
//
// Why not SDPA: its CPU flash kernel needs the keys gathered out of the paged blocks and,
// after a prefix hit or for a chunk, an explicit mask over every block; and even a whole
// prompt with its own causal flag ran at about 110 GFLOP/s on Zen 4 (2,000 tokens,
// SmolLM2's 9/3 heads of 64) where a bf16 GEMM runs at about 400.
//
// Scheme, per request:
//  1. Pack (in parallel over KV head x 16-key tile): K into tiles of 16 keys x (d, d+1)
//     pairs, V into pairs of keys x 16-dim blocks: each 64-byte row is one `WRow` of the
//     packed linear's vocabulary (simd.h), so both products are the linear's register-tiled
//     pair dot products (`vdpbf16ps` on AVX512-BF16, fp32 FMAs on the widened halves
//     elsewhere). The packing reads each key once from its block; with a window only the
//     blocks the window reaches.
//  2. Attend (in parallel over items, one item = a KV head x a tile of query tokens, all
//     `group` query heads of that KV head together, so a packed key serves every one):
//     per chunk of kChunk keys, S = Q K^T (fp32 sums), scale and softcap, a running
//     reference (the max, or on native builds a value near it: softmax_row) and sum per
//     row, P = exp(S - ref) rounded to bf16 as SDPA rounds it for its PV product,
//     O = O * exp(old ref - new ref) + P V. Chunks start at the tile's first
//     visible key and end at its last query's position, so blocks above the diagonal
//     (and before a window) are never computed.
// Numerics: fp32 scores, references, sums and output accumulators, bf16 P (native builds; the
// others keep P in fp32). Results differ from SDPA's by rounding only.
// With AMX (and D % 32 == 0) both products run on tiles (attention_prefill_amx.h): the
// item's rows are padded to 16, its queries copied to one contiguous block (an A tile
// needs one stride), and each chunk's keys rounded up to 32 (one extra zero tile packed).
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "attention_decode.h"
#include "attention_pack.h"
#include "attention_prefill_amx.h"
#include "attention_softmax.h"
#include "simd.h"

namespace kiln_prefill {

namespace isa = kiln_isa;
using isa::V16;

// Keys per online-softmax step. AMX, 2,000 tokens: 512 keys 6.9 ms a layer, 256 8.3, 128 8.5.
constexpr int64_t kChunk = 512;
// Scratch row strides (floats of S, bf16 of P): a chunk plus one cache line, so that the
// item's rows do not all map to the same L1 sets (a power-of-two stride would).
constexpr int64_t kSStride = kChunk + 16, kPStride = kChunk + 32;
// Query vectors per item (tokens x group). Registers: 48 (Zen 4, avx512_bf16: 24-96
// timed). Tiles: 96, per layer with 9/3 heads of 64 on a 2-vCPU Xeon, interleaved, 48 ->
// 96 rows: 2,000 tokens 4.46-4.68 -> 4.24-4.32 ms, 512 tokens 420-459 -> 404-421 us
// (144 and 192 rows: 4.34-4.44 ms).
constexpr int64_t kItemRows = 48, kAmxItemRows = 96;
constexpr int RT = isa::kGemmRows;  // register tile: RT query rows x NB 16-wide blocks
constexpr int NB = isa::kGemmBlocks;

// One request's prefill: q_len new query rows at positions len - q_len .. len - 1.
struct Prompt {
  const uint16_t* q;  // [tokens, heads, D] rows of this request
  uint16_t* out;
  int64_t q_stride, q_head_stride, out_stride, out_head_stride;
  int64_t q_len, len;
  int64_t first;  // first packed key (block-aligned; > 0 only with a window)
  int64_t window;  // 0: none
  float scale, softcap;  // softcap 0: none
};

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

// The first key query position `pos` sees.
inline int64_t first_visible(const Prompt& p, int64_t pos) {
  return std::max(p.first, p.window > 0 ? pos - p.window + 1 : int64_t{0});
}

// Pack KV head h's keys first + 16 t .. + 15 (tile t): K as [tile][D/2][16][2], V as
// [key pair][D/16][16][2]; keys at or past len are zeros.
inline void pack_tile(const uint16_t* kc, const uint16_t* vc, const int32_t* blocks,
                      const Prompt& p, int64_t block_size, int64_t kv_heads, int64_t D,
                      int64_t h, int64_t t, uint16_t* kp, uint16_t* vp) {
  const uint16_t* krow[16];
  const uint16_t* vrow[16];
  alignas(64) static const uint16_t zeros[256 * 16] = {};
  for (int c = 0; c < 16; ++c) {
    const int64_t key = p.first + 16 * t + c;
    if (key < p.len) {
      const int64_t slot = int64_t{blocks[key / block_size]} * block_size + key % block_size;
      krow[c] = kc + (slot * kv_heads + h) * D;
      vrow[c] = vc + (slot * kv_heads + h) * D;
    } else {
      krow[c] = vrow[c] = zeros;
    }
  }
  pack_keys(krow, D, kp + 16 * t * D);
  pack_values(vrow, D, vp + 16 * t * D);  // 8 key pairs x D x 2
}

// The register tiles below unroll their accumulator loops (KILN_UNROLL, simd.h) and copy
// the row pointers first: otherwise each row's pointer was reloaded before each store.

// RT query vectors x N tiles of 16 keys: s[r][16 b + c] = q_r . k_c.
template <int N>
inline void qk_block(const uint16_t* const* q, const float* const* qf, const uint16_t* kp,
                     int64_t D, float* const* s, int64_t col) {
  const uint16_t* qr[RT];
  const float* qfr[RT];
  float* sr[RT];
  KILN_UNROLL
  for (int r = 0; r < RT; ++r) qr[r] = q[r], qfr[r] = qf[r], sr[r] = s[r] + col;
  V16 acc[RT][N];
  KILN_UNROLL
  for (int r = 0; r < RT; ++r)
    KILN_UNROLL
    for (int b = 0; b < N; ++b) acc[r][b] = isa::zero();
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    isa::WRow w[N];
    KILN_UNROLL
    for (int b = 0; b < N; ++b) w[b] = isa::load_wrow(kp + b * 16 * D + d2 * 32);
    KILN_UNROLL
    for (int r = 0; r < RT; ++r) {
      const isa::Pair x = isa::load_pair(qr[r], qfr[r], 2 * d2);
      KILN_UNROLL
      for (int b = 0; b < N; ++b) acc[r][b] = isa::dot(acc[r][b], x, w[b]);
    }
  }
  KILN_UNROLL
  for (int r = 0; r < RT; ++r)
    KILN_UNROLL
    for (int b = 0; b < N; ++b) isa::storeu(sr[r] + 16 * b, acc[r][b]);
}

// o_r[16 b ..] += sum over `pairs` key pairs of p_r[j] v_j, RT rows x N 16-dim blocks.
template <int N>
inline void pv_block(const uint16_t* const* p, const float* const* pf, const uint16_t* vp,
                     int64_t D, int64_t pairs, float* const* o) {
  const uint16_t* pr[RT];
  const float* pfr[RT];
  float* orow[RT];
  KILN_UNROLL
  for (int r = 0; r < RT; ++r) pr[r] = p[r], pfr[r] = pf[r], orow[r] = o[r];
  V16 acc[RT][N];
  KILN_UNROLL
  for (int r = 0; r < RT; ++r)
    KILN_UNROLL
    for (int b = 0; b < N; ++b) acc[r][b] = isa::loadu(orow[r] + 16 * b);
  for (int64_t j = 0; j < pairs; ++j) {
    isa::WRow w[N];
    KILN_UNROLL
    for (int b = 0; b < N; ++b) w[b] = isa::load_wrow(vp + j * 2 * D + b * 32);
    KILN_UNROLL
    for (int r = 0; r < RT; ++r) {
      const isa::Pair x = isa::load_pair(pr[r], pfr[r], 2 * j);
      KILN_UNROLL
      for (int b = 0; b < N; ++b) acc[r][b] = isa::dot(acc[r][b], x, w[b]);
    }
  }
  KILN_UNROLL
  for (int r = 0; r < RT; ++r)
    KILN_UNROLL
    for (int b = 0; b < N; ++b) isa::storeu(orow[r] + 16 * b, acc[r][b]);
}

// One thread's buffers, kept between calls (the op runs one layer at a time). Tiles load
// and store whole 64-byte rows of them, so they are line-aligned: from malloc (16 bytes)
// a process ran its 2,000-token layer at 4.6 or 6.2 ms depending on where its buffers
// fell; aligned, 4.3 every time (Xeon, amx, benchmarks/attention_rows.py).
struct Scratch {
  isa::AlignedVector<float> s, o, qf, m, l;  // line-aligned: tiles and vectors read them
  isa::AlignedVector<uint16_t> pb, qa;  // qa: the queries, contiguous (AMX)
  std::vector<const uint16_t*> qrow, prow;
  std::vector<const float*> qfrow, pfrow;
  std::vector<float*> srow, orow;
};

// Scores of rows x n16 keys from packed tile `kp` into scratch.s (row stride kSStride).
inline void scores(Scratch& sc, int64_t rows, const uint16_t* kp, int64_t D, int64_t n16) {
  for (int64_t r = 0; r < rows; r += RT) {
    int64_t t = 0;
    for (; t + NB <= n16 / 16; t += NB)
      qk_block<NB>(&sc.qrow[r], &sc.qfrow[r], kp + t * 16 * D, D, &sc.srow[r], 16 * t);
    for (; t < n16 / 16; ++t)
      qk_block<1>(&sc.qrow[r], &sc.qfrow[r], kp + t * 16 * D, D, &sc.srow[r], 16 * t);
  }
}

// O += P V over n16 keys from packed pairs `vp`.
inline void weighted_values(Scratch& sc, int64_t rows, const uint16_t* vp, int64_t D,
                            int64_t n16) {
  for (int64_t r = 0; r < rows; r += RT) {
    int64_t b = 0;
    for (; b + NB <= D / 16; b += NB) {
      float* o[RT];
      for (int i = 0; i < RT; ++i) o[i] = sc.orow[r + i] + 16 * b;
      pv_block<NB>(&sc.prow[r], &sc.pfrow[r], vp + 32 * b, D, n16 / 2, o);
    }
    for (; b < D / 16; ++b) {
      float* o[RT];
      for (int i = 0; i < RT; ++i) o[i] = sc.orow[r + i] + 16 * b;
      pv_block<1>(&sc.prow[r], &sc.pfrow[r], vp + 32 * b, D, n16 / 2, o);
    }
  }
}

// Point the scratch rows at item (h, tokens t0 .. t1 - 1): row r is token t0 + r / group,
// query head h * group + r % group; rows past the item's (up to a multiple of the register
// tile, or of 16 with `amx`) repeat its first (their results land in spare scratch rows
// and are dropped). With `amx` the queries are also copied into one block (sc.qa).
inline int64_t bind_rows(Scratch& sc, const Prompt& p, int64_t group, int64_t D, int64_t h,
                         int64_t t0, int64_t t1, bool amx) {
  const int64_t unit = amx ? 16 : RT;
  const int64_t rows = (t1 - t0) * group, padded = (rows + unit - 1) / unit * unit;
  sc.s.resize(padded * kSStride);
  sc.pb.resize(padded * kPStride);
  sc.o.assign(padded * D, 0.f);
  sc.m.assign(padded, -std::numeric_limits<float>::infinity());
  sc.l.assign(padded, 0.f);
  sc.qrow.resize(padded), sc.prow.resize(padded), sc.qfrow.resize(padded);
  sc.pfrow.resize(padded), sc.srow.resize(padded), sc.orow.resize(padded);
  if (!isa::kNativeBf16) sc.qf.resize(padded * D);
  for (int64_t r = 0; r < padded; ++r) {
    const int64_t src = r < rows ? r : 0;
    sc.qrow[r] =
        p.q + (t0 + src / group) * p.q_stride + (h * group + src % group) * p.q_head_stride;
    sc.srow[r] = sc.s.data() + r * kSStride;
    sc.orow[r] = sc.o.data() + r * D;
    sc.prow[r] = sc.pb.data() + r * kPStride;
    sc.pfrow[r] = sc.srow[r];
    // Spare rows' P: zeros, not stale bits (their sums are dropped, but must stay finite).
    if (r >= rows) std::memset(sc.pb.data() + r * kPStride, 0, kPStride * 2);
    if (!isa::kNativeBf16) {  // the fp32 copy the widened pair products broadcast from
      float* f = sc.qf.data() + r * D;
      for (int64_t d = 0; d < D; d += 16) isa::storeu(f + d, isa::load_bf16(sc.qrow[r] + d));
      sc.qfrow[r] = f;
    } else {
      sc.qfrow[r] = nullptr;
    }
  }
  if (amx) {
    sc.qa.resize(padded * D);
    for (int64_t r = 0; r < padded; ++r)
      std::memcpy(sc.qa.data() + r * D, sc.qrow[r], D * 2);
  }
  return rows;
}

// S for the chunk's rows x n16 keys, and O += P V: on tiles or in registers.
inline void chunk_scores(Scratch& sc, bool amx, int64_t rows, const uint16_t* kp, int64_t D,
                         int64_t n16) {
#ifdef KILN_AMX
  if (amx) {
    kiln_prefill_amx::qk(sc.qa.data(), sc.srow.size(), kp, D, n16, sc.s.data(), kSStride);
    return;
  }
#endif
  (void)amx;
  scores(sc, rows, kp, D, n16);
}

inline void chunk_values(Scratch& sc, bool amx, int64_t rows, const uint16_t* vp, int64_t D,
                         int64_t n16) {
#ifdef KILN_AMX
  if (amx) {
    kiln_prefill_amx::pv(sc.pb.data(), kPStride, sc.orow.size(), vp, D, n16, sc.o.data());
    return;
  }
#endif
  (void)amx;
  weighted_values(sc, rows, vp, D, n16);
}

// Item (h, tokens t0 .. t1 - 1) over packed keys kp / vp of KV head h.
// `amx`: tiles for both products (rows padded to 16, keys per chunk rounded up to 32).
inline void attend_item(const Prompt& p, int64_t group, int64_t D, int64_t h, int64_t t0,
                        int64_t t1, const uint16_t* kp, const uint16_t* vp, bool amx,
                        Scratch& sc) {
  const int64_t rows = bind_rows(sc, p, group, D, h, t0, t1, amx);
  const int64_t key_unit = amx ? 32 : 16;
  const int64_t pos0 = p.len - p.q_len + t0, end = p.len - p.q_len + t1;  // keys < end
  const int64_t begin = p.first + (first_visible(p, pos0) - p.first) / 16 * 16;
  const V16 scale = isa::set1(p.scale);
  // With a softcap the scores are scaled and capped first, and the softmax scales by 1.
  const float softmax_scale = p.softcap > 0 ? 1.f : p.scale;
  for (int64_t c = begin; c < end; c += kChunk) {
    const int64_t ce = std::min(end, c + kChunk);
    const int64_t n16 = (ce - c + key_unit - 1) / key_unit * key_unit;
    chunk_scores(sc, amx, rows, kp + (c - p.first) * D, D, n16);
    for (int64_t r = 0; r < rows; ++r) {
      float* s = sc.srow[r];
      if (p.softcap > 0) {
        for (int64_t j = 0; j < n16; j += 16)
          isa::storeu(s + j, isa::mul(isa::loadu(s + j), scale));
        for (int64_t j = 0; j < n16; ++j) s[j] = p.softcap * std::tanh(s[j] / p.softcap);
      }
      const int64_t pos = pos0 + r / group;
      const int64_t a = std::max<int64_t>(0, first_visible(p, pos) - c);
      const int64_t b = std::min(pos + 1, ce) - c;
      const float alpha = softmax_row(s, sc.pb.data() + r * kPStride, a, b, n16, softmax_scale,
                                      sc.m[r], sc.l[r]);
      if (alpha != 1.f) {
        float* o = sc.orow[r];
        for (int64_t d = 0; d < D; d += 16)
          isa::storeu(o + d, isa::mul(isa::loadu(o + d), isa::set1(alpha)));
      }
    }
    chunk_values(sc, amx, rows, vp + (c - p.first) * D, D, n16);
  }
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* o =
        p.out + (t0 + r / group) * p.out_stride + (h * group + r % group) * p.out_head_stride;
    const V16 inv = isa::set1(1.f / sc.l[r]);
    for (int64_t d = 0; d < D; d += 16)
      isa::store_bf16(o + d, isa::mul(isa::loadu(sc.orow[r] + d), inv));
  }
}

// The whole request: pack, then the items, cut between threads by work (keys x rows).
inline void prefill_bf16(const Prompt& p, const uint16_t* kc, const uint16_t* vc,
                         const int32_t* blocks, int64_t block_size, int64_t kv_heads,
                         int64_t group, int64_t D) {
#ifdef KILN_AMX
  const bool amx = kiln_amx::state().enabled && D % 32 == 0;
#else
  const bool amx = false;
#endif
  // With tiles a chunk's keys round up to 32: one more (zero) 16-key tile to read.
  const int64_t tiles = round16(p.len - p.first) / 16 + (amx ? 1 : 0);
  const int64_t per_head = tiles * 16 * D;
  static thread_local isa::AlignedVector<uint16_t> packed;
  packed.resize(2 * kv_heads * per_head);
  uint16_t* kp = packed.data();
  uint16_t* vp = kp + kv_heads * per_head;
  at::parallel_for(0, kv_heads * tiles, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / tiles;
      pack_tile(kc, vc, blocks, p, block_size, kv_heads, D, h, i % tiles, kp + h * per_head,
                vp + h * per_head);
    }
  });
  const int64_t tokens = std::max<int64_t>(1, (amx ? kAmxItemRows : kItemRows) / group);
  const int64_t per_h = (p.q_len + tokens - 1) / tokens, n_items = kv_heads * per_h;
  std::vector<int64_t> cost_upto(n_items);
  int64_t cost = 0;
  for (int64_t i = 0; i < n_items; ++i) {
    const int64_t t0 = (i % per_h) * tokens, t1 = std::min(p.q_len, t0 + tokens);
    const int64_t pos0 = p.len - p.q_len + t0;
    cost += (t1 - t0) * (pos0 + (t1 - t0) - first_visible(p, pos0) + 16);
    cost_upto[i] = cost;
  }
  const std::vector<int64_t> bounds = kiln_attn::split_by_cost(cost_upto);
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t b0, int64_t b1) {
    static thread_local Scratch sc;
#ifdef KILN_AMX
    if (amx) kiln_amx::configure_full();
#endif
    for (int64_t i = bounds[b0]; i < bounds[b1]; ++i) {
      const int64_t h = i / per_h, t0 = (i % per_h) * tokens;
      attend_item(p, group, D, h, t0, std::min(p.q_len, t0 + tokens), kp + h * per_head,
                  vp + h * per_head, amx, sc);
    }
#ifdef KILN_AMX
    if (amx) _tile_release();
#endif
  });
}

}  // namespace kiln_prefill
