// kiln_cpu::linear_bf16 — y = x @ w.T (+ b) for bf16 on CPUs with AVX512-BF16.
//
// Why it exists: at decode sizes (a handful of rows) a linear layer is a memory-bound
// GEMV, and oneDNN's bf16 GEMV reaches about half the bandwidth its fp32 GEMV does on
// these machines. This kernel streams each weight row once with `vdpbf16ps`
// (bf16 pairs, fp32 accumulation) and prefetches a few rows ahead, which keeps two
// cores near DRAM bandwidth. Larger row counts are compute-bound, where oneDNN's
// AMX/AVX512 GEMM wins, so they go to at::linear.
//
// Invariants: x [M, K] and w [N, K] are contiguous bf16 on the CPU; bias, when given,
// is bf16 [N]. Accumulation is fp32; each output is rounded to bf16 once, after the
// bias, as F.linear does.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>

namespace {

constexpr int kRows = 4;       // weight rows per inner step (4 independent accumulators)
constexpr int kMBlock = 4;     // input rows sharing one pass over a weight tile
constexpr int kPrefetch = 8;   // rows ahead to prefetch (measured best of 4/8/16/32)

inline uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40);
  b += 0x7fffu + ((b >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(b >> 16);
}

inline float from_bf16(uint16_t h) {
  uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline __m512bh load(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// Rows [n0, n0 + rows) of w against input rows [m0, m0 + mb) of x.
template <int R>
void tile(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
          int64_t K, int64_t N, int64_t n0, int64_t m0, int64_t mb, bool prefetch) {
  __m512 acc[kMBlock][R];
  for (int m = 0; m < kMBlock; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t left = K - k;
    const __mmask32 mask = left >= 32 ? 0xffffffffu : ((1u << left) - 1u);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) {
      const uint16_t* row = w + (n0 + r) * K + k;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetch * K),
                                 _MM_HINT_T0);
      wv[r] = load(row, mask);
    }
    for (int m = 0; m < mb; ++m) {
      const __m512bh xv = load(x + (m0 + m) * K + k, mask);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < mb; ++m)
    for (int r = 0; r < R; ++r) {
      float s = _mm512_reduce_add_ps(acc[m][r]);
      if (bias) s += from_bf16(bias[n0 + r]);
      y[(m0 + m) * N + n0 + r] = to_bf16(s);
    }
}

}  // namespace

// Row counts up to this go through the streaming kernel; above it, at::linear.
constexpr int64_t kMaxGemvRows = 4;  // measured: 8 rows is slower than at::linear

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "linear_bf16 takes bf16 tensors");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear_bf16: x [M, K] and w [N, K] expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (M > kMaxGemvRows || M == 0) return at::linear(x, w, bias);
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto y = at::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  const uint16_t* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->to(at::kBFloat16).contiguous();
    bp = reinterpret_cast<const uint16_t*>(bc.data_ptr());
  }
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t groups = N / kRows;
  // Each task owns whole weight-row groups, so every weight byte is read by one thread.
  at::parallel_for(0, groups + 1, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t m0 = 0; m0 < M; m0 += kMBlock) {
        const int64_t mb = std::min<int64_t>(kMBlock, M - m0);
        if (g < groups) {
          tile<kRows>(xp, wp, bp, yp, K, N, g * kRows, m0, mb, m0 == 0);
        } else {
          for (int64_t n = groups * kRows; n < N; ++n)
            tile<1>(xp, wp, bp, yp, K, N, n, m0, mb, false);
        }
      }
    }
  });
  return y;
}

TORCH_LIBRARY(kiln_cpu, m) {
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
}
