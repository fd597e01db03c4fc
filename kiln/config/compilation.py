"""CompilationConfig and the names it speaks in: compilation modes, CUDA-graph modes,
capture sizes and the ops the graph is split at.

Everything here is data: the ops to split at are strings ("namespace::name"), so this
module imports neither attention nor the graph layer (which import it).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Sequence

# The opaque attention op (kiln.attention.op registers it under this name): the graph is
# split at every call of it.
SPLITTING_OPS = ("kiln::unified_attention",)


class CUDAGraphMode(Enum):
    """Which parts of a forward run as captured graphs.

    A runtime mode is NONE, PIECEWISE (the compiled pieces between attention ops) or FULL (the
    whole forward, attention included). The two pair modes name a decode mode and a mixed
    mode: uniform-decode batches (one token per request) use the first, every other batch the
    second, exactly as vLLM's `(decode_mode, mixed_mode)` tuples.
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (2, 0)  # FULL for uniform decode, eager otherwise
    FULL_AND_PIECEWISE = (2, 1)  # FULL for uniform decode, PIECEWISE otherwise

    @classmethod
    def parse(cls, value: CUDAGraphMode | str | int) -> CUDAGraphMode:
        if isinstance(value, CUDAGraphMode):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1, 2):
            return cls(value)
        names = ", ".join(m.lower() for m in cls.__members__)
        raise ValueError(f"compilation.cudagraph_mode={value!r} is not a graph mode; use one "
                         f"of {names}")

    def separate_routine(self) -> bool:
        """True for the pair modes: decode and mixed batches dispatch differently."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        return mode in (self.decode_mode(), self.mixed_mode())

    def has_full_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.FULL)

    def has_piecewise_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def without_piecewise(self) -> CUDAGraphMode:
        """PIECEWISE -> NONE, FULL_AND_PIECEWISE -> FULL_DECODE_ONLY (no compiled pieces)."""
        if self is CUDAGraphMode.PIECEWISE:
            return CUDAGraphMode.NONE
        if self is CUDAGraphMode.FULL_AND_PIECEWISE:
            return CUDAGraphMode.FULL_DECODE_ONLY
        return self

    def __bool__(self) -> bool:
        return self is not CUDAGraphMode.NONE

    def __str__(self) -> str:
        return self.name


RUNTIME_MODES = (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)


MAX_DEFAULT_CAPTURE_SIZE = 512


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... (step 8 up to 256, then 16) up to twice the request limit
    (decode batches never exceed max_num_seqs tokens; the head room serves small mixed
    batches), at most 512 and at most max_num_batched_tokens."""
    top = min(2 * max_num_seqs, MAX_DEFAULT_CAPTURE_SIZE, max_num_batched_tokens)
    ladder = [1, 2, 4, *range(8, 256, 8), *range(256, MAX_DEFAULT_CAPTURE_SIZE + 1, 16)]
    return [s for s in ladder if s <= top]


def validate_capture_sizes(sizes: Sequence[int], max_num_batched_tokens: int) -> list[int]:
    for s in sizes:
        if not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= max_num_batched_tokens:
            raise ValueError(f"compilation.cudagraph_capture_sizes entry {s!r} must be an "
                             f"integer in [1, max_num_batched_tokens={max_num_batched_tokens}]"
                             "; drop it or raise max_num_batched_tokens")
    return sorted(set(sizes))


class CompilationMode(IntEnum):
    NONE = 0  # eager PyTorch
    PIECEWISE = 1  # trace once, split at attention, compile pieces (Inductor or eager)


_COMPILE_BACKENDS = ("inductor", "eager")
_GRAPH_BACKENDS = ("auto", "cpu_test")
# Fields that shape the graph layer, not the compiled code: left out of the compile-cache
# key, so levels that differ only in graphs share their compiled artifacts.
GRAPH_FIELDS = ("cudagraph_mode", "cudagraph_capture_sizes", "graph_backend")


