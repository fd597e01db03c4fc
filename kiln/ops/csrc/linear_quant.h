// kiln_cpu::linear_quant — y = x @ dequant(w).T (+ b) over weights kept quantized: what its
// translation units share (linear_quant.cpp: the fp32 kernels and the op;
// linear_quant_bf16.cpp: the native-bf16 panel of AVX512-BF16 builds; linear_quant_x8.cpp:
// the Q4 decode kernel over int8 activations).
//
// Why it exists: decode-sized linears are memory-bound, so a weight that takes fewer
// bytes is read faster; the weight is dequantized inside the kernel, in registers, and
// never materialised per call. Formats (kiln/ops/quant_packing.py packs them once at
// load; N % 16 == 0, K % 32 == 0; nb = 16-column block, kc = 32-deep K chunk):
//   kInt8     int8 codes, one fp32 scale per output column (weight-only int8):
//               codes int8 [N/16, K/32, 32, 16]: codes[nb, kc, kk, c] = q[16nb + c, 32kc + kk]
//               scales fp32 [N];                  w = q * s
//   kQ8       the same codes, one fp16 scale per column and chunk (GGUF Q8_0):
//               scales fp16 [N/16, K/32, 16];     w = q * d
//   kQ4       4-bit codes, fp16 scale and offset per column and chunk (GGUF Q4_1, Q4_0):
//               codes uint8 [N/16, K/32, 4, 16, 4]: byte (p, c, e) = q[16nb + c, k]
//                                                  | q[16nb + c, k + 16] << 4,
//                                                  k = 32kc + 4p + e
//               (each column's bytes of 4 adjacent k side by side: a 32-bit lane holds
//               one column's 4 k, the operand layout of VNNI's `vpdpbusd`)
//               scales, mins fp16 [N/16, K/32, 16]; w = q * d + m
// x is fp32 or bf16 (widened to fp32 once per call); the output has x's dtype and is
// rounded once, after the bias. Accumulation is fp32.
//
// Two kernels, picked by row count (`panel_from`, from the tuning table):
//   * direct (few rows): kQuantRows x kQuantBlocks register tiles; per chunk the integer
//     codes meet x in fp32 FMAs, then the chunk's sum is scaled (and the offset term
//     m * sum(x over the chunk) added) once, so dequantizing costs one op per 16 codes;
//   * panel (many rows): each thread dequantizes one 16-column block, whole K, into an
//     fp32 scratch panel (L2-resident, per thread: no per-layer copy) once per block of x
//     rows that fits L2 beside it, and runs a kQuantPanelRows x 16 tile over it.
// With bf16 x, linear_quant_bf16.cpp takes over the panel on AVX512-BF16 builds (codes to
// bf16, `vdpbf16ps` tiles), and linear_quant_x8.cpp the direct Q4 kernel on AVX512-BF16
// and AVX2 builds (x quantized to int8 per 32 columns, integer dot products).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <cstdint>

#include "simd.h"

namespace kiln_quant {

using kiln_isa::V16;

enum Fmt : int64_t { kInt8 = 0, kQ8 = 1, kQ4 = 2 };

struct QArgs {
  const float* xf;     // [M, K]
  const float* xsum;   // [M, K/32], kQ4 only: each chunk's sum of x
  const void* codes;
  const float* scale32;     // kInt8
  const uint16_t* scale16;  // kQ8, kQ4
  const uint16_t* min16;    // kQ4
  const float* bias;        // fp32 [N] or null
  void* y;
  bool y_bf16;
  int64_t M, K, N;
};

inline void store_out(const QArgs& a, int64_t row, int64_t col, V16 v) {
  if (a.y_bf16)
    kiln_isa::store_bf16(static_cast<c10::BFloat16*>(a.y) + row * a.N + col, v);
  else
    kiln_isa::storeu(static_cast<float*>(a.y) + row * a.N + col, v);
}

inline V16 finish(const QArgs& a, V16 acc, int64_t col) {
  return a.bias == nullptr ? acc : kiln_isa::add(acc, kiln_isa::loadu(a.bias + col));
}

// Each block's codes stream from memory in their own run of chunks. With one row the
// kernels outrun what the hardware prefetcher fetches, so each loop asks for the line
// kAheadBytes ahead in every stream it reads (scales and offsets: an eighth of it), and
// one row walks one block at a time per thread: one sequential stream. Measured with a
// whole SmolLM2 step of distinct weights (benchmarks/quant_step.py, 2 threads):
//   Zen 3 (AVX2), int8-activation Q4: 1 KiB ahead over two interleaved blocks 7.7-8.5 ms,
//     4-16 KiB ahead over one stream 4.8-6.1 ms;
//   Zen 4 (AVX512-BF16), VNNI Q4: 1 KiB over four blocks 4.0-4.1 ms, 8 KiB over one
//     stream 3.2-3.6 ms; fp32 INT8: 2 KiB over four blocks 5.3-5.9 ms, 8 KiB over one
//     stream 4.5-4.8 ms (16 KiB: 4.5 ms, two blocks: 5.7 ms).
constexpr int64_t kAheadBytes = 8192;

template <int NR, class T>
inline void prefetch_ahead(const T* const* c, int64_t at) {
  for (int j = 0; j < NR; ++j)
    _mm_prefetch(reinterpret_cast<const char*>(c[j]) + at + kAheadBytes, _MM_HINT_T0);
}

constexpr int64_t kPanelXBytes = 256 * 1024;  // the x rows one panel pass reuses

// The native-bf16 panel for bf16 x (linear_quant_bf16.cpp, at `panel` row counts). False
// where this build has none (no AVX512-BF16): the caller runs the fp32 panel.
bool bf16_panel(const QArgs& a, const uint16_t* x, int64_t fmt);

// silu(g) * u of a [gate | up] weight (no bias) into a.y [M, N / 2], the activation in the
// native-bf16 panel's epilogue, on AMX tiles or in its register tiles (linear_quant_bf16.cpp).
// False where this build has no such panel (no AVX512-BF16).
bool bf16_panel_silu(const QArgs& a, const uint16_t* x, int64_t fmt);

// The direct Q4 kernel for bf16 x over int8 activations (linear_quant_x8.cpp, below
// `panel` row counts): VNNI on AVX512-BF16 builds, maddubs on AVX2 builds. False where
// this build has none (plain AVX512): the caller runs the exact fp32 direct kernel.
bool q4_x8_gemm(const QArgs& a);

// The direct Q8_0 kernel for bf16 x over int8 activations (linear_quant_x8.cpp, below
// `panel` row counts; llama.cpp's Q8_0 x Q8_0 dot): VNNI builds only. False elsewhere
// (AVX2's `vpmaddubsw` would saturate on the offset codes): the caller runs fp32.
bool q8_x8_gemm(const QArgs& a);

}  // namespace kiln_quant
