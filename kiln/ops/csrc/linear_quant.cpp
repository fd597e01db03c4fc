// kiln_cpu::linear_quant: the fp32 kernels (every ISA class) and the op. The formats and
// the two paths are described in linear_quant.h; the native-bf16 kernels live in
// linear_quant_bf16.cpp.
#include "kept_rows.h"
#include "linear_quant.h"

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <memory>

namespace {

using namespace kiln_quant;

// Rows m0..m0+MR against column blocks nb..nb+NR. Two sets of chunk sums (even and odd
// k for int8 codes, low and high nibbles for Q4) double the independent FMA chains: with
// one set a single row is bound by FMA latency, not by loads or throughput.
template <int F, int MR, int NR>
void direct(const QArgs& a, int64_t m0, int64_t nb) {
  const int64_t chunks = a.K / 32;
  const float* x[MR];
  for (int m = 0; m < MR; ++m) x[m] = a.xf + (m0 + m) * a.K;
  V16 acc[MR][NR], g[MR][NR], h[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = g[m][j] = h[m][j] = kiln_isa::zero();
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const int64_t k0 = kc * 32;
    if constexpr (F == kQ4) {
      const uint8_t* c[NR];
      for (int j = 0; j < NR; ++j)
        c[j] = static_cast<const uint8_t*>(a.codes) + ((nb + j) * chunks + kc) * 256;
      for (int jj = 0; jj < 16; ++jj) {  // k0 + jj (low nibbles) and k0 + jj + 16 (high)
        V16 lo[NR], hi[NR];
        if (jj % 4 == 0) prefetch_ahead<NR>(c, jj * 16);
        for (int j = 0; j < NR; ++j) kiln_isa::load_u4q(c[j] + (jj / 4) * 64, jj % 4, lo[j], hi[j]);
        for (int m = 0; m < MR; ++m) {
          const V16 xa = kiln_isa::set1(x[m][k0 + jj]), xb = kiln_isa::set1(x[m][k0 + jj + 16]);
          for (int j = 0; j < NR; ++j) {
            g[m][j] = kiln_isa::fmadd(xa, lo[j], g[m][j]);
            h[m][j] = kiln_isa::fmadd(xb, hi[j], h[m][j]);
          }
        }
      }
    } else {
      const int8_t* c[NR];
      for (int j = 0; j < NR; ++j)
        c[j] = static_cast<const int8_t*>(a.codes) + ((nb + j) * chunks + kc) * 512;
      for (int kk = 0; kk < 32; kk += 2) {
        V16 w0[NR], w1[NR];
        if (kk % 4 == 0) prefetch_ahead<NR>(c, kk * 16);
        for (int j = 0; j < NR; ++j) {
          w0[j] = kiln_isa::load_i8(c[j] + kk * 16);
          w1[j] = kiln_isa::load_i8(c[j] + (kk + 1) * 16);
        }
        for (int m = 0; m < MR; ++m) {
          const V16 xa = kiln_isa::set1(x[m][k0 + kk]), xb = kiln_isa::set1(x[m][k0 + kk + 1]);
          for (int j = 0; j < NR; ++j) {
            g[m][j] = kiln_isa::fmadd(xa, w0[j], g[m][j]);
            h[m][j] = kiln_isa::fmadd(xb, w1[j], h[m][j]);
          }
        }
      }
    }
    if constexpr (F != kInt8) {  // fold the chunk: acc += d * (g + h) (+ m * sum(x))
      for (int j = 0; j < NR; ++j) {
        const int64_t off = ((nb + j) * chunks + kc) * 16;
        _mm_prefetch(reinterpret_cast<const char*>(a.scale16 + off) + kAheadBytes / 8,
                     _MM_HINT_T0);
        if constexpr (F == kQ4)
          _mm_prefetch(reinterpret_cast<const char*>(a.min16 + off) + kAheadBytes / 8,
                       _MM_HINT_T0);
        const V16 d = kiln_isa::load_f16(a.scale16 + off);
        const V16 mn = F == kQ4 ? kiln_isa::load_f16(a.min16 + off) : kiln_isa::zero();
        for (int m = 0; m < MR; ++m) {
          acc[m][j] = kiln_isa::fmadd(kiln_isa::add(g[m][j], h[m][j]), d, acc[m][j]);
          if constexpr (F == kQ4)
            acc[m][j] = kiln_isa::fmadd(kiln_isa::set1(a.xsum[(m0 + m) * chunks + kc]), mn,
                                        acc[m][j]);
          g[m][j] = h[m][j] = kiln_isa::zero();
        }
      }
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t col = (nb + j) * 16;
    for (int m = 0; m < MR; ++m) {
      V16 v = acc[m][j];
      if constexpr (F == kInt8)
        v = kiln_isa::mul(kiln_isa::add(g[m][j], h[m][j]), kiln_isa::loadu(a.scale32 + col));
      store_out(a, m0 + m, col, finish(a, v, col));
    }
  }
}

using DirectFn = void (*)(const QArgs&, int64_t, int64_t);

template <int F, int MR>
DirectFn direct_for_blocks(int nr) {
  if constexpr (kiln_isa::kQuantBlocks >= 2) {
    if (nr == 2) return direct<F, MR, 2>;
  }
  return direct<F, MR, 1>;
}

template <int F>
DirectFn direct_fn(int mr, int nr) {
  static_assert(kiln_isa::kQuantRows <= 4 && kiln_isa::kQuantBlocks <= 2,
                "direct_fn covers tiles of up to 4 rows x 2 blocks");
  switch (mr) {
    case 4: if constexpr (kiln_isa::kQuantRows >= 4) return direct_for_blocks<F, 4>(nr);
            [[fallthrough]];
    case 3: if constexpr (kiln_isa::kQuantRows >= 3) return direct_for_blocks<F, 3>(nr);
            [[fallthrough]];
    case 2: return direct_for_blocks<F, 2>(nr);
    default: return direct_for_blocks<F, 1>(nr);
  }
}

template <int F>
void direct_gemm(const QArgs& a) {
  constexpr int MR = kiln_isa::kQuantRows;
  // One row reads each weight once: one block at a time, one sequential stream per thread
  // (see kAheadBytes); several rows share each weight load over kQuantBlocks blocks.
  const int NR = a.M == 1 ? 1 : kiln_isa::kQuantBlocks;
  // Threads split the column blocks: each weight byte is read by one thread only.
  at::parallel_for(0, a.N / 16, NR, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; nb += NR) {
      const int nr = static_cast<int>(std::min<int64_t>(NR, end - nb));
      for (int64_t m = 0; m < a.M; m += MR)
        direct_fn<F>(static_cast<int>(std::min<int64_t>(MR, a.M - m)), nr)(a, m, nb);
    }
  });
}

