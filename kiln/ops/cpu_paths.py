"""The host-dependent paths of kiln's CPU kernels, chosen once they are loaded
(cpu_kernels._load calls `choose`), each from the tuning table where it has a measurement:

- AMX tiles: whether this process may use them (an AMX build, with the tiles granted by
  the OS), and the linear's row count from which it does (`amx_from`,
  kiln/ops/linear_plan.py); the prefill attention kernel uses them at any size;
- bf16 prefill attention: kiln's tiled kernel or SDPA over gathered blocks
  (KILN_CPU_PREFILL, `auto` by default: the faster by `kiln bench kernels --ops
  attention`, else the kernel).

The harness's candidates switch a path off for a while (`linear_tiles_off`,
`prefill_sdpa`) and restore the choice after.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from kiln import envs
from kiln.platforms.cpu import amx_emulated

logger = logging.getLogger(__name__)

# This process's choices (the C++ side holds the same; these are what restores read).
_paths: dict[str, Any] = {"on": False, "from": 2, "prefill_kernel": True}


def choose(amx_build: bool) -> None:
    """Set the loaded library's paths for this host (called once it is loaded)."""
    # AMX tiles need the kernel's permission per process; without it (or in a build for
    # another class) the register-tiled kernel runs at every row count. Emulated tiles
    # (KILN_AMX_EMULATE, for tests) need none.
    _paths["on"] = amx_build and (amx_emulated() or bool(torch.cpu._init_amx()))
    if _paths["on"] and amx_emulated():
        logger.warning("AMX tiles emulated in software (KILN_AMX_EMULATE=1): the AMX paths "
                       "run for tests, far slower than on the hardware")
    if _paths["on"]:
        from kiln.ops.linear_plan import load_amx_from

        _paths["from"] = load_amx_from("cpu")
    set_amx_from(_paths["from"])
    set_prefill_kernel(_prefill_choice())


def amx_active() -> bool:
    """Whether the loaded kernels run AMX tiles (an AMX build, with the tiles granted)."""
    return bool(_paths["on"])


def set_amx_from(rows: int) -> None:
    """Tiles from `rows` rows on in the linear (the prefill attention's use them at any
    size); a count above any batch switches the linear's tiles off."""
    _paths["from"] = rows
    torch.ops.kiln_cpu.set_amx(bool(_paths["on"]), rows)


def _prefill_choice() -> bool:
    """KILN_CPU_PREFILL, or with `auto` the tuning table's faster path (else the kernel)."""
    if envs.KILN_CPU_PREFILL != "auto":
        return envs.KILN_CPU_PREFILL == "kernel"
    from kiln.ops.tuning import prefill_kernel_wins

    wins = prefill_kernel_wins("cpu")
    if wins is False:
        logger.info("bf16 prefill attention runs SDPA: faster than kiln's kernel on this "
                    "host by the tuning table (KILN_CPU_PREFILL=kernel overrides)")
    return wins is not False


def set_prefill_kernel(enabled: bool) -> None:
    """The cpu backend's bf16 prefill rows on kiln's kernel (True) or SDPA."""
    _paths["prefill_kernel"] = enabled
    torch.ops.kiln_cpu.set_prefill_kernel(enabled)


@contextlib.contextmanager
def prefill_sdpa() -> Iterator[None]:
    """SDPA for the bf16 prefill rows meanwhile (the harness's `cpu-sdpa` candidate)."""
    before = bool(_paths.get("prefill_kernel", True))
    set_prefill_kernel(False)
    try:
        yield
    finally:
        set_prefill_kernel(before)


def amx_from() -> int:
    """The linear's row count from which AMX tiles run (when they run at all)."""
    return int(_paths["from"])


@contextlib.contextmanager
def linear_tiles_off() -> Iterator[None]:
    """The linear's register kernel at every row count meanwhile (the harness's
    `kiln-packed-regs` candidate)."""
    rows = int(_paths["from"])
    set_amx_from(1 << 30)
    try:
        yield
    finally:
        set_amx_from(rows)
