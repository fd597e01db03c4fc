// The packed linear on AMX tiles (linear_bf16.cpp includes this once, after its shared
// constants: kAhead, kPanelXBytes, bias16). Three outputs from one loop:
//   * y = x @ w.T + b, each column pair (blocks 2p, 2p + 1) a 2 x 2 tile block;
//   * y = silu(g) * u of SwiGLU's gate_up projection (w = [gate | up], N = 2I): block j of
//     the gate and block j of the up projection share a tile block, so the epilogue
//     (kiln_amx::SiluEpilogue) has both halves of its 16 output columns, and the [M, 2I]
//     product is never written;
//   * y = x @ w.T + b with RoPE on q's and k's columns (RopeEpilogue): a tile block holds
//     the two halves of a head that rotate together, so q and k are never read back.
#pragma once
#ifdef KILN_AMX

namespace {

// y for rows [r0, r1) of block `t`: bias added, rounded to bf16. Row by row, both blocks
// of a row together: one 64-byte store, a whole cache line of y, when `pair`. Block by
// block, at a row stride that is a multiple of 2 KiB (gate_up's 3,072 columns: 6 KiB) the
// rows shared two L1 sets, and a line written half was evicted before its other half.
struct BiasEpilogue {
  const c10::BFloat16* bias;
  c10::BFloat16* y;
  int64_t N;

  void operator()(const kiln_amx::AmxBlock& t, int64_t r0, int64_t r1) const {
    const __m512 bv[2] = {bias16(bias, t.nb * 16),
                          t.pair ? bias16(bias, t.nb * 16 + 16) : kiln_isa::zero()};
    for (int64_t r = r0; r < r1; ++r) {
      c10::BFloat16* row = y + (t.m0 + r) * N + t.nb * 16;
      const float(*c)[16][16] = t.c + r / 16 * 2;  // this row's tiles: block 0, block 1
      const __m512 lo = kiln_isa::add(_mm512_load_ps(c[0][r % 16]), bv[0]);
      if (t.pair)
        kiln_isa::store_bf16x2(row, lo, kiln_isa::add(_mm512_load_ps(c[1][r % 16]), bv[1]));
      else
        store_bf16(row, lo);
    }
  }
};

// Blocking of a thread's share (column pairs, or rows: amx_gemm) at prefill sizes: passes
// of rows whose x fits kPanelXBytes (L2), and within a pass groups of kAmxPairGroup pairs
// (8 x 2 x K/32 KiB of weights: 288 KiB at K = 576, L2), each group's tiles row block by
// row block.
// So the weights are read from L3 once per pass (not once per 32 rows), and consecutive
// tiles write the same 32 rows of y, whose pages stay in the TLB (at 3,072 columns a row
// is 6 KiB, and a pair-by-pair order touched a new page per row per tile). 2,000 rows x
// 576 deep, 2 threads, Xeon (amx): 3,072 columns 1.5 -> 2.0 TFLOP/s, 4,096 1.4 -> 1.85,
// 576 2.0 -> 2.1; oneDNN 2.2-2.7. Only a pass's first row block prefetches the weights
// (from L3); the later ones find them in L2 (gemm_tile_run).
constexpr int64_t kAmxPairGroup = 8;

// How a thread's units (tile blocks of two 16-column weight blocks) pair the blocks.
//   kAdjacent: unit p is blocks 2p and 2p + 1 (the last alone when N / 16 is odd);
//   kSilu: gate block p with up block p + N / 32 (SiluEpilogue);
//   kRope: the first rope_blocks blocks are heads of D / 16 blocks, and a head's block j
//     pairs with its block j + D / 32, the columns RoPE rotates together (RopeEpilogue);
//     the blocks after them pair as kAdjacent.
enum class Pairing { kAdjacent, kSilu, kRope };

struct Pairs {
  Pairing kind;
  int64_t blocks, rope_blocks = 0, head_blocks = 2;