// Column block nb, whole K, dequantized into panel[K][16].
template <int F>
void dequant_block(const QArgs& a, int64_t nb, float* panel) {
  const int64_t chunks = a.K / 32;
  const V16 s = F == kInt8 ? kiln_isa::loadu(a.scale32 + nb * 16) : kiln_isa::zero();
  for (int64_t kc = 0; kc < chunks; ++kc) {
    float* p = panel + kc * 32 * 16;
    const int64_t off = (nb * chunks + kc) * 16;
    if constexpr (F == kQ4) {
      const uint8_t* c = static_cast<const uint8_t*>(a.codes) + (nb * chunks + kc) * 256;
      const V16 d = kiln_isa::load_f16(a.scale16 + off), mn = kiln_isa::load_f16(a.min16 + off);
      for (int jj = 0; jj < 16; ++jj) {
        V16 lo, hi;
        kiln_isa::load_u4q(c + (jj / 4) * 64, jj % 4, lo, hi);
        kiln_isa::storeu(p + jj * 16, kiln_isa::fmadd(lo, d, mn));
        kiln_isa::storeu(p + (jj + 16) * 16, kiln_isa::fmadd(hi, d, mn));
      }
    } else {
      const int8_t* c = static_cast<const int8_t*>(a.codes) + (nb * chunks + kc) * 512;
      const V16 d = F == kQ8 ? kiln_isa::load_f16(a.scale16 + off) : s;
      for (int kk = 0; kk < 32; ++kk)
        kiln_isa::storeu(p + kk * 16, kiln_isa::mul(kiln_isa::load_i8(c + kk * 16), d));
    }
  }
}

template <int R>
void panel_rows(const QArgs& a, const float* panel, int64_t m0, int64_t nb) {
  const float* x[R];
  V16 acc[R];
  for (int m = 0; m < R; ++m) {
    x[m] = a.xf + (m0 + m) * a.K;
    acc[m] = kiln_isa::zero();
  }
  for (int64_t k = 0; k < a.K; ++k) {
    const V16 w = kiln_isa::loadu(panel + k * 16);
    for (int m = 0; m < R; ++m) acc[m] = kiln_isa::fmadd(kiln_isa::set1(x[m][k]), w, acc[m]);
  }
  for (int m = 0; m < R; ++m) store_out(a, m0 + m, nb * 16, finish(a, acc[m], nb * 16));
}

