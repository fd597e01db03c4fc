// kiln_cpu::linear_packed — y = x @ w.T (+ b) in bf16 over a weight packed once at load.
//
// Why it exists: oneDNN's bf16 GEMM reorders the whole weight on every call when it is
// not prepacked, and its bf16 GEMV reaches about half the bandwidth of its fp32 GEMV on
// these machines; decode-sized linears are memory-bound, so both cost directly. No path
// here copies or reformats the weight per call.
//
// The weight is packed once (`pack` in kiln/ops/linear.py) into the layout AMX's B tiles
// read, which also suits AVX512-BF16's `vdpbf16ps`:
//     wp[N/16, K/32, 16, 32]: wp[nb, kc, r, 2 * n + i] = w[16 * nb + n, 32 * kc + 2 * r + i]
// i.e. for each 16-column block and 32-deep K chunk, one 1 KiB tile whose row r (one
// cache line) holds the (k, k+1) pairs of 16 output columns.
//
//   * with AMX (amx builds, when the process may use tiles): 16x32 x tiles against the
//     weight tiles at every row count, fp32 tile accumulators;
//   * otherwise a register-blocked kernel: kGemmRows input rows x kGemmBlocks column
//     blocks of fp32 accumulators (4 x 4 on AVX512, 4 x 1 on AVX2), each weight line read
//     once per 4 rows; `vdpbf16ps` where the CPU has it, two fp32 FMAs per pair where it
//     does not (simd.h);
//   * on AVX2, from kPanelFrom rows on, a panel kernel: each thread widens one 16-column
//     weight block to an fp32 scratch panel and runs an sgemm-style 6 x 16 tile over it.
// Accumulation is fp32; each output is rounded to bf16 once, after the bias.
//
// A layer may also keep a plain weight for large row counts (`dense`, `dense_from`): the
// tuning table decides per layer when oneDNN's GEMM beats the packed kernel there.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include "amx.h"
#include "kept_rows.h"
#include "simd.h"

