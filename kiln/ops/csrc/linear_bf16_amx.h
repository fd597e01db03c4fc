// The packed linear on AMX tiles (linear_bf16.cpp includes this once, after its shared
// constants: kAhead, kPanelXBytes, bias16). Two outputs from one loop:
//   * y = x @ w.T + b, each column pair (blocks 2p, 2p + 1) a 2 x 2 tile block;
//   * y = silu(g) * u of SwiGLU's gate_up projection (w = [gate | up], N = 2I): block j of
//     the gate and block j of the up projection share a tile block, so the epilogue
//     (kiln_amx::SiluEpilogue) has both halves of its 16 output columns, and the [M, 2I]
//     product is never written.
#pragma once
#ifdef __AMX_TILE__

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

// Blocking of a thread's share (its column pairs) at prefill sizes: passes of rows whose
// x fits kPanelXBytes (L2), and within a pass groups of kAmxPairGroup pairs (8 x 2 x
// K/32 KiB of weights: 288 KiB at K = 576, L2), each group's tiles row block by row block.
// So the weights are read from L3 once per pass (not once per 32 rows), and consecutive
// tiles write the same 32 rows of y, whose pages stay in the TLB (at 3,072 columns a row
// is 6 KiB, and a pair-by-pair order touched a new page per row per tile). 2,000 rows x
// 576 deep, 2 threads, Xeon (amx): 3,072 columns 1.5 -> 2.0 TFLOP/s, 4,096 1.4 -> 1.85,
// 576 2.0 -> 2.1; oneDNN 2.2-2.7. Only a pass's first row block prefetches the weights
// (from L3); the later ones find them in L2 (gemm_tile_run).
constexpr int64_t kAmxPairGroup = 8;

// kSilu: `pairs` = I / 16 (gate block p with up block p + pairs), else the column pairs.
template <bool kSilu, class Epilogue>
void amx_gemm(const uint16_t* x, const uint16_t* wp, int64_t M, int64_t K, int64_t N,
              Epilogue epilogue) {
  const int64_t blocks = N / 16, pairs = kSilu ? blocks / 2 : (blocks + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    kiln_amx::GemmRows rb;
    kiln_amx::AmxPipeline<Epilogue> pipe(epilogue);
    const int64_t chunks = K / 32;
    const int64_t pass_rows = std::max<int64_t>(32, kPanelXBytes / (K * 2) / 32 * 32);
    for (int64_t pass = 0; pass < M; pass += pass_rows) {
      const int64_t pass_end = std::min(M, pass + pass_rows);
      for (int64_t g = begin; g < end; g += kAmxPairGroup) {
        const int64_t g_end = std::min(end, g + kAmxPairGroup);
        for (int64_t m0 = pass; m0 < pass_end; m0 += 32) {
          rb.next(M - m0);  // may reconfigure: the pending block is already stored
          const uint16_t* x0 = x + m0 * K;
          for (int64_t p = g; p < g_end; ++p) {
            const int64_t b0 = kSilu ? p : 2 * p, b1 = kSilu ? p + pairs : 2 * p + 1;
            const bool pair = b1 < blocks;
            pipe.run(x0, x0 + 16 * K, K * 2, wp + b0 * chunks * 512, wp + b1 * chunks * 512,
                     chunks, m0 == pass ? kAhead : 0, m0, rb, kSilu ? p : b0, pair);
          }
        }
      }
    }
    pipe.flush();
    _tile_release();
  });
}

}  // namespace

#endif
