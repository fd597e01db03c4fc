// kiln_cpu::apply_token_bitmask_ — structured output: -inf where a grammar forbids a token.
//
// logits [R, V] (float, bf16 or half) are masked in place on the rows `rows` [G] (int64),
// row i by bitmask[i] [ceil(V/32)] int32 (bit j of word w allows token 32w + j, xgrammar's
// layout). Why a kernel: unpacking the bits with ATen ops costs 3-10 ms per 32-row step
// at a 49k vocabulary on two cores (it materialises [R, V] temporaries); word at a time
// it is a fraction of a millisecond, and an all-ones word (every token allowed) is skipped.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cstring>
#include <limits>

namespace {

// Stores go through the raw bit pattern (U: an unsigned integer of T's size): storing a
// c10::BFloat16 or Half by value was ~20x slower than a float store here.
template <typename T, typename U>
void mask_row(T* xt, const int32_t* bits, int64_t V) {
  static_assert(sizeof(T) == sizeof(U), "bit pattern type must match");
  const T neg_t = static_cast<T>(-std::numeric_limits<float>::infinity());
  U neg;
  std::memcpy(&neg, &neg_t, sizeof(U));
  U* x = reinterpret_cast<U*>(xt);
  const int64_t words = (V + 31) / 32;
  for (int64_t w = 0; w < words; ++w) {
    const uint32_t b = static_cast<uint32_t>(bits[w]);
    if (b == 0xFFFFFFFFu) continue;
    const int64_t base = w * 32, n = V - base < 32 ? V - base : 32;
    for (int64_t j = 0; j < n; ++j)
      if (!((b >> j) & 1u)) x[base + j] = neg;
  }
}

}  // namespace

void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& rows,
                          const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(),
              "apply_token_bitmask_: contiguous logits [R, V]");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 &&
                  bitmask.size(0) == rows.size(0) &&
                  bitmask.size(1) * 32 >= logits.size(1),
              "apply_token_bitmask_: int32 bitmask [G, ceil(V/32)] with one row per entry "
              "of rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1,
              "apply_token_bitmask_: int64 rows [G]");
  const auto bm = bitmask.contiguous();
  const auto idx = rows.contiguous();
  const int64_t G = idx.size(0), V = logits.size(1), W = bm.size(1);
  const int64_t* r = idx.data_ptr<int64_t>();
  const int32_t* b = bm.data_ptr<int32_t>();
  for (int64_t i = 0; i < G; ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < logits.size(0), "apply_token_bitmask_: row out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(),
                                  "apply_token_bitmask_", [&] {
    scalar_t* x = logits.data_ptr<scalar_t>();
    at::parallel_for(0, G, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if constexpr (sizeof(scalar_t) == 2)
          mask_row<scalar_t, uint16_t>(x + r[i] * V, b + i * W, V);
        else if constexpr (sizeof(scalar_t) == 4)
          mask_row<scalar_t, uint32_t>(x + r[i] * V, b + i * W, V);
        else
          mask_row<scalar_t, uint64_t>(x + r[i] * V, b + i * W, V);
      }
    });
  });
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("apply_token_bitmask_", &apply_token_bitmask_); }
