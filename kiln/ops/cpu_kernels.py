"""Build and load kiln's C++ CPU kernels (`torch.ops.kiln_cpu.*`) once per machine.

The kernels are compiled with the host's g++ the first time an engine starts on a CPU
with AVX2 or AVX512 (about 12 s on two cores: the sources include what they use of ATen
and torch/library.h rather than torch/extension.h, which measured 39 s of g++ per file
against 12 s, and are built as two unity units, `UNITY_GROUPS`), on a thread beside the
engine's own start-up (`start_loading`), for the host's ISA class
(`kiln.platforms.cpu.isa_class`: AMX, AVX512-BF16, plain AVX512 or AVX2; see
csrc/simd.h), and the shared object is kept in the kiln cache directory under a hash of
the source, the flags and the torch version, so later starts only `dlopen` it.
`KILN_CPU_ISA` caps the class, so one host can run the paths of the others
(`avx512_bf16` on an AMX host is the reference host's path, `avx2` on any AVX512 host
the AVX2 one). Builds happen in a private temporary directory under a file lock and are
renamed into place: a killed build leaves no half-written library and no stale lock
(torch's own JIT loader would wait forever on one).

Anything that prevents the kernels (no AVX2, no compiler, a failed build,
`KILN_CPU_KERNELS=0`) leaves `loaded()` False and the engine on `F.linear`: slower,
never wrong. A build that fails after the engine planned on it (`planned`) raises
`BuildFailed` where the kernels are first needed, and the engine starts again without.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from filelock import FileLock

from kiln import envs
from kiln.ops import cpu_paths
from kiln.ops.cpu_fakes import define_ops
from kiln.platforms.cpu import amx_emulated, isa_class

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("linear_bf16.cpp", "linear_quant.cpp",
                                      "linear_quant_bf16.cpp", "linear_quant_x8.cpp",
                                      "paged_attention.cpp",
                                      "greedy.cpp", "lora.cpp", "bitmask.cpp",
                                      "pointwise.cpp")]
HEADERS = [CSRC / name for name in ("simd.h", "simd_avx512.h", "simd_avx2.h",
                                      "linear_quant.h", "kept_rows.h", "attention_decode.h",
                                      "attention_decode_tiles.h",
                                      "attention_prefill.h", "attention_prefill_amx.h",
                                      "attention_softmax.h", "attention_pack.h",
                                      "amx.h", "amx_config.h", "amx_emulated.h",
                                      "linear_bf16_amx.h",
                                      "linear_bf16_panel.h")]
# The instructions each ISA class's build may use (kiln.platforms.cpu names the classes).
ISA_FLAGS = {
    "amx": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
            "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
    "avx512_bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                    "-mavx512bf16"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}
LIB_NAME = "kiln_cpu_ops"

# Every key present from the start: Dynamo reads this dict while tracing (`planned`).
_state: dict[str, str | None] = {"signature": None, "reason": "not requested",
                                 "failed": None, "building": None}
# One loader at a time: a background build (start_loading) and a caller that needs the
# kernels now meet here, and the second finds them loaded.
_lock = threading.Lock()
_plan_lock = threading.Lock()  # guards _builder and _state["building"]
_builder: list[threading.Thread] = []  # this process's background build


class BuildFailed(RuntimeError):
    """The background build failed after the engine had planned on its kernels."""


def cflags(isa: str) -> list[str]:
    if isa == "amx" and amx_emulated():
        # The tiles in software (csrc/amx_emulated.h), a build for tests: -O1 halves its
        # g++ time (38 -> 20 CPU-seconds, Zen 4), which the suite pays on every fresh clone.
        return ["-O1", *ISA_FLAGS["avx512_bf16"], "-DKILN_AMX_EMULATE", "-fopenmp"]
    return ["-O3", *ISA_FLAGS[isa], "-fopenmp"]


def signature() -> str:
    """What a build depends on; part of the compile-cache key while the kernels are in
    use, since compiled graphs call them. The ops' schemas (cpu_fakes.py) count too."""
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS, Path(__file__).with_name("cpu_fakes.py")):
        h.update(src.read_bytes())
    h.update(repr((cflags(isa_class()), torch.__version__)).encode())
    return h.hexdigest()[:16]


# The classes whose direct Q4 kernel takes bf16 x as int8 per 32 columns (llama.cpp's
# Q8_1 scheme; csrc/linear_quant_x8.cpp): VNNI on the AVX512-BF16 classes, maddubs on
# AVX2. Plain AVX512 builds keep the exact fp32 kernel.
Q4_INT8_ACTIVATION_CLASSES = ("amx", "avx512_bf16", "avx2")


