"""Every environment variable kiln reads, in one place, read when asked (not at import):
tests and launchers change them between engines.

    from kiln import envs
    envs.KILN_HOME            # a Path
    envs.kiln_home()          # the same, as a function

| variable | meaning | default |
|---|---|---|
| KILN_HOME | root of kiln's files: converted models, tuning table, compile cache | ~/.cache/kiln |
| KILN_CACHE_DIR | the compile cache (also where the CPU kernels' build is kept) | $KILN_HOME/compile_cache |
| KILN_TUNING_FILE | the kernel tuning table `kiln bench kernels` writes | $KILN_HOME/tuning.json |
| KILN_CPU_ISA | caps the CPU's ISA class (amx, avx512_bf16, avx512, avx2, none): one host runs another class's kernels | the host's |
| KILN_AMX_EMULATE | 1 builds kiln's CPU kernels with AMX tiles emulated in software (csrc/amx_emulated.h) on an AVX512-BF16 host: the AMX paths' logic runs where the CPU has no tiles; for tests, far slower than the hardware | 0 |
| KILN_CPU_KERNELS | 0 turns kiln's C++ CPU kernels off (F.linear and SDPA run) | 1 |
| KILN_CPU_PREFILL | the `cpu` attention backend's bf16 prefill rows: `kernel` (kiln's tiled kernel), `sdpa` (SDPA over gathered blocks) or `auto` (the faster on this host by the tuning table, `kiln bench kernels --ops attention`; the kernel without entries) | auto |
| KILN_DIST_TIMEOUT_S | bound on one collective or control message while serving | 600 |
| KILN_DIST_STARTUP_TIMEOUT_S | the same bound while ranks start (connect, load, compile) | max(600, step bound) |
| KILN_API_KEY | `kiln serve --api-key`'s default | none |
| KILN_ALLOW_RUNTIME_LORA_UPDATING | `kiln serve --allow-runtime-lora-updating`'s default (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING works too) | off |
| KILN_PLUGINS | comma-separated entry-point names: only these plugins load, in every group (`""`: none) | unset: all |
| KILN_HUGE_PAGES | 0 leaves the CPU weights where they loaded instead of copying them to transparent huge pages (kiln.runner.huge_pages): a VM whose host backs a fresh huge page slowly (about 10 ms each seen) spends seconds of start-up there | 1 |
| KILN_KV_PREFAULT | how the CPU KV cache is backed (kiln.runner.kv_backing): unset, its first blocks at start-up and the rest on an idle-priority thread once the model is compiled; `all`, all of it before the first request (`kiln bench soak` sets it); `first`, the first blocks only, the rest as requests reach it (the test suite) | unset |
| KILN_WORKER_FORK | 0 starts each `mp` worker as a fresh interpreter instead of forking it from a pre-imported zygote (kiln.executor.zygote) | 1 |
| KILN_PP_LAYER_PARTITION | layers per pipeline stage, comma-separated (`"5,4"`; vLLM's VLLM_PP_LAYER_PARTITION works too) | an even split |
| KILN_PROBE_T0 | set by `kiln bench compile` for the start-up probe it spawns: the spawn time (`time.monotonic()`, host-wide) | unset |

Other programs' variables kiln passes on or reads as theirs (TRITON_INTERPRET, torchrun's
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR, CXX) are read where they are used.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

DEFAULT_DIST_TIMEOUT_S = 600.0


def _path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def kiln_home() -> Path:
    """Root of kiln's files: `$KILN_HOME`, else `~/.cache/kiln`."""
    return _path("KILN_HOME") or Path.home() / ".cache" / "kiln"


def _true(*names: str) -> bool:
    return any(os.environ.get(n, "").strip().lower() in ("1", "true") for n in names)


def _on(name: str) -> bool:
    """A switch that is on unless set to 0."""
    return os.environ.get(name, "1").strip() != "0"


def _names(name: str) -> list[str] | None:
    """A comma-separated list; unset is None, and "" an empty list (matches nothing)."""
    value = os.environ.get(name)
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def _dist_timeout() -> float:
    return float(os.environ.get("KILN_DIST_TIMEOUT_S", DEFAULT_DIST_TIMEOUT_S))


def _cpu_prefill() -> str:
    value = os.environ.get("KILN_CPU_PREFILL", "auto").strip().lower()
    if value not in ("auto", "kernel", "sdpa"):
        raise ValueError(f"KILN_CPU_PREFILL={value!r}: use 'auto' (the default: measured per "
                         "host), 'kernel' or 'sdpa'")
    return value


def _amx_emulate() -> bool:
    value = os.environ.get("KILN_AMX_EMULATE", "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"KILN_AMX_EMULATE={value!r}: use 1 (AMX tiles emulated in "
                         "software, for tests) or 0 (the default)")
    return value == "1"


def _kv_prefault() -> str:
    value = os.environ.get("KILN_KV_PREFAULT", "").strip().lower()
    if value not in ("", "all", "first"):
        raise ValueError(f"KILN_KV_PREFAULT={value!r}: use 'all' (back the whole KV cache at "
                         "start-up), 'first' (only its first blocks) or leave it unset (the "
                         "first blocks now, the rest on an idle thread)")
    return value


_VARIABLES: dict[str, Callable[[], Any]] = {
    "KILN_HOME": kiln_home,
    "KILN_CACHE_DIR": lambda: _path("KILN_CACHE_DIR"),
    "KILN_TUNING_FILE": lambda: _path("KILN_TUNING_FILE"),
    "KILN_CPU_ISA": lambda: os.environ.get("KILN_CPU_ISA", "").strip().lower(),
    "KILN_AMX_EMULATE": _amx_emulate,
    "KILN_CPU_KERNELS": lambda: os.environ.get("KILN_CPU_KERNELS", "1") != "0",
    "KILN_CPU_PREFILL": _cpu_prefill,
    "KILN_DIST_TIMEOUT_S": _dist_timeout,
    "KILN_DIST_STARTUP_TIMEOUT_S": lambda: float(os.environ.get(
        "KILN_DIST_STARTUP_TIMEOUT_S", max(DEFAULT_DIST_TIMEOUT_S, _dist_timeout()))),
    "KILN_WORKER_FORK": lambda: _on("KILN_WORKER_FORK"),
    "KILN_PP_LAYER_PARTITION": lambda: os.environ.get(
        "KILN_PP_LAYER_PARTITION", os.environ.get("VLLM_PP_LAYER_PARTITION", "")).strip(),
    "KILN_API_KEY": lambda: os.environ.get("KILN_API_KEY"),
    "KILN_ALLOW_RUNTIME_LORA_UPDATING": lambda: _true("VLLM_ALLOW_RUNTIME_LORA_UPDATING",
                                                      "KILN_ALLOW_RUNTIME_LORA_UPDATING"),
    "KILN_PLUGINS": lambda: _names("KILN_PLUGINS"),
    "KILN_HUGE_PAGES": lambda: _on("KILN_HUGE_PAGES"),
    "KILN_KV_PREFAULT": _kv_prefault,
    "KILN_PROBE_T0": lambda: float(os.environ.get("KILN_PROBE_T0", "nan")),
}


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*_VARIABLES, "kiln_home"])
