// kiln_cpu::greedy_argmax — the greedy token of each row of bf16 logits [R, V], read once.
//
// Why it exists: the sampler's general path widens the logits to fp32 (a 6 MiB write at
// 32 rows of a 49k vocabulary) and then runs ATen's argmax over them, about 1.6 ms per
// 32-row step on two AVX2 cores; ATen's bf16 argmax is slower still. A greedy step with
// nothing else to apply needs only the index of each row's maximum.
//
// Same answer as torch.argmax: the first index of the maximum (bf16 ties are common, so
// this matters). -inf is an ordinary value here: structured output masks forbidden tokens
// with it, and those steps must stay on this path. Rows with a NaN or +inf are not
// decided here: the row's result is -1 and the caller falls back to ATen, whose NaN
// semantics then apply. (Each v is first raised to at least -FLT_MAX, which keeps a NaN
// (x86 max returns its second operand when one is NaN); then 0 * v is NaN exactly for NaN
// and +inf, so one sum finds them.)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <cfloat>
#include <cmath>

#include "simd.h"

namespace {

int64_t argmax_row(const c10::BFloat16* x, int64_t V) {
  using namespace kiln_isa;
  const int64_t whole = V / 16 * 16;
  V16 m = set1(-INFINITY), check = zero();
  const V16 nothing = zero(), lowest = set1(-FLT_MAX);
  for (int64_t i = 0; i < whole; i += 16) {
    const V16 v = load_bf16(x + i);
    m = max(m, v);
    check = fmadd(max(lowest, v), nothing, check);  // NaN from here on iff a NaN or +inf
  }
  float best = reduce_max(m), finite_check = reduce_add(check);
  for (int64_t i = whole; i < V; ++i) {
    const float v = static_cast<float>(x[i]);
    finite_check += (v == -INFINITY ? 0.f : v) * 0.f;
    best = v > best ? v : best;
  }
  if (finite_check != 0.f) return -1;  // NaN (or +inf) somewhere: ATen decides
  for (int64_t i = 0; i < V; ++i)
    if (static_cast<float>(x[i]) == best) return i;
  return -1;  // unreachable for finite rows
}

}  // namespace

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 && logits.dim() == 2 &&
                  logits.size(1) > 0,
              "greedy_argmax: bf16 logits [R, V] with V > 0");
  const auto x = logits.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  auto out = at::empty({R}, x.options().dtype(at::kLong));
  const auto* p = x.data_ptr<c10::BFloat16>();
  auto* o = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(p + r * V, V);
  });
  return out;
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("greedy_argmax", &greedy_argmax); }
