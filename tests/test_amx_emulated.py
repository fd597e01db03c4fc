"""kiln's AMX paths on a host without AMX: the kernel tests once more, against the build
whose tiles are emulated in software (KILN_AMX_EMULATE=1, kiln/ops/csrc/amx_emulated.h).

The tile GEMMs (plain, SwiGLU and RoPE epilogues, the row split), the quantized panel's
tiles and the prefill attention's tile products run only on AMX hosts, and most hosts
this suite runs on have none: without this, a change to them was only ever compiled.
The emulated build runs the same kernel code, tile for tile, with each tile instruction
done in software as Intel describes it, and faults (aborts) where the hardware would, on
a tile used unconfigured or a product whose shapes do not chain. It checks the kernels'
logic, never their speed. On an AMX host the suite runs the real tiles instead.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.ops.cpu_kernels import CSRC, ISA_FLAGS
from kiln.platforms.cpu import host_isa

ROOT = Path(__file__).resolve().parent.parent
# The tests that reach a tile path, at the kernels' level: test_cpu_kernels.py's `amx`
# variants (its `no-amx` ones, and its tests of the build machinery, run in the suite
# itself), the prefill attention kernel, the quantized linears from the panel's row count
# on, the kept rows. Engines are left out: each would compile its model again for this
# build's kernels, and every op they run on tiles is here.
FILES = ["tests/test_cpu_kernels.py", "tests/test_attention.py",
         "tests/test_quantization.py::test_kernel_matches_dequantize_then_matmul",
         "tests/test_quantization.py::test_fused_gate_up_activation_is_the_same_bits_as_two_steps",
         "tests/test_kept_rows.py::test_linears_compute_the_kept_rows_alone_and_zero_the_others",
         "tests/test_kept_rows.py::test_attention_layer_computes_only_each_requests_kept_query_rows"]
SELECT = "not no-amx and not build"


def test_the_kernel_tests_pass_on_emulated_amx_tiles():
    host = host_isa()
    if host == "amx":
        pytest.skip("this host runs the real tiles in the suite itself")
    if host != "avx512_bf16":
        pytest.skip(f"emulated tiles run beside AVX512-BF16 code; this host is {host!r}")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTEST_XDIST") and k not in ("KILN_CPU_ISA", "PYTEST_ADDOPTS")}
    env["KILN_AMX_EMULATE"] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p",
         "no:xdist", "-k", SELECT, *FILES],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-8000:]
    # The tiles ran: no test fell back for want of them.
    assert "no AMX" not in out, out[-4000:]
    assert " passed" in out.splitlines()[-1]


def test_emulated_tiles_give_the_bits_intel_describes_and_the_hardware_gives(tmp_path):
    """tests/amx_tile_check.cpp: 3,000 random tile shapes (1-16 rows, 1-16 columns, 1-16
    bf16 pairs deep) through load / tdpbf16ps / store, emulated, against the instruction's
    description written out plainly, on any host; on an AMX host against the real tiles
    too. Bit for bit."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip("no C++ compiler on PATH")
    hardware = host_isa() == "amx"
    flags = [*ISA_FLAGS["amx"], "-DKILN_CHECK_HARDWARE"] if hardware else []
    exe = tmp_path / "amx_tile_check"
    subprocess.run([cxx, "-O2", "-std=c++17", *flags, f"-I{CSRC}",
                    str(ROOT / "tests" / "amx_tile_check.cpp"), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3000 cases, 0 mismatching values" in run.stdout
