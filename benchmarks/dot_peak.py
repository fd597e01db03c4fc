"""The host's vector roofline: how many bf16 pair dot products (`vdpbf16ps`) and fp32
FMAs (`vfmadd`) a core issues per second, on 512-bit registers, with nothing to load:

    python benchmarks/dot_peak.py [--seconds 1.0]

Each thread runs 12 independent accumulator chains (enough to hide the instructions'
latency at two per cycle) for about `--seconds`; the script prints one thread's rate,
then every core's at once (one thread per core, OpenMP). A `vdpbf16ps` on 16 lanes is
64 FLOPs (two products and two additions per lane), an FMA 32. Why: `torch.mm`'s rate
(`benchmarks/prefill_ttft.py --gemm`, `attention_rows.py --gemm`) tells what oneDNN
reaches, not what the core allows; on a Zen 4 the two differ by about 8%, and a prefill
target beyond the core's own rate cannot be met by any kernel. AVX512-BF16 hosts only
(the AMX tile unit is not measured: its rate is a tile instruction's, not a vector's).
"""
from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <torch/extension.h>

template <bool kDot>
static double rate(int64_t iters) {  // GFLOP/s of one thread
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f00);
  __m512 fa = _mm512_set1_ps(1.0001f), fb = _mm512_set1_ps(0.9999f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i)
      acc[i] = kDot ? _mm512_dpbf16_ps(acc[i], a, b) : _mm512_fmadd_ps(acc[i], fa, fb);
    asm volatile("" : "+v"(a), "+v"(fa));  // the loop is not folded away
  }
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink = 0.f;
  for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  asm volatile("" : : "x"(sink));
  return iters * 12.0 * (kDot ? 64 : 32) / s / 1e9;
}

// [dot, fma] GFLOP/s summed over `threads` threads running at once.
std::vector<double> peak(int64_t iters, int64_t threads) {
  double dot = 0, fma = 0;
#pragma omp parallel num_threads(threads) reduction(+ : dot)
  dot += rate<true>(iters);
#pragma omp parallel num_threads(threads) reduction(+ : fma)
  fma += rate<false>(iters);
  return {dot, fma};
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    from kiln.platforms.cpu import host_isa  # what the cores have, whatever KILN_CPU_ISA says
    if host_isa() not in ("amx", "avx512_bf16"):
        sys.exit(f"dot_peak.py needs AVX512-BF16 (`vdpbf16ps`); this host is {host_isa()}")
    ext = load_inline("kiln_dot_peak", cpp_sources=SOURCE, functions=["peak"],
                      extra_cflags=["-O2", "-mavx512f", "-mavx512bf16", "-fopenmp"],
                      extra_ldflags=["-fopenmp"], build_directory=tempfile.mkdtemp())
    iters = int(args.seconds * 3e9 / 12)  # 12 per iteration, one a cycle at 3 GHz: ~1 s
    cores = torch.get_num_threads()
    for threads in (1, cores):
        dot, fma = ext.peak(iters, threads)
        print(f"{threads} thread(s): vdpbf16ps {dot:.0f} GFLOP/s, fp32 FMA {fma:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