def q4_int8_activations() -> bool:
    """Whether the kernels quantize bf16 activations of Q4 decode rows to int8."""
    return planned() and isa_class() in Q4_INT8_ACTIVATION_CLASSES


# The direct Q8_0 kernel does the same on VNNI builds only (llama.cpp's Q8_0 x Q8_0 dot):
# AVX2's `vpmaddubsw` would saturate on the offset codes, so AVX2 keeps it in fp32.
Q8_INT8_ACTIVATION_CLASSES = ("amx", "avx512_bf16")


def q8_int8_activations() -> bool:
    """Whether the kernels quantize bf16 activations of Q8_0 decode rows to int8."""
    return planned() and isa_class() in Q8_INT8_ACTIVATION_CLASSES


def loaded() -> bool:
    return _state["signature"] is not None


def planned() -> bool:
    """Loaded, or being built on this process's background thread: what a model's plan
    (its weight formats, the graph's ops, the compile-cache key) decides on. Whatever
    runs a kernel waits for it first (`wait_planned`). A failure does not show here but
    there: a plan half made with the kernels and half without would be compiled and
    cached under the kernels' key."""
    # Plain dict reads: Dynamo traces this (kiln.ops.linear), and guards it builds on a
    # list's items would fail once the list is emptied.
    return _state["signature"] is not None or _state["building"] is not None


def planned_signature() -> str | None:
    return _state["signature"] or (signature() if planned() else None)


def ensure_planned(cache_root: Path, progress: bool = False) -> bool:
    """`planned()`, loading (building first if needed) in this thread when no background
    build is under way. A background build that already ended is settled first, so a
    quick failure (a compiler refusing a flag) costs no restart."""
    if _builder and not _builder[0].is_alive():
        _settle()
    return planned() or ensure_loaded(cache_root, progress)


@contextlib.contextmanager
def beside_build() -> Iterator[None]:
    """Eager torch work on one thread while a background build runs: with g++ on every
    core, OpenMP's spinning barriers made loading the weights 5x slower (1.2 -> 6.4 s,
    two cores). Not around compiling: Inductor writes the thread count into its code."""
    if not (_builder and _builder[0].is_alive()):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def wait_planned() -> None:
    """Before anything runs a kernel: wait for a background build. If it failed after
    the engine had planned on it, raise BuildFailed (the engine starts again without).
    Engines built on several threads may all wait here: the thread is joined, not taken."""
    if _settle() and not loaded():
        raise BuildFailed(f"kiln's CPU kernels: {_state['reason']}")


def _settle() -> bool:
    """Join this process's background build and end the plan that counted on it; True
    for the one caller that ended it."""
    with _plan_lock:
        thread = _builder[0] if _builder and _state["building"] else None
    if thread is None:
        return False
    thread.join()
    with _plan_lock:
        if _state["building"] is None:  # another caller settled it first
            return False
        _state["building"] = None
        return True


def unavailable_reason() -> str | None:
    return None if loaded() else _state["reason"]


def host_supports() -> str | None:
    """None when this host can run the kernels, else why not."""
    if not envs.KILN_CPU_KERNELS:
        return "disabled by KILN_CPU_KERNELS=0"
    envs.KILN_CPU_PREFILL  # noqa: B018 - a bad value is a ValueError here, at start-up
    isa = isa_class()
    if isa not in ISA_FLAGS:
        return f"the CPU has no AVX2 (ISA class {isa!r}; KILN_CPU_ISA may cap it)"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler on PATH"
    return None


def start_loading(cache_root: Path) -> threading.Thread | None:
    """Start `ensure_loaded` on a thread when a build is due, so that a first start's g++
    (about 12 s on two cores) overlaps what an engine does before it runs a kernel:
    loading the weights, tracing and compiling (the ops' schemas and fakes are Python's,
    `define_ops`). Even on two cores: most of that is one Python thread. A cold
    `kiln generate` on the default model took 0.87x the wall time of building first
    (farm-bench, Zen 4, 2 cores). The engine starts it after a GGUF file's conversion,
    which ran 3x slower beside g++ (memory-bound numpy), and `beside_build` keeps eager
    torch work off the second core meanwhile. Call it only where this process runs the
    model: its plan (`planned`) counts on the thread. Nothing to overlap when the library
    is built: loading it takes milliseconds."""
    target = _target(cache_root)
    if loaded() or host_supports() is not None or target.exists() \
            or _state["failed"] is not None or (target.parent / FAILED).exists():
        return None  # a build that failed once here runs in line: no restart each time
    # What the build imports, imported here: an import on a thread while this one imports
    # too can meet a half-initialised module (kiln/compiler/vec_isa.py saw one).
    import torch.utils.cpp_extension  # noqa: F401
    import tqdm  # noqa: F401

    with _plan_lock:
        if _builder:
            return None
        define_ops()
        _state["building"] = "1"
        thread = threading.Thread(target=ensure_loaded, args=(cache_root, False),
                                  name="kiln-cpu-kernels", daemon=True)
        _builder.append(thread)
        thread.start()
    return thread