using PanelFn = void (*)(const QArgs&, const float*, int64_t, int64_t);
template <int... R>
constexpr PanelFn kPanelTable[] = {panel_rows<R>...};
constexpr const PanelFn* kPanel = kPanelTable<1, 2, 3, 4, 5, 6, 7, 8>;  // kPanel[rows - 1]
static_assert(kiln_isa::kQuantPanelRows <= 8, "kPanel covers tiles of 1 to 8 rows");

template <int F>
void panel_gemm(const QArgs& a) {
  constexpr int64_t R = kiln_isa::kQuantPanelRows;
  // Row blocks of equal size (whole tiles) whose x fits kPanelXBytes.
  const int64_t fit = std::max<int64_t>(R, kPanelXBytes / (a.K * 4) / R * R);
  const int64_t blocks = (a.M + fit - 1) / fit;
  const int64_t block = ((a.M + blocks - 1) / blocks + R - 1) / R * R;
  at::parallel_for(0, a.N / 16, 1, [&](int64_t begin, int64_t end) {
    const auto panel = kiln_isa::aligned_buffer<float>(a.K * 16);
    for (int64_t mb = 0; mb < a.M; mb += block) {
      const int64_t me = std::min(a.M, mb + block);
      for (int64_t nb = begin; nb < end; ++nb) {
        dequant_block<F>(a, nb, panel.get());
        for (int64_t m = mb; m < me; m += R)
          kPanel[std::min<int64_t>(R, me - m) - 1](a, panel.get(), m, nb);
      }
    }
  });
}

template <int F>
void run(const QArgs& a, bool panel, const at::Tensor& x) {
  if (x.scalar_type() == at::kBFloat16) {
    if (!panel && F == kQ4 && q4_x8_gemm(a)) return;
    if (!panel && F == kQ8 && q8_x8_gemm(a)) return;
  }
  if (panel) panel_gemm<F>(a);
  else direct_gemm<F>(a);
}

}  // namespace

namespace {

void check_args(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                const c10::optional<at::Tensor>& mins, int64_t fmt) {
  TORCH_CHECK(fmt == kInt8 || fmt == kQ8 || fmt == kQ4, "linear_quant: unknown format ", fmt);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "linear_quant: x must be fp32 or bf16 [M, K]");
  const int64_t chunk_bytes = fmt == kQ4 ? 256 : 512;
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == chunk_bytes && codes.is_contiguous() &&
                  codes.element_size() == 1,
              "linear_quant: codes must be [N/16, K/32, ", chunk_bytes, "] bytes");
  const int64_t N = codes.size(0) * 16, K = codes.size(1) * 32;
  TORCH_CHECK(x.size(1) == K, "linear_quant: x has ", x.size(1), " columns, weight ", K);
  if (fmt == kInt8) {
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == N &&
                scales.is_contiguous(), "linear_quant: int8 scales must be fp32 [N]");
  } else {
    TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.numel() == N * K / 32 &&
                scales.is_contiguous(), "linear_quant: scales must be fp16 [N/16, K/32, 16]");
  }
  const bool has_min = mins.has_value() && mins->defined();
  TORCH_CHECK(fmt != kQ4 || (has_min && mins->scalar_type() == at::kHalf &&
                             mins->numel() == N * K / 32 && mins->is_contiguous()),
              "linear_quant: Q4 needs fp16 mins [N/16, K/32, 16]");
}

// The weight's pointers, bias and output; x's (xf, xsum) are filled by the caller.
QArgs weight_args(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& mins, const at::Tensor& b, at::Tensor& y,
                  int64_t fmt) {
  return QArgs{nullptr,
               nullptr,
               codes.data_ptr(),
               fmt == kInt8 ? scales.data_ptr<float>() : nullptr,
               fmt == kInt8 ? nullptr : reinterpret_cast<const uint16_t*>(scales.data_ptr()),
               fmt == kQ4 ? reinterpret_cast<const uint16_t*>(mins->data_ptr()) : nullptr,
               b.defined() ? b.data_ptr<float>() : nullptr,
               y.data_ptr(), x.scalar_type() == at::kBFloat16,
               x.size(0), codes.size(1) * 32, codes.size(0) * 16};
}