  int64_t units() const {
    if (kind == Pairing::kSilu) return blocks / 2;
    return rope_blocks / 2 + (blocks - rope_blocks + 1) / 2;
  }
  // Unit p's two blocks; the second is `blocks` when there is none.
  std::pair<int64_t, int64_t> at(int64_t p) const {
    if (kind == Pairing::kSilu) return {p, p + blocks / 2};
    if (p < rope_blocks / 2) {
      const int64_t half = head_blocks / 2, b0 = p / half * head_blocks + p % half;
      return {b0, b0 + half};
    }
    const int64_t b0 = rope_blocks + 2 * (p - rope_blocks / 2);
    return {b0, std::min(b0 + 1, blocks)};
  }
};

// Rows [r0, r1) of y over units [u0, u1) in passes of pass_rows: one thread's share,
// blocked as above.
template <class Epilogue>
void amx_gemm_share(const uint16_t* x, const uint16_t* wp, int64_t r0, int64_t r1, int64_t K,
                    const Pairs& pairs, const Epilogue& epilogue, int64_t u0, int64_t u1,
                    int64_t pass_rows) {
  kiln_amx::GemmRows rb;
  kiln_amx::AmxPipeline<Epilogue> pipe(epilogue);
  const int64_t chunks = K / 32;
  for (int64_t pass = r0; pass < r1; pass += pass_rows) {
    const int64_t pass_end = std::min(r1, pass + pass_rows);
    for (int64_t g = u0; g < u1; g += kAmxPairGroup) {
      const int64_t g_end = std::min(u1, g + kAmxPairGroup);
      for (int64_t m0 = pass; m0 < pass_end; m0 += 32) {
        rb.next(pass_end - m0);  // may reconfigure: the pending block is already stored
        const uint16_t* x0 = x + m0 * K;
        for (int64_t p = g; p < g_end; ++p) {
          const auto [b0, b1] = pairs.at(p);
          const bool pair = b1 < pairs.blocks;
          pipe.run(x0, x0 + 16 * K, K * 2, wp + b0 * chunks * 512, wp + b1 * chunks * 512,
                   chunks, m0 == pass ? kAhead : 0, m0, rb, b0, pair);
        }
      }
    }
  }
  pipe.flush();
  _tile_release();
}

// From this many rows per thread each thread takes a contiguous share of the rows, all
// units (column pairs) over them, instead of a share of the units over all rows. The
// shares are at::parallel_for's own (ceil(M / threads) rows each), which is how the
// add + RMSNorm and the GEMMs before this one split their rows: each thread's x rows were
// written by that thread and are in its own L2, where a column split had every thread
// read the other's rows too. A 2,000-token prefill on the Xeon (amx, 2 threads, in
// process, interleaved, per op under the profiler, ms a prefill): linear_packed_rope 43.8
// -> 39.0, linear_packed_silu 107.0 -> 104.9, add_rms_norm 22.5 -> 20.8, attention 145.8
// -> 140.5, the whole prefill 436 -> 421 (medians of 8). Below it the column split keeps
// every thread busy on few rows.
constexpr int64_t kRowSplitRows = 256;
// A row share's passes take up to kRowSplitRows rows of x within this many bytes: each
// pass reads all the weights, so at K = 1,536 (SmolLM2's down projection) kPanelXBytes'
// 64-row passes read them 16 times a share. x is the thread's own, and a pass's 768 KiB
// of it fits L2 beside a pair group's 768 KiB of weights. 256-row passes against
// kPanelXBytes' (2,000 tokens, the same A/B, four runs of 10-16 rounds): o_proj + down
// 78.0 -> 71.2, 78.2 -> 71.1, 84.0 -> 77.4, 88.8 -> 83.7 ms a prefill; the other ops and
// the whole prefill within the runs' noise (-5% to +0.5%). 512 or 1,024 rows: no better.
constexpr int64_t kRowPassXBytes = 1 << 20;

template <class Epilogue>
void amx_gemm(const uint16_t* x, const uint16_t* wp, int64_t M, int64_t K, const Pairs& pairs,
              Epilogue epilogue) {
  const int64_t threads = at::get_num_threads();
  const int64_t panel_rows = std::max<int64_t>(32, kPanelXBytes / (K * 2) / 32 * 32);
  if (threads > 1 && M >= kRowSplitRows * threads) {
    const int64_t share = (M + threads - 1) / threads;
    const int64_t pass_rows = std::max(
        panel_rows, std::min<int64_t>(kRowSplitRows, kRowPassXBytes / (K * 2) / 32 * 32));
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        amx_gemm_share(x, wp, t * share, std::min(M, (t + 1) * share), K, pairs, epilogue, 0,
                       pairs.units(), pass_rows);
    });
    return;
  }
  at::parallel_for(0, pairs.units(), 1, [&](int64_t begin, int64_t end) {
    amx_gemm_share(x, wp, 0, M, K, pairs, epilogue, begin, end, panel_rows);
  });
}

// y = x @ w.T + b with Neox RoPE over its first rope_blocks blocks (q's and k's heads of
// D): each row's bf16 product rotated by its position's cos and sin (the fp32 caches
// rounded to bf16, as the reference casts them), the same bits as linear_packed and then
// rotary_embedding (pointwise.cpp). Blocks past them take BiasEpilogue's path. Positions
// are checked by the caller.
struct RopeEpilogue {
  BiasEpilogue plain;
  const int64_t* pos;
  const float *cos, *sin;
  int64_t D, rope_blocks;

  void operator()(const kiln_amx::AmxBlock& t, int64_t r0, int64_t r1) const {
    if (t.nb >= rope_blocks) return plain(t, r0, r1);
    const int64_t half = D / 2, j = t.nb % (D / 16) * 16;  // lo block's column in its head
    const __m512 b_lo = bias16(plain.bias, t.nb * 16);
    const __m512 b_hi = bias16(plain.bias, t.nb * 16 + half);
    for (int64_t r = r0; r < r1; ++r) {
      const float* c_row = cos + pos[t.m0 + r] * D;
      const float* s_row = sin + pos[t.m0 + r] * D;
      const float(*c)[16][16] = t.c + r / 16 * 2;
      const __m512 lo =
          kiln_isa::round_bf16(kiln_isa::add(_mm512_load_ps(c[0][r % 16]), b_lo));
      const __m512 hi =
          kiln_isa::round_bf16(kiln_isa::add(_mm512_load_ps(c[1][r % 16]), b_hi));
      const auto cs = [&](const float* row, int64_t col) {
        return kiln_isa::round_bf16(_mm512_loadu_ps(row + col));
      };
      c10::BFloat16* y = plain.y + (t.m0 + r) * plain.N + t.nb * 16;
      store_bf16(y, kiln_isa::fnmadd(hi, cs(s_row, j), kiln_isa::mul(lo, cs(c_row, j))));
      store_bf16(y + half, kiln_isa::fmadd(lo, cs(s_row, j + half),
                                           kiln_isa::mul(hi, cs(c_row, j + half))));
    }
  }
};

}  // namespace

#endif
