"""Inductor's vector-ISA probe, answered once per machine instead of once per process.

Before it writes or loads CPU code, Inductor checks each vector ISA the CPU reports by
building a probe library and dlopen-ing it in a child Python, and each AVX512 ISA checks
its extensions (BF16, VNNI, AMX, AMX-FP16) the same way: six builds and children on an
AMX host, 2-3 s of every cold compile and 0.6 s of every warm start, for an answer that
changes only with the CPU, the C++ compiler and torch. When the probe passed every ISA
the CPU reports, kiln records the answer of each check under the compile cache (keyed by
those three) and later processes answer Inductor from it: `cpp.vec_isa_ok` skips the base
check, and each extension's build-and-load check is looked up (a check not recorded runs
as before). If the probe ever refused an ISA (an old compiler, a disabled extension),
nothing is recorded and Inductor probes every time, as before. The compile cache's key is
computed without this patch, so it does not move.
"""
from __future__ import annotations

import functools
import hashlib
import json
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
_MARKER_FORMAT = 2  # 2: the marker holds each check's answer (1 held the ISA names only)
_answers: dict[str, bool] = {}  # recorded check answers, loaded by vec_isa_patch
_seen: dict[str, bool] = {}  # checks this process ran, for record_vec_isa


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
    identity = [_MARKER_FORMAT, torch.__version__, cxx, exe,
                stat and (stat.st_size, stat.st_mtime_ns), sorted(x86_isa_checker()),
                os.environ.get("ATEN_CPU_CAPABILITY")]
    return hashlib.sha256(repr(identity).encode()).hexdigest()[:16]


def _check_key(isa: Any, code: str) -> str:
    """One build-and-load check: the ISA, its compiler flags at the time (an extension's
    check adds its own flag) and the probe's source."""
    digest = hashlib.sha256(code.encode()).hexdigest()[:16]
    return f"{type(isa).__name__} {isa._arch_flags.strip()} {digest}"


@functools.cache
def _answer_checks() -> None:
    """Route Inductor's build-and-load checks through the recorded answers, once per
    process: an answered check runs nothing; any other runs and is remembered."""
    from torch._inductor import cpu_vec_isa

    original = cpu_vec_isa.VecISA.check_build

    def check_build(self: Any, code: str) -> bool:
        key = _check_key(self, code)
        if key in _answers:
            return _answers[key]
        _seen[key] = ok = original(self, code)
        return ok

    cpu_vec_isa.VecISA.check_build = check_build


def probe_in_background() -> None:
    """On a machine with no recorded answer, run Inductor's probe (a few seconds of g++
    there) on a thread while the engine converts, loads and traces; `vec_isa_patch`,
    called before any CPU code is compiled, waits for it. Inductor caches the answer in
    the process (`valid_vec_isa_list`), so its own call then probes nothing."""
    marker = _marker()
    if marker is None or _read_marker(marker) is not None:  # a damaged one: probe again
        return
    # What the probe imports, imported here: an import on a thread while this one imports
    # too can meet a half-initialised module (seen: "cannot import name 'schema' from
    # 'torch._export.serde'" in the probe thread of a cold `kiln warmup`).
    from torch._inductor import codecache, cpp_builder, cpu_vec_isa  # noqa: F401
    from torch.utils import _filelock  # noqa: F401

    _answer_checks()
    with _probe_lock:  # engines built on several threads start one probe
        if _probe:
            return
        thread = threading.Thread(target=cpu_vec_isa.valid_vec_isa_list,
                                  name="kiln-vec-isa-probe", daemon=True)
        thread.start()
        _probe.append(thread)  # only a started thread: vec_isa_patch joins it


def vec_isa_patch() -> dict[str, Any]:
    """Inductor config to apply while compiling or loading CPU code; loads the recorded
    answers of the extension checks too."""
    for thread in _probe:
        thread.join()
    _answer_checks()
    marker = _marker()
    recorded = _read_marker(marker) if marker is not None else None
    if recorded is None:
        return {}
    _answers.update(recorded.get("checks", {}))
    return {"cpp.vec_isa_ok": True}


def _read_marker(marker: Path) -> dict[str, Any] | None:
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return None  # absent or damaged: probe, and record again


def record_vec_isa() -> None:
    """After Inductor probed in this process: record the answer if every ISA the CPU
    reports passed."""
    from torch._inductor import cpu_vec_isa

    if not cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        return  # nothing probed here (a CUDA graph, or the answer was trusted): no news
    marker = _marker()
    if marker is None or _read_marker(marker) is not None:
        return
    flags = cpu_vec_isa.x86_isa_checker()
    reported = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                if all(flag in flags for flag in str(isa).split())]
    if not reported or cpu_vec_isa.valid_vec_isa_list() != reported:
        return
    record = {"isas": [str(isa) for isa in reported], "checks": dict(sorted(_seen.items()))}
    try:  # atomic, and optional: a read-only cache only means probing again next time
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_name(f".{marker.name}.{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, marker)
    except OSError as exc:
        logger.info("vector-ISA answer not recorded (%s): Inductor probes again", exc)
        return
    logger.info("vector ISAs %s probed once for this machine (%s)", " ".join(record["isas"]),
                marker)
