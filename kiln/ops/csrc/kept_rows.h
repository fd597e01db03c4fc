// The kept-rows hint of kiln's linears (kiln_cpu::linear_packed, linear_packed_silu,
// linear_quant, linear_quant_silu): an optional int64 tensor [1 + capacity] whose first
// entry n says which rows of x the caller will read: n < 0, or n >= M, every row;
// otherwise rows[1 .. n], in any order. The runner sets it for the last decoder layer
// after attention, whose other rows no one reads (a prefill samples one row of each
// request), and only there. The op then computes those n rows as an n-row product and
// returns zeros in the others: zeros rather than leftover bits, so that whatever runs
// after the op on every row (a residual add, a norm, an adapter) stays finite and the
// same from run to run. The kept rows get the n-row product's bits, which may differ
// from the M-row product's in the last place (another row count may take another kernel).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/index_copy.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/zeros.h>

namespace kiln_rows {

// fn(x) over the kept rows of x when `rows` names fewer than all; N: fn's output columns.
template <class Fn>
at::Tensor on_kept_rows(const at::Tensor& x, const c10::optional<at::Tensor>& rows,
                        int64_t N, Fn&& fn) {
  if (!rows.has_value() || !rows->defined() || x.dim() != 2) return fn(x);
  TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->numel() >= 1 &&
                  rows->is_contiguous() && rows->device().is_cpu(),
              "kept rows: a contiguous int64 CPU tensor [1 + capacity] expected");
  const int64_t n = *rows->data_ptr<int64_t>(), M = x.size(0);
  if (n < 0 || n >= M) return fn(x);
  TORCH_CHECK(n < rows->numel(), "kept rows: ", n, " rows named in a tensor of ",
              rows->numel() - 1);
  auto out = at::zeros({M, N}, x.options());
  if (n == 0) return out;
  const auto idx = rows->narrow(0, 1, n);  // index_select checks each is in [0, M)
  out.index_copy_(0, idx, fn(x.index_select(0, idx)));
  return out;
}

}  // namespace kiln_rows
