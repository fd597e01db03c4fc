// The packed linear's AVX2 panel path (linear_bf16.cpp includes this once, inside its
// anonymous namespace, after its shared constants: kAhead, kPanelXBytes, bias16).
#pragma once
#ifdef KILN_PANEL_GEMM

// The panel path (FMA builds that define KILN_PANEL_GEMM, from kPanelFrom rows on). The
// 4 x 1 tile above widens each weight pair once per 4 rows and streams each x row from
// L3 once per column block; at prefill and batched-decode sizes that bounds it below an
// fp32 sgemm. Here each thread widens one 16-column block of the weight, whole K, into an
// fp32 panel [K, 16] (per-thread scratch, L2-resident: no per-layer copy) once per block
// of x rows that fits L2 beside it, and runs a kPanelRows x 16 fp32 tile over the panel:
// per k, one panel row, kPanelRows broadcasts and 2 x kPanelRows FMAs on AVX2.

void widen_block(const uint16_t* wp, int64_t chunks, int64_t nb, float* panel) {
  const uint16_t* w = wp + nb * chunks * 512;
  for (int64_t kc = 0; kc < chunks; ++kc)
    for (int r = 0; r < 16; ++r) {
      // The weight streams from memory once per block of rows; its lines a few chunks
      // ahead (into the next block's at the end) hide the latency, as in `micro`.
      _mm_prefetch(reinterpret_cast<const char*>(w + (kc + kAhead) * 512 + r * 32),
                   _MM_HINT_T0);
      const kiln_isa::WRow wr = kiln_isa::load_wrow(w + kc * 512 + r * 32);
      float* p = panel + (kc * 32 + 2 * r) * 16;  // rows k and k + 1 of the panel
      kiln_isa::storeu(p, wr.even);
      kiln_isa::storeu(p + 16, wr.odd);
    }
}

// Rows m0..m0+R of x (fp32) against the widened block nb.
template <int R>
void panel_micro(const float* xf, const float* panel, const c10::BFloat16* bias,
                 c10::BFloat16* y, int64_t K, int64_t N, int64_t m0, int64_t nb) {
  const float* xr[R];
  V16 acc[R];
  for (int m = 0; m < R; ++m) {
    xr[m] = xf + (m0 + m) * K;
    acc[m] = kiln_isa::zero();
  }
  for (int64_t k = 0; k < K; ++k) {
    const V16 w = kiln_isa::loadu(panel + k * 16);
    for (int m = 0; m < R; ++m) acc[m] = kiln_isa::fmadd(kiln_isa::set1(xr[m][k]), w, acc[m]);
  }
  const V16 b = bias16(bias, nb * 16);
  for (int m = 0; m < R; ++m) store_bf16(y + (m0 + m) * N + nb * 16, kiln_isa::add(acc[m], b));
}

using PanelFn = void (*)(const float*, const float*, const c10::BFloat16*, c10::BFloat16*,
                         int64_t, int64_t, int64_t, int64_t);
template <int... R>
constexpr PanelFn kPanelTable[] = {panel_micro<R>...};
constexpr const PanelFn* kPanel = kPanelTable<1, 2, 3, 4, 5, 6>;  // kPanel[rows - 1]
static_assert(kiln_isa::kPanelRows == 6, "kPanel covers tiles of 1 to 6 rows");

void panel_gemm(const float* xf, const uint16_t* wp, const c10::BFloat16* bias,
                c10::BFloat16* y, int64_t M, int64_t K, int64_t N) {
  constexpr int64_t R = kiln_isa::kPanelRows;
  // Row blocks of equal size (whole tiles) whose x fits kPanelXBytes: each block widens
  // every weight block once.
  const int64_t fit = std::max<int64_t>(R, kPanelXBytes / (K * 4) / R * R);
  const int64_t blocks = (M + fit - 1) / fit;
  const int64_t block = ((M + blocks - 1) / blocks + R - 1) / R * R;
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    const auto panel = kiln_isa::aligned_buffer<float>(K * 16);
    for (int64_t mb = 0; mb < M; mb += block) {
      const int64_t me = std::min(M, mb + block);
      for (int64_t nb = begin; nb < end; ++nb) {
        widen_block(wp, K / 32, nb, panel.get());
        for (int64_t m = mb; m < me; m += R)
          kPanel[std::min<int64_t>(R, me - m) - 1](xf, panel.get(), bias, y, K, N, m, nb);
      }
    }
  });
}

#endif  // KILN_PANEL_GEMM
