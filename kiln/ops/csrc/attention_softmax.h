// The prefill kernel's softmax step over one row of a chunk's scores (attention_prefill.h):
// P written for the PV product, the row's reference and sum updated. Included by
// attention_prefill.h only.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "simd.h"

namespace kiln_prefill {

namespace isa = kiln_isa;
using isa::V16;

// The max of raw scores s over [a, b) (masks only at the edges).
inline float raw_max(const float* s, int64_t a, int64_t b) {
  V16 vm = isa::set1(-std::numeric_limits<float>::infinity());
  int64_t j = a / 16 * 16;
  if (j < a || b - j < 16) {  // a partial first vector
    vm = isa::max_masked(vm, isa::lanes_between(a - j, b - j), isa::loadu(s + j));
    j += 16;
  }
  for (; j + 16 <= b; j += 16) vm = isa::max(vm, isa::loadu(s + j));
  if (j < b) vm = isa::max_masked(vm, isa::first_lanes(b - j), isa::loadu(s + j));
  return isa::reduce_max(vm);
}

// P = exp(s * scale - ref) over [a, b), zeros elsewhere in [0, n16), stored as bf16 in pb
// on native builds (over s elsewhere); returns the sum of P.
inline float exp_pass(float* s, uint16_t* pb, int64_t a, int64_t b, int64_t n16, float scale,
                      float ref) {
  constexpr float kLog2e = 1.44269504088896341f;  // exp(x) = 2^(x log2 e)
  const V16 vscale = isa::set1(scale * kLog2e), neg_ref = isa::set1(-ref * kLog2e);
  V16 sum = isa::zero();
  auto put = [&](int64_t j, V16 e) {
    if constexpr (isa::kNativeBf16) isa::store_bf16(pb + j, e);
    else isa::storeu(s + j, e);
  };
  auto exp_at = [&](int64_t j) {
    return isa::exp2_bf16(isa::fmadd(isa::loadu(s + j), vscale, neg_ref));
  };
  int64_t j = 0;
  for (; j + 16 <= a; j += 16) put(j, isa::zero());
  if (j < a || b - j < 16) {  // a partial first vector
    const V16 e = isa::zero_unmasked(isa::lanes_between(a - j, b - j), exp_at(j));
    sum = isa::add(sum, e);
    put(j, e);
    j += 16;
  }
  if constexpr (isa::kNativeBf16) {  // whole pairs of vectors: one 64-byte store of P
    for (; j + 32 <= b; j += 32) {
      const V16 e0 = exp_at(j), e1 = exp_at(j + 16);
      sum = isa::add(sum, isa::add(e0, e1));
      isa::store_bf16x2(pb + j, e0, e1);
    }
  }
  for (; j + 16 <= b; j += 16) {  // whole vectors: no masks
    const V16 e = exp_at(j);
    sum = isa::add(sum, e);
    put(j, e);
  }
  if (j < b) {
    const V16 e = isa::zero_unmasked(isa::first_lanes(b - j), exp_at(j));
    sum = isa::add(sum, e);
    put(j, e);
    j += 16;
  }
  for (; j < n16; j += 16) put(j, isa::zero());
  return isa::reduce_add(sum);
}

// How far (natural log) P may rise above 1 before the chunk is redone against its max:
// P <= e^30 (1e13) keeps the sums and O far inside fp32, and bf16's relative precision
// is the same at any magnitude. A chunk whose sum passes e^30 is redone (so is one whose
// sum overflowed or is NaN): no P passes e^30 unless the sum does.
constexpr float kSlack = 30.f;
constexpr float kSlackSum = 1.0686475e13f;  // e^kSlack

// Softmax step of one row over chunk keys [a, b) of n16 computed, from raw scores s (the
// softmax takes s * scale; scale > 0, so the max of the raw scores gives the scaled
// one): writes P (zeros outside [a, b)), updates the row's reference m (the value P's
// exponents are taken from) and sum l, and returns the factor the row's output must be
// scaled by first. On AMX these passes over the scores bound the kernel, and S is read
// from L2, so on native builds (P in its own bf16 buffer) P is computed in one pass
// against the row's reference so far (on its first chunk the max of its first vector);
// only a chunk whose sum passes e^kSlack is redone against its max. Other builds store P
// over S, so they find the max first. exp is exp2_bf16: P is rounded to bf16 for the PV
// product, and the sum's relative error (under 7.5e-5) is far below the output's bf16.
inline float softmax_row(float* s, uint16_t* pb, int64_t a, int64_t b, int64_t n16,
                         float scale, float& m, float& l) {
  if (b <= a) {  // no visible key in this chunk (a window's edge)
    if constexpr (isa::kNativeBf16) std::memset(pb, 0, n16 * 2);
    else std::memset(s, 0, n16 * 4);
    return 1.f;
  }
  float ref, sum;
  if constexpr (isa::kNativeBf16) {
    ref = std::isinf(m) ? raw_max(s, a, std::min(b, a / 16 * 16 + 16)) * scale : m;
    sum = exp_pass(s, pb, a, b, n16, scale, ref);
    if (!(sum <= kSlackSum)) {
      ref = std::max(ref, raw_max(s, a, b) * scale);
      sum = exp_pass(s, pb, a, b, n16, scale, ref);
    }
  } else {
    ref = std::max(m, raw_max(s, a, b) * scale);
    sum = exp_pass(s, pb, a, b, n16, scale, ref);
  }
  const float alpha = std::isinf(m) ? 0.f : ref == m ? 1.f : std::exp(m - ref);
  l = l * alpha + sum;
  m = ref;
  return alpha;
}

}  // namespace kiln_prefill
