"""Inductor's vector-ISA probe, answered once per machine instead of once per process.

Before it writes or loads CPU code, Inductor checks each vector ISA the CPU reports by
building a probe library and dlopen-ing it in a child Python: about 0.9 s of every warm
start here (Zen 4), for an answer that changes only with the CPU, the C++ compiler and
torch. When the probe passed every ISA the CPU reports, kiln records that under the
compile cache (keyed by those three) and later processes tell Inductor so
(`cpp.vec_isa_ok`), which skips the probe. If the probe ever refused an ISA (an old
compiler, a disabled extension), nothing is recorded and Inductor probes every time, as
before. The compile cache's key is computed without this patch, so it does not move.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

from kiln.compiler.cache import default_cache_root

logger = logging.getLogger(__name__)
_probe: list[threading.Thread] = []  # the background probe of this process, if any
_probe_lock = threading.Lock()


def _marker() -> Path | None:
    key = _machine_key()
    return None if key is None else default_cache_root() / "vec_isa" / f"{key}.ok"


@functools.cache
def _machine_key() -> str | None:
    """What the probe's answer depends on, hashed; read once per process (the cache root
    is not part of it: tests and launchers move that between engines)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    from torch._inductor.cpu_vec_isa import x86_isa_checker

    cxx = os.environ.get("CXX", "g++")
    exe = shutil.which(cxx)
    stat = os.stat(exe) if exe else None
    identity = [torch.__version__, cxx, exe, stat and (stat.st_size, stat.st_mtime_ns),
                sorted(x86_isa_checker()), os.environ.get("ATEN_CPU_CAPABILITY")]
    return hashlib.sha256(repr(identity).encode()).hexdigest()[:16]


def probe_in_background() -> None:
    """On a machine with no recorded answer, run Inductor's probe (a few seconds of g++
    there) on a thread while the engine converts, loads and traces; `vec_isa_patch`,
    called before any CPU code is compiled, waits for it. Inductor caches the answer in
    the process (`valid_vec_isa_list`), so its own call then probes nothing."""
    marker = _marker()
    if marker is None or marker.is_file():
        return
    # What the probe imports, imported here: an import on a thread while this one imports
    # too can meet a half-initialised module (seen: "cannot import name 'schema' from
    # 'torch._export.serde'" in the probe thread of a cold `kiln warmup`).
    from torch._inductor import codecache, cpp_builder, cpu_vec_isa  # noqa: F401
    from torch.utils import _filelock  # noqa: F401

    with _probe_lock:  # engines built on several threads start one probe
        if _probe:
            return
        thread = threading.Thread(target=cpu_vec_isa.valid_vec_isa_list,
                                  name="kiln-vec-isa-probe", daemon=True)
        thread.start()
        _probe.append(thread)  # only a started thread: vec_isa_patch joins it


def vec_isa_patch() -> dict[str, Any]:
    """Inductor config to apply while compiling or loading CPU code."""
    for thread in _probe:
        thread.join()
    marker = _marker()
    return {"cpp.vec_isa_ok": True} if marker is not None and marker.is_file() else {}


def record_vec_isa() -> None:
    """After Inductor probed in this process: record the answer if every ISA the CPU
    reports passed."""
    from torch._inductor import cpu_vec_isa

    if not cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        return  # nothing probed here (a CUDA graph, or the answer was trusted): no news
    marker = _marker()
    if marker is None or marker.is_file():
        return
    flags = cpu_vec_isa.x86_isa_checker()
    reported = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                if all(flag in flags for flag in str(isa).split())]
    if not reported or cpu_vec_isa.valid_vec_isa_list() != reported:
        return
    names = " ".join(str(isa) for isa in reported)
    try:  # atomic, and optional: a read-only cache only means probing again next time
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_name(f".{marker.name}.{os.getpid()}")
        tmp.write_text(names + "\n")
        os.replace(tmp, marker)
    except OSError as exc:
        logger.info("vector-ISA answer not recorded (%s): Inductor probes again", exc)
        return
    logger.info("vector ISAs %s probed once for this machine (%s)", names, marker)