def ensure_loaded(cache_root: Path, progress: bool = False) -> bool:
    """Load (building first if needed) the kernels; False, with the reason logged once,
    when this host cannot have them."""
    if loaded():
        return True
    with _lock:
        return _ensure_loaded(cache_root, progress)


def _ensure_loaded(cache_root: Path, progress: bool) -> bool:
    if loaded():
        return True
    if _state.get("failed") == str(cache_root):
        return False  # a build that failed here fails again: not once per caller
    reason = host_supports()
    if reason is None:
        try:
            _load(cache_root, progress)
            return True
        except Exception as exc:  # a failed build costs speed, never correctness
            reason = f"build failed ({type(exc).__name__}: {str(exc)[:500]})"
            _state["failed"] = str(cache_root)
            _mark_failed(cache_root, reason)
    _state["reason"] = reason
    logger.info("kiln CPU kernels not used: %s", reason)
    return False


FAILED = "build.failed"  # beside the library: this build failed on this machine


def _mark_failed(cache_root: Path, reason: str) -> None:
    try:  # optional: a read-only cache only means a background build again next time
        marker = _target(cache_root).parent / FAILED
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(reason + "\n")
    except OSError:
        pass


def _target(cache_root: Path) -> Path:
    return cache_root / "cpu_kernels" / signature() / f"{LIB_NAME}.so"


def _load(cache_root: Path, progress: bool) -> None:
    target = _target(cache_root)
    sig = target.parent.name
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / "build.lock")):
        if not target.exists():
            _build(target, progress)
            (target.parent / FAILED).unlink(missing_ok=True)
    define_ops()
    torch.ops.load_library(str(target))
    cpu_paths.choose(isa_class() == "amx")  # the host's measured paths (cpu_paths.py)
    _state["signature"] = sig


# The unity build's translation units: each #includes its sources in this order. Each
# .cpp costs about 4-6 s of g++ on ATen's headers alone (they include what they use of
# ATen, `ATen/core/Tensor.h` and per-operator headers, rather than all of `ATen/ATen.h`),
# so eight files took 37 s on two cores where these two units take about 11 s (Zen 4),
# balanced by measured compile time: paged attention is the heaviest source. The grouping
# is fixed, not per core count, because sources share file-local names across units:
# linear_bf16.cpp's AVX2 panel (PanelFn, kPanel) and linear_quant.cpp's must never meet
# in one unit. A new source goes into the unit it compiles in on every ISA class.
UNITY_GROUPS = (("linear_quant_x8.cpp", "linear_quant.cpp", "lora.cpp", "greedy.cpp",
                 "linear_quant_bf16.cpp", "bitmask.cpp", "pointwise.cpp"),
                ("paged_attention.cpp", "linear_bf16.cpp"))


def unity_sources(build_dir: Path) -> list[str]:
    """The UNITY_GROUPS units, written into `build_dir`."""
    paths = []
    for i, group in enumerate(UNITY_GROUPS):
        unit = build_dir / f"kiln_unity_{i}.cpp"
        unit.write_text("".join(f'#include "{CSRC / name}"\n' for name in group))
        paths.append(str(unit))
    return paths


def _build(target: Path, progress: bool) -> None:
    from torch.utils.cpp_extension import load
    from tqdm import tqdm

    logger.info("building kiln's CPU kernels (one-off, about 12 s) into %s", target.parent)
    start = time.perf_counter()
    # The ninja that pip installed sits beside this interpreter, which need not be on PATH.
    scripts = sysconfig.get_path("scripts")
    if scripts and scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp, \
            tqdm(total=1, desc="building kiln's CPU kernels (once per machine)",
                 disable=not progress, bar_format="{desc}: {elapsed}") as bar:
        load(LIB_NAME, sources=unity_sources(Path(tmp)),
             extra_cflags=cflags(isa_class()),
             extra_ldflags=["-fopenmp"], build_directory=tmp, is_python_module=False,
             verbose=False)
        bar.update()
        built = Path(tmp) / f"{LIB_NAME}.so"
        os.replace(built, target)
    logger.info("built kiln's CPU kernels in %.1f s", time.perf_counter() - start)
