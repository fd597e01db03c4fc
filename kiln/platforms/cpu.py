"""The CPU platform: the ISA class kiln's kernels are built for, the CPU's name, and how
many threads a rank gets."""
from __future__ import annotations

import functools
import os
import platform as _platform

import torch

from kiln import envs
from kiln.platforms.interface import Platform

# The ISA classes, best first (kiln.ops.cpu_kernels builds one library per class).
ISA_CLASSES = ("amx", "avx512_bf16", "avx512", "avx2", "none")


def host_isa() -> str:
    """This CPU's class: 'amx', 'avx512_bf16', 'avx512', 'avx2' or 'none'."""
    # The bf16 classes' builds use AVX512-VNNI too (the Q4 decode kernel); every CPU with
    # AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later) has it.
    vnni = torch.cpu._is_vnni_supported()
    if torch.cpu._is_amx_tile_supported() and vnni:
        return "amx"
    if torch.cpu._is_avx512_bf16_supported() and vnni:
        return "avx512_bf16"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return "avx512"
    return "avx2" if capability == "AVX2" else "none"


def isa_class() -> str:
    """The class kiln's kernels run at: the host's, capped by KILN_CPU_ISA; `amx` with
    KILN_AMX_EMULATE=1 (`amx_emulated`)."""
    host = host_isa()
    cap = envs.KILN_CPU_ISA
    if cap and cap not in ISA_CLASSES:
        raise ValueError(f"KILN_CPU_ISA={cap!r} is not an ISA class; use one of "
                         f"{', '.join(ISA_CLASSES)} (or unset it for this host's, {host!r})")
    if envs.KILN_AMX_EMULATE:
        return _emulated_amx(host, cap)
    if not cap:
        return host
    return ISA_CLASSES[max(ISA_CLASSES.index(cap), ISA_CLASSES.index(host))]


def _emulated_amx(host: str, cap: str) -> str:
    """The emulated tiles run beside AVX512-BF16 code (the kernels' other paths, the
    epilogues): a host of that class or better, and no cap below `amx`."""
    if cap and cap != "amx":
        raise ValueError(f"KILN_AMX_EMULATE=1 runs the amx class, but KILN_CPU_ISA={cap!r} "
                         "caps it lower: unset one of them")
    if ISA_CLASSES.index(host) > ISA_CLASSES.index("avx512_bf16"):
        raise ValueError(f"KILN_AMX_EMULATE=1 needs an AVX512-BF16 host (this one is "
                         f"{host!r}): unset KILN_AMX_EMULATE")
    return "amx"


def amx_emulated() -> bool:
    """Whether kiln's kernels are the build with AMX tiles in software (for tests)."""
    return envs.KILN_AMX_EMULATE and isa_class() == "amx"  # isa_class checks the rest


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


def cpu_threads_per_rank(local_ranks: int) -> int:
    """This host's CPUs (the affinity mask, not the machine) split evenly over the ranks
    that share it; at least one each."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    return max(1, cpus // local_ranks)


class CpuPlatform(Platform):
    device_type = "cpu"
    # kiln's C++ kernels first; torch where they cannot be built. Interpreted Triton is
    # for tests only and must be asked for by name.
    attention_backends = ("cpu", "torch")

    def device_name(self, device: str | torch.device | None = None) -> str:
        """'cpu:<model> [<ISA class>]' (KILN_CPU_ISA names another host's class;
        emulated tiles say so, and key their own tuning entries)."""
        return f"cpu:{cpu_model()} [{isa_class()}{', emulated' if amx_emulated() else ''}]"

    def fast_bf16(self) -> bool:
        """bfloat16 is faster wherever kiln's kernels run (AMX, AVX512-BF16, plain AVX512
        and AVX2, where their FMA path still halves the weight bytes: measured 1.8x
        float32 at batch 1 and with 32 requests on an AVX512 host without bf16, 2.7x and
        1.7x on an AVX2 host). Without them (no AVX2, KILN_CPU_KERNELS=0, and also no
        compiler or a failed build, which the engine learns when it loads them) bf16 is
        oneDNN's emulation and float32 is faster."""
        return envs.KILN_CPU_KERNELS and isa_class() != "none"