@dataclass(slots=True)
class CompilationConfig:
    """How the model is compiled. Fields left None are filled by the optimization level."""

    mode: int | None = None
    backend: str = "inductor"  # "inductor" | "eager" (trace and split, no codegen: debugging)
    splitting_ops: list[str] | None = None  # None: the attention ops; []: one whole graph
    compile_sizes: list[int] | None = None  # static-shape builds, exact token counts
    compile_ranges_endpoints: list[int] | None = None  # symbolic builds over ranges
    # Compile one decoder layer and reuse it for all (`torch.compiler.nested_compile_region`;
    # kiln.compiler.build.use_regions says where it applies). None: the level's default.
    compile_regions: bool | None = None
    use_cache: bool = True
    cache_dir: str | None = None  # None: $KILN_CACHE_DIR, else $KILN_HOME/compile_cache
    inductor_options: dict | None = None  # torch._inductor.config overrides
    # none | piecewise | full | full_decode_only | full_and_piecewise (kiln.graphs)
    cudagraph_mode: CUDAGraphMode | str | None = None
    cudagraph_capture_sizes: list[int] | None = None  # None: 1, 2, 4, 8, 16, 24, ... (dispatcher)
    # "auto": CUDA graphs where CUDA exists, none elsewhere. "cpu_test": the CPU test graph
    # (kiln.graphs.CpuTestGraph), a stand-in that enforces the replay contract so tests
    # run dispatch, padding and nested wrappers end to end without a GPU; not faster.
    graph_backend: str = "auto"

    def validate(self, max_num_batched_tokens: int) -> None:
        if self.mode is not None and self.mode not in tuple(CompilationMode):
            raise ValueError(f"compilation.mode={self.mode!r} must be 0 (none) or 1 "
                             "(piecewise)")
        if self.backend not in _COMPILE_BACKENDS:
            raise ValueError(f"compilation.backend={self.backend!r} must be one of "
                             f"{', '.join(_COMPILE_BACKENDS)}")
        for op in self.splitting_ops or []:
            if "::" not in op:
                raise ValueError(f"compilation.splitting_ops entry {op!r} must name an op "
                                 "as 'namespace::name', e.g. 'kiln::unified_attention'")
        for size in self.compile_sizes or []:
            if not isinstance(size, int) or not 1 <= size <= max_num_batched_tokens:
                raise ValueError(f"compilation.compile_sizes entry {size!r} must be an "
                                 f"integer in [1, max_num_batched_tokens="
                                 f"{max_num_batched_tokens}]")
        if self.cudagraph_mode is not None:
            self.cudagraph_mode = CUDAGraphMode.parse(self.cudagraph_mode)
        if self.graph_backend not in _GRAPH_BACKENDS:
            raise ValueError(f"compilation.graph_backend={self.graph_backend!r} must be one "
                             f"of {', '.join(_GRAPH_BACKENDS)}")
        if self.inductor_options is not None and not isinstance(self.inductor_options, dict):
            raise ValueError("compilation.inductor_options must be a dict of "
                             "torch._inductor.config names to values")
        ends = list(self.compile_ranges_endpoints or [])
        if ends != sorted(set(ends)) or any(not 1 <= e < max_num_batched_tokens for e in ends):
            raise ValueError(f"compilation.compile_ranges_endpoints={ends} must be strictly "
                             f"increasing integers in [1, {max_num_batched_tokens}); "
                             "max_num_batched_tokens is always the last endpoint")

    def compile_ranges(self, max_num_batched_tokens: int) -> list[tuple[int, int]]:
        """Inclusive (start, end) token-count ranges covering 1..max_num_batched_tokens."""
        ranges, start = [], 1
        for end in [*(self.compile_ranges_endpoints or []), max_num_batched_tokens]:
            ranges.append((start, end))
            start = end + 1
        return ranges