namespace {

using kiln_isa::load_bf16;
using kiln_isa::store_bf16;
using kiln_isa::V16;

constexpr int64_t kAhead = 4;    // weight chunks prefetched ahead of use
constexpr int kMR = kiln_isa::kGemmRows, kNR = kiln_isa::kGemmBlocks;  // register tile
// Rows per pass over a thread's columns: each weight slice is reused by every row of the
// pass, and each pass streams the thread's share of the weight again. Zen 4 (avx512_bf16,
// 1 MiB L2), linear_ab.py, SmolLM2's shapes, 256 -> 512 rows: 1-4% faster at 2,000 rows
// (qkv, o_proj, down; gate_up even), even at 8,000; whole passes of 2,048 rows gained no
// more at 2,000 and ran gate_up 13% slower in one run at 8,000.
constexpr int64_t kMBlock = 512;
// The x bytes one pass of the AVX2 panel or the AMX tiles reuses (L2), whatever K is.
constexpr int64_t kPanelXBytes = 256 * 1024;

inline V16 bias16(const c10::BFloat16* bias, int64_t n0) {
  return bias == nullptr ? kiln_isa::zero() : load_bf16(bias + n0);
}

// What a register tile's NR column blocks are and where its sums go.
//  kPlain: weight blocks nb .. nb + NR - 1; y [M, N] = acc + bias.
//  kSilu: SwiGLU's gate_up ([gate | up], N / 32 blocks a half): gate blocks nb ..
//    nb + NR/2 - 1 and their up blocks half a weight later; y [M, N/2] = silu(g) * u with
//    g and u rounded to bf16 first, as linear_packed stores them: the same bits as
//    silu_and_mul after the linear, without writing and reading back the [M, N] product.
enum class Tile { kPlain, kSilu };

// Rows m0..m0+MR of x against column blocks nb..nb+NR (accumulators in registers:
// KILN_UNROLL, simd.h).
template <int MR, int NR, Tile E = Tile::kPlain>
void micro(const uint16_t* x, const float* xf, const uint16_t* wp, const c10::BFloat16* bias,
           c10::BFloat16* y, int64_t K, int64_t N, int64_t m0, int64_t nb) {
  static_assert(E == Tile::kPlain || NR % 2 == 0, "a SiLU tile pairs gate and up blocks");
  constexpr int G = E == Tile::kSilu ? NR / 2 : NR;  // output blocks
  const int64_t chunks = K / 32;
  const uint16_t* w[NR];
  for (int j = 0; j < NR; ++j)
    w[j] = wp + (nb + (j < G ? j : N / 32 + j - G)) * chunks * 512;
  const uint16_t* xr[MR];
  const float* xfr[MR];
  for (int m = 0; m < MR; ++m) {
    xr[m] = x + (m0 + m) * K;
    xfr[m] = xf == nullptr ? nullptr : xf + (m0 + m) * K;
  }
  V16 acc[MR][NR];
  KILN_UNROLL
  for (int m = 0; m < MR; ++m)
    KILN_UNROLL
    for (int j = 0; j < NR; ++j) acc[m][j] = kiln_isa::zero();
  for (int64_t kc = 0; kc < chunks; ++kc) {
    for (int r = 0; r < 16; ++r) {
      const int64_t off = kc * 512 + r * 32, k = kc * 32 + 2 * r;
      kiln_isa::WRow wr[NR];
      KILN_UNROLL
      for (int j = 0; j < NR; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(w[j] + off + kAhead * 512), _MM_HINT_T0);
        wr[j] = kiln_isa::load_wrow(w[j] + off);
      }
      KILN_UNROLL
      for (int m = 0; m < MR; ++m) {
        const kiln_isa::Pair p = kiln_isa::load_pair(xr[m], xfr[m], k);
        KILN_UNROLL
        for (int j = 0; j < NR; ++j) acc[m][j] = kiln_isa::dot(acc[m][j], p, wr[j]);
      }
    }
  }
  if constexpr (E == Tile::kSilu) {
    KILN_UNROLL
    for (int j = 0; j < G; ++j)
      KILN_UNROLL
      for (int m = 0; m < MR; ++m)
        store_bf16(y + (m0 + m) * (N / 2) + (nb + j) * 16,
                   kiln_isa::silu_mul(kiln_isa::round_bf16(acc[m][j]),
                                      kiln_isa::round_bf16(acc[m][j + G])));
  } else {
    KILN_UNROLL
    for (int j = 0; j < NR; ++j) {
      const V16 b = bias16(bias, (nb + j) * 16);
      KILN_UNROLL
      for (int m = 0; m < MR; ++m)
        store_bf16(y + (m0 + m) * N + (nb + j) * 16, kiln_isa::add(acc[m][j], b));
    }
  }
}

using MicroFn = void (*)(const uint16_t*, const float*, const uint16_t*,
                         const c10::BFloat16*, c10::BFloat16*, int64_t, int64_t, int64_t,
                         int64_t);

// kMicro[rows - 1][blocks - 1]; tile_gemm asks only for tiles up to kMR x kNR.
template <int MR>
constexpr MicroFn kRow[4] = {micro<MR, 1>, micro<MR, 2>, micro<MR, 3>, micro<MR, 4>};
constexpr const MicroFn* kMicro[4] = {kRow<1>, kRow<2>, kRow<3>, kRow<4>};
static_assert(kMR <= 4 && kNR <= 4, "kMicro covers register tiles up to 4 x 4");
// kSiluMicro[rows - 1][gate blocks - 1]: a gate and an up block per output block.
template <int MR>
constexpr MicroFn kSiluRow[2] = {micro<MR, 2, Tile::kSilu>, micro<MR, 4, Tile::kSilu>};
constexpr const MicroFn* kSiluMicro[4] = {kSiluRow<1>, kSiluRow<2>, kSiluRow<3>,
                                          kSiluRow<4>};

// 5..8 rows (a decode step verifying draft tokens) in one tile: each weight row is loaded
// once for all of them, where 4-row tiles loaded it twice. Column blocks per tile: as many
// as keep MR x NR accumulators within 24 of the 32 AVX512 registers (one on AVX2).
constexpr MicroFn kTall5[4] = {micro<5, 1>, micro<5, 2>, micro<5, 3>, micro<5, 4>};
constexpr MicroFn kTall6[4] = {micro<6, 1>, micro<6, 2>, micro<6, 3>, micro<6, 4>};
constexpr MicroFn kTall7[3] = {micro<7, 1>, micro<7, 2>, micro<7, 3>};
constexpr MicroFn kTall8[3] = {micro<8, 1>, micro<8, 2>, micro<8, 3>};
constexpr const MicroFn* kTall[4] = {kTall5, kTall6, kTall7, kTall8};

