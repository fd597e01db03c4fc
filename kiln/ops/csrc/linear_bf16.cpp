// kiln_cpu::linear_packed — y = x @ w.T (+ b) in bf16 over a prepacked weight.
//
// Why it exists: oneDNN's bf16 GEMM reorders the whole weight on every call when it is
// not prepacked, and its bf16 GEMV reaches about half the bandwidth of its fp32 GEMV on
// these machines; decode-sized linears are memory-bound, so both cost directly.
//
// The weight is packed once at load time (`pack` in kiln/ops/linear.py) into the layout
// AMX's B tiles read, which also suits AVX512-BF16's `vdpbf16ps`:
//     wp[N/16, K/32, 16, 32]: wp[nb, kc, r, 2 * n + i] = w[16 * nb + n, 32 * kc + 2 * r + i]
// i.e. for each 16-column block and 32-deep K chunk, one 1 KiB tile whose row r holds the
// (k, k+1) pairs of 16 output columns. Every block streams contiguously.
//
//   * without AMX, up to kGemvRows input rows: AVX512-BF16, each weight tile read once,
//     fp32 sums kept
//     per output column (no horizontal reductions), prefetching ahead;
//   * with AMX, any row count: 16x32 x tiles against the weight tiles, fp32 tile accumulators;
//   * more rows without AMX: the weight is unpacked and at::linear does the GEMM.
// Accumulation is fp32; each output is rounded to bf16 once, after the bias.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>

namespace {

// Rows up to which the AVX512-BF16 GEMV runs. With AMX the tiles win even at one row
// (measured over SmolLM2's 30 layers, interleaved: 9.3 ms vs 11.4 ms at M=1, 15 vs 28 ms
// at M=4), so the GEMV serves only CPUs without AMX (e.g. Zen 4).
constexpr int64_t kGemvRows = 4;
bool amx_enabled = false;
constexpr int64_t kAhead = 4;
inline int64_t gemv_rows() { return amx_enabled ? 0 : kGemvRows; }

inline __m512 bias16(const c10::BFloat16* bias, int64_t n0) {
  if (bias == nullptr) return _mm512_setzero_ps();
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + n0));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store_bf16(c10::BFloat16* y, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}

// Column block nb for MB input rows (MB a template parameter: accumulators in registers).
// Two accumulators per row (even/odd tile rows) halve the dependency chain.
template <int MB>
void gemv_block(const uint16_t* x, const uint16_t* wp, const c10::BFloat16* bias,
                c10::BFloat16* y, int64_t K, int64_t N, int64_t nb) {
  const int64_t chunks = K / 32;
  const uint16_t* w = wp + nb * chunks * 512;
  __m512 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kc = 0; kc < chunks; ++kc, w += 512) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 2048), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 2048 + 256), _MM_HINT_T0);
    for (int r = 0; r < 16; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * 32);
      for (int m = 0; m < MB; ++m) {
        uint32_t pair;
        std::memcpy(&pair, x + m * K + kc * 32 + 2 * r, 4);
        acc[m][r & 1] = _mm512_dpbf16_ps(acc[m][r & 1], (__m512bh)_mm512_set1_epi32(pair), wv);
      }
    }
  }
  const __m512 b = bias16(bias, nb * 16);
  for (int m = 0; m < MB; ++m)
    store_bf16(y + m * N + nb * 16, _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), b));
}