at::Tensor quant_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& mins,
                         const c10::optional<at::Tensor>& bias, int64_t fmt,
                         int64_t panel_from) {
  check_args(x, codes, scales, mins, fmt);
  const int64_t N = codes.size(0) * 16, K = codes.size(1) * 32, M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto xc = x.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  QArgs a = weight_args(xc, codes, scales, mins, b, y, fmt);
  const bool panel = panel_from > 0 && M >= panel_from;
  // The native-bf16 panel reads bf16 x as it is: neither the fp32 copy nor the Q4 chunk
  // sums below (single-threaded, 26 MB written per SmolLM2 layer at 2,000 rows) are
  // made for it.
  if (panel && x.scalar_type() == at::kBFloat16 &&
      bf16_panel(a, reinterpret_cast<const uint16_t*>(xc.data_ptr()), fmt))
    return y;
  // x widened and the Q4 chunk sums taken here, not through ATen ops: at decode sizes
  // their dispatch cost more than the loops (measured 0.2 ms per SmolLM2 step).
  std::unique_ptr<float[]> xwide, xsum;
  const float* xf = nullptr;
  if (x.scalar_type() == at::kFloat) {
    xf = xc.data_ptr<float>();
  } else {
    xwide.reset(new float[M * K]);  // K % 32 == 0: whole V16s
    const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr());
    for (int64_t i = 0; i < M * K; i += 16)
      kiln_isa::storeu(xwide.get() + i, kiln_isa::load_bf16(xb + i));
    xf = xwide.get();
  }
  if (fmt == kQ4) {
    xsum.reset(new float[M * K / 32]);
    for (int64_t i = 0; i < M * K / 32; ++i)
      xsum[i] = kiln_isa::reduce_add(kiln_isa::add(kiln_isa::loadu(xf + i * 32),
                                                   kiln_isa::loadu(xf + i * 32 + 16)));
  }
  a.xf = xf;
  a.xsum = xsum.get();
  switch (fmt) {
    case kInt8: run<kInt8>(a, panel, xc); break;
    case kQ8: run<kQ8>(a, panel, xc); break;
    default: run<kQ4>(a, panel, xc); break;
  }
  return y;
}

}  // namespace

at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins,
                        const c10::optional<at::Tensor>& bias, int64_t fmt, int64_t panel_from,
                        const c10::optional<at::Tensor>& rows) {
  return kiln_rows::on_kept_rows(x, rows, codes.size(0) * 16, [&](const at::Tensor& xs) {
    return quant_product(xs, codes, scales, mins, bias, fmt, panel_from);
  });
}

at::Tensor silu_and_mul(const at::Tensor& x);  // pointwise.cpp

namespace {

// silu_and_mul(linear_quant(x, ...)) for SwiGLU's [gate | up] projection (no bias), the
// same bits: at panel row counts on AVX512-BF16 hosts the activation runs in the native-bf16
// panel's epilogue (linear_quant_bf16.cpp: not writing and reading back the [M, N] product),
// elsewhere the two steps run one after the other.
at::Tensor quant_silu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& mins, int64_t fmt, int64_t panel_from) {
  check_args(x, codes, scales, mins, fmt);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_quant_silu: bf16 x");
  const int64_t M = x.size(0), N = codes.size(0) * 16;
  if (panel_from > 0 && M >= panel_from && M > 0 &&
      codes.size(0) % 2 == 0) {
    auto y = at::empty({M, N / 2}, x.options());
    const auto xc = x.contiguous();
    const QArgs a = weight_args(xc, codes, scales, mins, at::Tensor(), y, fmt);
    if (bf16_panel_silu(a, reinterpret_cast<const uint16_t*>(xc.data_ptr()), fmt)) return y;
  }
  return silu_and_mul(quant_product(x, codes, scales, mins, c10::nullopt, fmt, panel_from));
}

}  // namespace

at::Tensor linear_quant_silu(const at::Tensor& x, const at::Tensor& codes,
                             const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                             int64_t fmt, int64_t panel_from,
                             const c10::optional<at::Tensor>& rows) {
  return kiln_rows::on_kept_rows(x, rows, codes.size(0) * 8, [&](const at::Tensor& xs) {
    return quant_silu(xs, codes, scales, mins, fmt, panel_from);
  });
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("linear_quant", &linear_quant);
  m.impl("linear_quant_silu", &linear_quant_silu);
}