// Row counts the tall tiles take (tile_gemm); linear_packed_silu leaves them to two steps.
inline bool tall_rows(int64_t M) { return M >= 5 && M <= 8; }

void tall_gemm(const uint16_t* x, const float* xf, const uint16_t* wp,
               const c10::BFloat16* bias, c10::BFloat16* y, int64_t M, int64_t K,
               int64_t N) {
  const int64_t NR = kNR == 1 ? 1 : (M <= 6 ? 4 : 3);
  at::parallel_for(0, N / 16, NR, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; nb += NR) {
      const int64_t nr = std::min<int64_t>(NR, end - nb);
      kTall[M - 5][nr - 1](x, xf, wp, bias, y, K, N, 0, nb);
    }
  });
}

// Register tiles from `table` ([rows - 1][tile's output blocks - 1]) over `blocks` output
// blocks, `step` a tile. Threads split the blocks: each weight line is read by one thread.
void run_tiles(const MicroFn* const* table, int64_t blocks, int64_t step, const uint16_t* x,
               const float* xf, const uint16_t* wp, const c10::BFloat16* bias,
               c10::BFloat16* y, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, blocks, step, [&](int64_t begin, int64_t end) {
    for (int64_t mb = 0; mb < M; mb += kMBlock) {
      const int64_t me = std::min(M, mb + kMBlock);
      for (int64_t nb = begin; nb < end; nb += step) {
        const int64_t nr = std::min<int64_t>(step, end - nb);
        for (int64_t m = mb; m < me; m += kMR)
          table[std::min<int64_t>(kMR, me - m) - 1][nr - 1](x, xf, wp, bias, y, K, N, m, nb);
      }
    }
  });
}

void tile_gemm(const uint16_t* x, const float* xf, const uint16_t* wp,
               const c10::BFloat16* bias, c10::BFloat16* y, int64_t M, int64_t K,
               int64_t N) {
  if (tall_rows(M)) {
    tall_gemm(x, xf, wp, bias, y, M, K, N);
    return;
  }
  run_tiles(kMicro, N / 16, kNR, x, xf, wp, bias, y, M, K, N);
}

#include "linear_bf16_panel.h"

// The FMA path broadcasts from an fp32 copy of x, widened here rather than through an
// ATen conversion: at decode sizes that op's dispatch cost more than the widening. None
// where the CPU multiplies bf16 pairs itself.
std::unique_ptr<float[]> widened(const uint16_t* xp, int64_t M, int64_t K) {
  std::unique_ptr<float[]> xf;
  if (!kiln_isa::kNativeBf16) {
    xf.reset(new float[M * K]);  // K % 32 == 0: whole V16s
    for (int64_t i = 0; i < M * K; i += 16) kiln_isa::storeu(xf.get() + i, load_bf16(xp + i));
  }
  return xf;
}

// The bias as the kernels read it: bf16, contiguous; none when absent.
c10::optional<at::Tensor> bf16_bias(const c10::optional<at::Tensor>& bias) {
  if (!bias.has_value() || !bias->defined()) return c10::nullopt;
  return bias->to(at::kBFloat16).contiguous();
}

// Whether oneDNN's GEMM on the plain weight takes these M rows (the tuning table's choice).
bool dense_rows(const c10::optional<at::Tensor>& dense, int64_t dense_from, int64_t M) {
  return dense.has_value() && dense->defined() && dense->numel() > 0 && dense_from > 0 &&
         M >= dense_from;
}

}  // namespace

#include "linear_bf16_amx.h"

namespace {

at::Tensor packed_product(const at::Tensor& x, const at::Tensor& wp,
                          const c10::optional<at::Tensor>& bias,
                          const c10::optional<at::Tensor>& dense, int64_t dense_from) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16 &&
                  x.dim() == 2 && wp.dim() == 4 && wp.size(2) == 16 && wp.size(3) == 32 &&
                  wp.is_contiguous(),
              "linear_packed: bf16 x [M, K] and a packed weight [N/16, K/32, 16, 32]");
  const int64_t M = x.size(0), K = wp.size(1) * 32, N = wp.size(0) * 16;
  TORCH_CHECK(x.size(1) == K, "linear_packed: x has ", x.size(1), " columns, weight ", K);
  const auto b = bf16_bias(bias);
  if (dense_rows(dense, dense_from, M)) return at::linear(x, *dense, b);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto xc = x.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* wptr = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  const c10::BFloat16* bp = b ? b->data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
