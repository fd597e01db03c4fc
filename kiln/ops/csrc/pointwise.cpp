// Three bf16 pointwise steps of a decoder layer, computed in fp32 and rounded where the
// reference's bf16 tensors round:
//   kiln_cpu::silu_and_mul       SwiGLU's activation: [T, 2I] (gate | up) -> [T, I];
//   kiln_cpu::rotary_embedding   Neox-style RoPE of q [T, H, D] and k [T, Hk, D];
//   kiln_cpu::add_rms_norm       the residual add and the RMSNorm after it: (x + d,
//                                w * norm(x + d)) over [T, H].
//
// Why they exist: kiln builds Inductor's fused kernels single-threaded on small hosts
// (kiln/compiler/build.py: a decode step's 120 OpenMP forks cost more than a second
// thread gains there), and at prefill sizes these were the largest of them: 2,000
// tokens of SmolLM2 spent 92 ms (SiLU) and 47 ms (RoPE) of a 640 ms prefill in them (Xeon,
// AMX), and later about 11% of a 0.4 s prefill in the norms. Here the rows are split
// across threads only when there are enough of them (a decode step stays on one thread).
// SiLU's exp is simd.h's polynomial rather than a libm-accurate one: the result is rounded
// to bf16 (2^-9) and the polynomial is within 3e-6.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <tuple>

#include "simd.h"

namespace {

namespace isa = kiln_isa;
using isa::V16;

using isa::silu_mul;

void silu_mul_row(const c10::BFloat16* x, c10::BFloat16* out, int64_t I) {
  int64_t j = 0;
  for (; j + 16 <= I; j += 16)
    isa::store_bf16(out + j, silu_mul(isa::load_bf16(x + j), isa::load_bf16(x + I + j)));
  if (j == I) return;
  alignas(64) c10::BFloat16 g[16] = {}, u[16] = {}, o[16];
  for (int64_t i = j; i < I; ++i) g[i - j] = x[i], u[i - j] = x[I + i];
  isa::store_bf16(o, silu_mul(isa::load_bf16(g), isa::load_bf16(u)));
  for (int64_t i = j; i < I; ++i) out[i] = o[i - j];
}

// Rows per thread's share at least this many elements: below, one thread does it all.
constexpr int64_t kGrainElements = 16384;

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) % 2 == 0,
              "silu_and_mul: bf16 [T, 2I]");
  const auto xc = x.contiguous();
  const int64_t T = xc.size(0), I = xc.size(1) / 2;
  auto out = at::empty({T, I}, xc.options());
  const auto* p = xc.data_ptr<c10::BFloat16>();
  auto* o = out.data_ptr<c10::BFloat16>();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(I, 1));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(p + r * 2 * I, o + r * I, I);
  });
  return out;
}

// positions as int64, contiguous, each checked to lie in the caches' P rows: RoPE reads
// those rows unchecked (for_rope_tokens here, RopeEpilogue in linear_bf16_amx.h). A serial
// pass over one int64 a token: nothing beside the rotation it guards.
at::Tensor checked_positions(const char* op, const at::Tensor& positions, int64_t P) {
  auto pos = positions.to(at::kLong).contiguous();
  const auto* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.numel(); ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < P, op, ": position ", pp[t], " outside the cache of ", P,
                " positions");
  return pos;
}

namespace {

// One token's heads: out[i] = x[i] c[i] - x[i + h] s[i], out[i + h] = x[i + h] c[i + h] +
// x[i] s[i + h] (x * cos + rotate_half(x) * sin), h = D / 2 a multiple of 16. c and s are
// the token's cos and sin rows already rounded to bf16, as the reference casts them.
void rope_heads(const c10::BFloat16* x, int64_t head_stride, int64_t heads, int64_t D,
                const float* c, const float* s, c10::BFloat16* out) {
  const int64_t h = D / 2;
  for (int64_t n = 0; n < heads; ++n, x += head_stride, out += D) {
    for (int64_t i = 0; i < h; i += 16) {
      const V16 x1 = isa::load_bf16(x + i), x2 = isa::load_bf16(x + h + i);
      isa::store_bf16(out + i, isa::fnmadd(x2, isa::loadu(s + i),
                                           isa::mul(x1, isa::loadu(c + i))));
      isa::store_bf16(out + h + i, isa::fmadd(x1, isa::loadu(s + h + i),
                                              isa::mul(x2, isa::loadu(c + h + i))));
    }
  }
}

constexpr int64_t kMaxHeadDim = 512;  // the per-thread cos / sin rows live on the stack

// A fp32 row rounded to bf16 and widened back (exact), D a multiple of 16.
void bf16_row(const float* src, float* dst, int64_t D) {
  alignas(64) c10::BFloat16 b[16];
  for (int64_t i = 0; i < D; i += 16) {
    isa::store_bf16(b, isa::loadu(src + i));
    isa::storeu(dst + i, isa::load_bf16(b));
  }
}

// fn(t, cos, sin) for each token t of `positions`, the token's cos and sin rows of the
// float32 caches [P, D] rounded to bf16 (as the reference casts them); tokens split
// across threads from kGrainElements elements (`per_token` each) on. The positions are
// checked first (checked_positions), so the loop reads the caches unchecked.
template <class Fn>
void for_rope_tokens(const char* op, const at::Tensor& positions, const at::Tensor& cos,
                     const at::Tensor& sin, int64_t per_token, const Fn& fn) {
  const auto pos = checked_positions(op, positions, cos.size(0));
  const int64_t T = pos.numel(), D = cos.size(1);
  const auto* pp = pos.data_ptr<int64_t>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(per_token, 1));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float cs[2 * kMaxHeadDim];  // the token's bf16-rounded cos and sin rows
    for (int64_t t = begin; t < end; ++t) {
      bf16_row(cp + pp[t] * D, cs, D);
      bf16_row(sp + pp[t] * D, cs + D, D);
      fn(t, cs, cs + D);
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions,
                                                    const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& cos,
                                                    const at::Tensor& sin) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  q.dim() == 3 && k.dim() == 3 && q.size(2) == k.size(2) &&
                  q.size(2) % 32 == 0 && q.stride(2) == 1 && k.stride(2) == 1 &&
                  q.size(0) == k.size(0) && q.size(2) <= kMaxHeadDim,
              "rotary_embedding: bf16 q [T, H, D] and k [T, Hk, D], D % 32 == 0 and at most ",
              kMaxHeadDim, ", the last dimension contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == q.size(2),
              "rotary_embedding: float32 cos and sin caches [P, D]");
  const int64_t T = q.size(0), H = q.size(1), Hk = k.size(1), D = q.size(2);
  TORCH_CHECK(positions.numel() == T, "rotary_embedding: one position per token");
  auto qo = at::empty({T, H, D}, q.options()), ko = at::empty({T, Hk, D}, k.options());
  const auto *qp = q.data_ptr<c10::BFloat16>(), *kp = k.data_ptr<c10::BFloat16>();
  auto *qop = qo.data_ptr<c10::BFloat16>(), *kop = ko.data_ptr<c10::BFloat16>();
  for_rope_tokens("rotary_embedding", positions, cos, sin, (H + Hk) * D,
                  [&](int64_t t, const float* c, const float* s) {
                    rope_heads(qp + t * q.stride(0), q.stride(1), H, D, c, s, qop + t * H * D);
                    rope_heads(kp + t * k.stride(0), k.stride(1), Hk, D, c, s,
                               kop + t * Hk * D);
                  });
  return {qo, ko};
}

