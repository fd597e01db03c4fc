"""Compiler adaptors: one interface over Inductor (standalone_compile) and eager.

`compile(graph, args, dynamic, save_dir)` returns a callable and writes a loadable
artifact into `save_dir` when given; `load(artifact_dir)` returns the callable again;
`compute_hash()` names everything about the compiler that changes its output.
"""
from __future__ import annotations

import contextlib
import hashlib
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence
from unittest import mock

import torch
from torch import fx

from kiln.compiler.counter import compilation_counter
from kiln.compiler.vec_isa import record_vec_isa, vec_isa_patch

# Every CPU kernel Inductor writes includes cpp_prefix.h: 1.6 s of g++ per kernel, or
# 0.35 s from the header precompiled once per machine (4.5 s, kept in Inductor's global
# /tmp/torchinductor_$USER). A cold -O2 build of the default model spends 13.9 s in the
# compiler instead of 15.3 s on a machine without the header, 9.2 s on one with it, and
# every later cold build saves the same (Zen 4, 2 cores). The flag adds a define to each
# kernel's command line, so it is part of each kernel's cache key: loads set it as
# compiles did, but with no header to precompile (`_no_header_precompiling`). Inductor
# checks a precompiled header with the `openssl` binary: without one, headers are not.
# Size and alignment asserts re-check every graph input (each weight) and every extern
# op's output on every call: ~600 checks in a SmolLM2 step, 5-10% of a batch-1 decode on
# the CPU. The inputs are the runner's own persistent buffers and weights, and the extern
# outputs are held to their fake implementations by tests/test_op_fakes.py instead.
_INDUCTOR_PATCHES = {"cpp_cache_precompile_headers": shutil.which("openssl") is not None,
                     "size_asserts": False,
                     "alignment_asserts": False}


# Settings that only choose whether a check raises or warns, never the code: left out of
# the key. functorch's defaults to `bool(os.getenv("CI"))`, so a cache warmed in CI (which
# sets CI=true) missed everywhere else.
_CHECKS_ONLY = frozenset({"error_on_custom_op_aliasing"})


@contextlib.contextmanager
def _no_header_precompiling() -> Iterator[None]:
    """While loading: no header to precompile. A warm load runs no C++ toolchain at all
    (a warm cache may ship to a host without g++), but Inductor, told that headers are
    precompiled, would preprocess cpp_prefix.h (a g++ call) to check the precompiled one
    is current, and rebuild it (4.5 s) where /tmp lost it. Every kernel's .so travels with
    its artifact, so nothing compiles here; a kernel that must (a damaged artifact)
    compiles from the plain header, slower and the same. Inductor's two lookups are
    private functions: where a torch version lacks them, nothing is patched."""
    from torch._inductor import codecache

    with contextlib.ExitStack() as stack:
        for name in ("_get_cpp_prefix_header", "_get_cpp_wrapper_header"):
            if hasattr(codecache, name):
                stack.enter_context(mock.patch.object(codecache, name,
                                                      lambda *args, **kwargs: None))
        yield


class CompilerAdaptor(ABC):
    name: str

    @abstractmethod
    def compute_hash(self) -> str: ...

    @abstractmethod
    def compile(self, graph: fx.GraphModule, args: Sequence[Any], dynamic: bool,
                save_dir: Path | None) -> Callable[..., Any]: ...

    @abstractmethod
    def load(self, artifact_dir: Path) -> Callable[..., Any]: ...

    @property
    def saves_artifacts(self) -> bool:
        return True


class EagerAdaptor(CompilerAdaptor):
    """No code generation: the piece runs as traced (for debugging the split)."""

    name = "eager"

    def compute_hash(self) -> str:
        return "eager"

    def compile(self, graph, args, dynamic, save_dir):
        compilation_counter.num_eager_compiles += 1
        return graph

    def load(self, artifact_dir):
        raise RuntimeError("the eager adaptor has no artifacts to load")

    @property
    def saves_artifacts(self) -> bool:
        return False


class InductorAdaptor(CompilerAdaptor):
    """`torch._inductor.standalone_compile`, saved in the 'unpacked' format.

    On the CPU an Inductor artifact holds C++ source; loading it would run g++ again
    unless the built shared objects sit in the artifact's own Inductor cache directory.
    So each compile runs with a private Inductor cache directory and its `.so` files are
    copied into the artifact: a warm load then builds nothing.
    """

    name = "inductor"

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = {**_INDUCTOR_PATCHES, **(options or {})}

    def compute_hash(self) -> str:
        from torch._inductor import config as inductor_config
        from torch._functorch import config as functorch_config

        functorch = {k: v for k, v in functorch_config.save_config_portable().items()
                     if k not in _CHECKS_ONLY}
        factors = [torch.__version__, sorted(self.options.items()),
                   sorted(inductor_config.save_config_portable().items()),
                   sorted(functorch.items())]
        return hashlib.sha256(repr(factors).encode()).hexdigest()[:16]

    def compile(self, graph, args, dynamic, save_dir):
        from torch._inductor import config as inductor_config
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        compilation_counter.num_inductor_compiles += 1
        shapes = "from_graph" if dynamic else "from_example_inputs"
        work = None if save_dir is None else save_dir.parent / (save_dir.name + ".inductor")
        with inductor_config.patch({**self.options, **vec_isa_patch()}):
            if work is None:
                return torch._inductor.standalone_compile(graph, list(args),
                                                          dynamic_shapes=shapes, options={})
            with temporary_cache_dir(str(work)):
                artifact = torch._inductor.standalone_compile(graph, list(args),
                                                              dynamic_shapes=shapes,
                                                              options={})
            artifact.save(path=str(save_dir), format="unpacked")
        record_vec_isa()
        _copy_shared_objects(work, save_dir)
        shutil.rmtree(work, ignore_errors=True)
        return artifact

    def load(self, artifact_dir):
        from torch._inductor import config as inductor_config

        with inductor_config.patch({**self.options, **vec_isa_patch()}), \
                _no_header_precompiling():
            fn = torch._inductor.CompiledArtifact.load(path=str(artifact_dir),
                                                       format="unpacked")
        record_vec_isa()
        compilation_counter.num_compiled_artifacts_loaded += 1
        return fn


def _copy_shared_objects(src: Path, dst: Path) -> None:
    for so in src.rglob("*.so"):
        target = dst / so.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, target)


def make_adaptor(backend: str, options: dict[str, Any]) -> CompilerAdaptor:
    return InductorAdaptor(options) if backend == "inductor" else EagerAdaptor()