#ifdef KILN_AMX
  if (kiln_amx::state().enabled && M >= kiln_amx::state().min_rows) {
    amx_gemm(xp, wptr, M, K, Pairs{Pairing::kAdjacent, N / 16}, BiasEpilogue{bp, yp, N});
    return y;
  }
#endif
  const auto xf = widened(xp, M, K);
#ifdef KILN_PANEL_GEMM
  if (M >= kiln_isa::kPanelFrom) {
    panel_gemm(xf.get(), wptr, bp, yp, M, K, N);
    return y;
  }
#endif
  tile_gemm(xp, xf.get(), wptr, bp, yp, M, K, N);
  return y;
}

}  // namespace

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& wp,
                         const c10::optional<at::Tensor>& bias,
                         const c10::optional<at::Tensor>& dense, int64_t dense_from,
                         const c10::optional<at::Tensor>& rows) {
  return kiln_rows::on_kept_rows(x, rows, wp.size(0) * 16, [&](const at::Tensor& xs) {
    return packed_product(xs, wp, bias, dense, dense_from);
  });
}

at::Tensor silu_and_mul(const at::Tensor& x);  // pointwise.cpp

namespace {

// silu_and_mul(linear_packed(x, wp)) for SwiGLU's gate_up projection (w = [gate | up], no
// bias), the same bits. The activation runs in the GEMM's epilogue: on tiles
// (linear_bf16_amx.h; at 2,000 tokens of SmolLM2 the separate op spent 0.75 ms a layer
// reading back the [M, 2I] product the GEMM had just written) and in the register tiles
// (Tile::kSilu; Zen 4, avx512_bf16, 2,000 x 576 -> 3,072: 16.2 -> 15.8 ms). Elsewhere
// (the tall and AVX2 tiles, whose registers hold one block a row, the AVX2 panel,
// oneDNN's rows) the two steps run one after the other.
at::Tensor packed_silu(const at::Tensor& x, const at::Tensor& wp,
                       const c10::optional<at::Tensor>& dense, int64_t dense_from) {
  TORCH_CHECK(wp.dim() == 4 && wp.size(0) % 2 == 0,
              "linear_packed_silu: a packed [gate | up] weight of an even block count");
  const int64_t M = x.size(0), K = wp.size(1) * 32, N = wp.size(0) * 16;
  const bool fusable = !dense_rows(dense, dense_from, M) && x.scalar_type() == at::kBFloat16 &&
                       x.dim() == 2 && x.size(1) == K && wp.scalar_type() == at::kBFloat16 &&
                       wp.size(2) == 16 && wp.size(3) == 32 && wp.is_contiguous();
#ifdef KILN_AMX
  if (fusable && kiln_amx::state().enabled && M >= kiln_amx::state().min_rows) {
    auto y = at::empty({M, N / 2}, x.options());
    const auto xc = x.contiguous();
    amx_gemm(reinterpret_cast<const uint16_t*>(xc.data_ptr()),
             reinterpret_cast<const uint16_t*>(wp.data_ptr()), M, K,
             Pairs{Pairing::kSilu, N / 16},
             kiln_amx::SiluEpilogue{reinterpret_cast<uint16_t*>(y.data_ptr()), N / 32});
    return y;
  }
#endif
  if constexpr (kNR >= 2) {
    if (fusable && M > 0 && !tall_rows(M)) {
      auto y = at::empty({M, N / 2}, x.options());
      const auto xc = x.contiguous();
      const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
      run_tiles(kSiluMicro, N / 32, kNR / 2, xp, widened(xp, M, K).get(),
                reinterpret_cast<const uint16_t*>(wp.data_ptr()), nullptr,
                y.data_ptr<c10::BFloat16>(), M, K, N);
      return y;
    }
  }
  return silu_and_mul(packed_product(x, wp, c10::nullopt, dense, dense_from));
}

}  // namespace

at::Tensor linear_packed_silu(const at::Tensor& x, const at::Tensor& wp,
                              const c10::optional<at::Tensor>& dense, int64_t dense_from,
                              const c10::optional<at::Tensor>& rows) {
  return kiln_rows::on_kept_rows(x, rows, wp.size(0) * 8, [&](const at::Tensor& xs) {
    return packed_silu(xs, wp, dense, dense_from);
  });
}