void gemv(const uint16_t* x, const uint16_t* wp, const c10::BFloat16* bias,
          c10::BFloat16* y, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N / 16, 4, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      switch (M) {
        case 1: gemv_block<1>(x, wp, bias, y, K, N, nb); break;
        case 2: gemv_block<2>(x, wp, bias, y, K, N, nb); break;
        case 3: gemv_block<3>(x, wp, bias, y, K, N, nb); break;
        default: gemv_block<4>(x, wp, bias, y, K, N, nb); break;
      }
    }
  });
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0-3 accumulators C[a][b] (a: 16-row x block, b: 16-column w block), 4-5 x
// tiles, 6-7 weight tiles.
void configure(int64_t rows0, int64_t rows1) {
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

// Up to 32 x rows starting at m0 against column blocks nb and nb + 1 (when `pair`).
void amx_tile(const uint16_t* x, const uint16_t* wp, const c10::BFloat16* bias,
              c10::BFloat16* y, int64_t K, int64_t N, int64_t m0, int64_t rows0,
              int64_t rows1, int64_t nb, bool pair) {
  const int64_t chunks = K / 32, xs = K * 2;
  const uint16_t* w0 = wp + nb * chunks * 512;
  const uint16_t* w1 = w0 + chunks * 512;
  const uint16_t* x0 = x + m0 * K;
  const uint16_t* x1 = x0 + 16 * K;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t kc = 0; kc < chunks; ++kc) {
    {  // the weight tiles a few chunks ahead (measured: ~25% faster at 1-4 rows)
      const char* ahead0 = reinterpret_cast<const char*>(w0 + (kc + kAhead) * 512);
      const char* ahead1 = reinterpret_cast<const char*>(w1 + (kc + kAhead) * 512);
      for (int line = 0; line < 1024; line += 64) {
        _mm_prefetch(ahead0 + line, _MM_HINT_T0);
        if (pair) _mm_prefetch(ahead1 + line, _MM_HINT_T0);
      }
    }
    _tile_loadd(4, x0 + kc * 32, xs);
    _tile_loadd(6, w0 + kc * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (pair) { _tile_loadd(7, w1 + kc * 512, 64); _tile_dpbf16ps(1, 4, 7); }
    if (rows1 > 0) {
      _tile_loadd(5, x1 + kc * 32, xs);
      _tile_dpbf16ps(2, 5, 6);
      if (pair) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[4][16][16];
  _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
  const int64_t rows[2] = {rows0, rows1};
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < (pair ? 2 : 1); ++b) {
      const __m512 bv = bias16(bias, (nb + b) * 16);
      for (int64_t i = 0; i < rows[a]; ++i)
        store_bf16(y + (m0 + a * 16 + i) * N + (nb + b) * 16,
                   _mm512_add_ps(_mm512_load_ps(c[a * 2 + b][i]), bv));
    }
}

void amx_gemm(const uint16_t* x, const uint16_t* wp, const c10::BFloat16* bias,
              c10::BFloat16* y, int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = N / 16, pairs = (blocks + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    int64_t configured = -1;
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      const int64_t rows0 = std::min<int64_t>(16, M - m0);
      const int64_t rows1 = std::min<int64_t>(16, std::max<int64_t>(0, M - m0 - 16));
      if (configured != rows0 * 32 + rows1) {
        configure(rows0, rows1);
        configured = rows0 * 32 + rows1;
      }
      for (int64_t p = begin; p < end; ++p)
        amx_tile(x, wp, bias, y, K, N, m0, rows0, rows1, 2 * p, 2 * p + 1 < blocks);
    }
    _tile_release();
  });
}

}  // namespace

at::Tensor unpack(const at::Tensor& wp) {
  const int64_t nb = wp.size(0), kc = wp.size(1);
  return wp.view({nb, kc, 16, 16, 2}).permute({0, 3, 1, 2, 4}).reshape({nb * 16, kc * 32});
}

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& wp,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16 &&
                  x.dim() == 2 && wp.dim() == 4 && wp.size(2) == 16 && wp.size(3) == 32 &&
                  wp.is_contiguous(),
              "linear_packed: bf16 x [M, K] and a packed weight [N/16, K/32, 16, 32]");
  const int64_t M = x.size(0), K = wp.size(1) * 32, N = wp.size(0) * 16;
  TORCH_CHECK(x.size(1) == K, "linear_packed: x has ", x.size(1), " columns, weight ", K);
  c10::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kBFloat16).contiguous();
  if (M > kGemvRows && !amx_enabled) return at::linear(x, unpack(wp), b);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto xc = x.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* wptr = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  const c10::BFloat16* bp = b ? b->data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
  if (M <= gemv_rows()) {
    gemv(xp, wptr, bp, yp, M, K, N);
  } else {
    amx_gemm(xp, wptr, bp, yp, M, K, N);
  }
  return y;
}

// Python enables AMX for the process first (torch.cpu._init_amx: the kernel must grant
// the tile state); only then may the AMX path run.
void set_amx(bool enabled) { amx_enabled = enabled; }

TORCH_LIBRARY(kiln_cpu, m) {
  m.def("linear_packed(Tensor x, Tensor wp, Tensor? bias) -> Tensor");
  m.def("set_amx(bool enabled) -> ()", &set_amx);
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("linear_packed", &linear_packed);
}