// y's first rope_cols columns rotated in place, heads of D = cos.size(1): the rotation of
// kiln_cpu::linear_packed_rope off tiles (linear_bf16.cpp). In place is safe: rope_heads
// reads both halves of a head's 16 columns before it writes them.
void rope_columns_(at::Tensor& y, const at::Tensor& positions, const at::Tensor& cos,
                   const at::Tensor& sin, int64_t rope_cols) {
  const int64_t D = cos.size(1), N = y.size(1);
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.dim() == 2 && y.is_contiguous() &&
                  D % 32 == 0 && D <= kMaxHeadDim && rope_cols % D == 0 && rope_cols <= N &&
                  positions.numel() == y.size(0),
              "linear_packed_rope: bf16 rows whose first rope_cols columns are heads of D, ",
              "D % 32 == 0 and at most ", kMaxHeadDim);
  auto* yp = y.data_ptr<c10::BFloat16>();
  for_rope_tokens("linear_packed_rope", positions, cos, sin, rope_cols,
                  [&](int64_t t, const float* c, const float* s) {
                    rope_heads(yp + t * N, D, rope_cols / D, D, c, s, yp + t * N);
                  });
}

namespace {

// One row of H (a multiple of 16): h = bf16(x + d); out = bf16(w * bf16(h * r)) with
// r = 1 / sqrt(mean(h^2) + eps) over the bf16 h in fp32: RMSNorm's rounding points
// (kiln/models/layers.py), the sum of squares in another order than torch's.
void add_rms_norm_row(const c10::BFloat16* x, const c10::BFloat16* d,
                      const c10::BFloat16* w, c10::BFloat16* h, c10::BFloat16* out,
                      int64_t H, float eps) {
  V16 squares = isa::zero();
  for (int64_t j = 0; j < H; j += 16) {
    const V16 v = isa::round_bf16(isa::add(isa::load_bf16(x + j), isa::load_bf16(d + j)));
    isa::store_bf16(h + j, v);  // exact: v is a bf16 value
    squares = isa::fmadd(v, v, squares);
  }
  const V16 r = isa::set1(1.f / std::sqrt(isa::reduce_add(squares) / H + eps));
  for (int64_t j = 0; j < H; j += 16)
    isa::store_bf16(out + j, isa::mul(isa::load_bf16(w + j),
                                      isa::round_bf16(isa::mul(isa::load_bf16(h + j), r))));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& d,
                                                const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && d.scalar_type() == at::kBFloat16 &&
                  w.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.sizes() == d.sizes() &&
                  w.dim() == 1 && w.size(0) == x.size(1) && x.size(1) % 16 == 0,
              "add_rms_norm: bf16 x and d [T, H], weight [H], H % 16 == 0");
  const auto xc = x.contiguous(), dc = d.contiguous(), wc = w.contiguous();
  const int64_t T = xc.size(0), H = xc.size(1);
  auto h = at::empty({T, H}, xc.options()), out = at::empty({T, H}, xc.options());
  const auto *xp = xc.data_ptr<c10::BFloat16>(), *dp = dc.data_ptr<c10::BFloat16>();
  const auto* wp = wc.data_ptr<c10::BFloat16>();
  auto *hp = h.data_ptr<c10::BFloat16>(), *op = out.data_ptr<c10::BFloat16>();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(H, 1));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      add_rms_norm_row(xp + t * H, dp + t * H, wp, hp + t * H, op + t * H, H,
                       static_cast<float>(eps));
  });
  return {h, out};
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}