void rope_columns_(at::Tensor& y, const at::Tensor& positions, const at::Tensor& cos,
                   const at::Tensor& sin, int64_t rope_cols);  // pointwise.cpp
at::Tensor checked_positions(const char* op, const at::Tensor& positions,
                             int64_t P);  // pointwise.cpp

// linear_packed(x, wp, bias) with Neox RoPE on its first rope_cols columns, heads of D =
// cos.size(1) (q's heads then k's, from the float32 caches [P, D]), the same bits as the
// linear followed by rotary_embedding. On tiles the rotation runs in the GEMM's epilogue
// (RopeEpilogue): q and k are not written, read and written again, and no op call is
// spent on them. Elsewhere the linear runs and the rotation follows in place.
at::Tensor linear_packed_rope(const at::Tensor& x, const at::Tensor& wp,
                              const c10::optional<at::Tensor>& bias,
                              const at::Tensor& positions, const at::Tensor& cos,
                              const at::Tensor& sin, int64_t rope_cols,
                              const c10::optional<at::Tensor>& dense, int64_t dense_from) {
  const int64_t M = x.size(0), N = wp.size(0) * 16, D = cos.size(1);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  sin.sizes() == cos.sizes() && D % 32 == 0 && rope_cols % D == 0 &&
                  rope_cols <= N && positions.numel() == M,
              "linear_packed_rope: float32 cos / sin caches [P, D], D % 32 == 0, rope_cols "
              "whole heads of the output, one position per row");
#ifdef KILN_AMX
  const int64_t K = wp.size(1) * 32;
  if (kiln_amx::state().enabled && M >= kiln_amx::state().min_rows &&
      !dense_rows(dense, dense_from, M) && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
      x.size(1) == K && wp.scalar_type() == at::kBFloat16 && wp.is_contiguous()) {
    // The epilogue reads the caches' rows unchecked.
    const auto pos = checked_positions("linear_packed_rope", positions, cos.size(0));
    const auto* pp = pos.data_ptr<int64_t>();
    const auto b = bf16_bias(bias);
    auto y = at::empty({M, N}, x.options());
    const auto xc = x.contiguous();
    const BiasEpilogue plain{b ? b->data_ptr<c10::BFloat16>() : nullptr,
                             y.data_ptr<c10::BFloat16>(), N};
    amx_gemm(reinterpret_cast<const uint16_t*>(xc.data_ptr()),
             reinterpret_cast<const uint16_t*>(wp.data_ptr()), M, K,
             Pairs{Pairing::kRope, N / 16, rope_cols / 16, D / 16},
             RopeEpilogue{plain, pp, cos.data_ptr<float>(), sin.data_ptr<float>(), D,
                          rope_cols / 16});
    return y;
  }
#endif
  auto y = packed_product(x, wp, bias, dense, dense_from);
  rope_columns_(y, positions, cos, sin, rope_cols);
  return y;
}

// Python enables AMX for the process first (torch.cpu._init_amx: the kernel must grant
// the tile state); only then may the AMX paths run, the linear's from `min_rows` rows on
// (amx.h). Builds without AMX ignore it.
void set_amx(bool enabled, int64_t min_rows) {
#ifdef KILN_AMX
  kiln_amx::state() = kiln_amx::State{enabled, std::max<int64_t>(1, min_rows)};
#else
  (void)enabled, (void)min_rows;
#endif
}

// The schemas of the ops a graph calls are defined in Python (kiln/ops/cpu_fakes.py);
// these install host state only (catch-all kernels).
// The linear's row count from which tiles run; 0 where they do not run at all. Tiles and
// the register kernel both accumulate pair by pair in fp32, so their results are almost
// always the same bits and cannot tell the paths apart: tests read this instead.
int64_t amx_rows() {
#ifdef KILN_AMX
  return kiln_amx::state().enabled ? kiln_amx::state().min_rows : 0;
#else
  return 0;
#endif
}

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("set_amx(bool enabled, int min_rows=1) -> ()", &set_amx);
  m.def("amx_rows() -> int", &amx_rows);
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("linear_packed", &linear_packed);
  m.impl("linear_packed_silu", &linear_packed_silu);
  m.impl("linear_packed_rope", &linear_packed_rope);
}
