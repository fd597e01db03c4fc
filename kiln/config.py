"""Engine configuration: every user-facing knob, validated in one place.

Misconfiguration raises `ValueError` at start-up naming the field and the fix; nothing
here uses `assert` (which `python -O` strips).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kiln.lora import LoRAConfig
    from kiln.spec_decode import SpeculativeConfig
    from kiln.kv_transfer import KVTransferConfig

from kiln.graphs.mode import CUDAGraphMode

logger = logging.getLogger(__name__)

_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16"}
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


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


class OptimizationLevel(IntEnum):
    """`-O0..-O3`: defaults for level-controlled fields, never overrides."""

    O0 = 0  # eager, no compilation, no graphs: the debugging baseline
    O1 = 1  # compiled pieces, PIECEWISE graphs
    O2 = 2  # + FULL graphs for uniform decode (the CLI default)
    O3 = 3  # + the expensive Inductor options where they pay off


def parse_bytes(value: int | str, field_name: str) -> int:
    """'2GiB' / '512MB' / 1048576 -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{field_name}={value!r} is not a size; write bytes like "
                             "'2GiB', '512MiB' or an integer")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{field_name}={value!r} must be positive")
    return n


def config_fields(value: dict[str, Any] | str, cls: type, name: str,
                  example: str) -> dict[str, Any]:
    """The fields of a dataclass config given as a dict or a JSON string (a CLI flag):
    bad JSON, another type or an unknown field is a ValueError that names `name`."""
    import dataclasses
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict such as {example}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"{name} has unknown field(s) {unknown}; known: {sorted(names)}")
    return value


def parse_dtype(value: str | torch.dtype) -> str:
    """Normalise a dtype name; 'auto' stays 'auto' until the model config is known."""
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(str(value).lower(), str(value).lower())
    if name not in _DTYPES:
        raise ValueError(f"dtype={value!r} is not supported; use one of "
                         f"{', '.join(_DTYPES)}")
    return name


@dataclass(slots=True)
class EngineConfig:
    """Everything that shapes an engine; validated by `__post_init__`.

    Fields left `None` are filled from the model (max_model_len) or the optimization level.
    """

    model: str | None = None
    dtype: str = "auto"
    optimization_level: int = 2  # as the CLI (and vLLM's LLM, which compiles by default)
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    num_kv_blocks: int | None = None
    seed: int = 0
    device: str = "cpu"
    attention_backend: str | None = None
    compilation: CompilationConfig | dict | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" (lower value first)
    long_prefill_token_threshold: int = 0  # 0: off
    full_sequence_must_fit: bool = False
    log_stats_interval_s: float = 10.0  # 0: never log scheduler stats
    tensor_parallel_size: int = 1
    # "uni" | "mp" | "external_launcher"; None: "mp" when tensor_parallel_size > 1
    distributed_executor_backend: str | None = None
    # "int8" | "int8-channel" | "gguf" | "none" (kiln.quantization); None: what the
    # checkpoint is (a quantized GGUF file stays quantized)
    quantization: str | None = None
    # LoRA (kiln.lora): slots on the device, an LRU CPU cache behind them, the largest rank
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None  # None: max_loras
    max_lora_rank: int = 16
    # Speculative decoding (kiln.spec_decode), vLLM's names: {"method": "ngram" |
    # "draft_model", "num_speculative_tokens": k, ...}, as a dict, JSON string or config
    speculative_config: SpeculativeConfig | dict | str | None = None
    # KV connector (kiln.kv_transfer), vLLM's names: {"kv_connector": "disk" |
    # "torch_distributed", "kv_role": ..., "kv_connector_extra_config": {...}}
    kv_transfer_config: KVTransferConfig | dict | str | None = None

    def __post_init__(self) -> None:
        self.dtype = parse_dtype(self.dtype)
        from kiln.quantization import CHOICES

        if self.quantization is not None and self.quantization not in CHOICES:
            raise ValueError(f"quantization={self.quantization!r} must be one of "
                             f"{', '.join(CHOICES)}, or unset to follow the checkpoint")
        if self.optimization_level not in tuple(OptimizationLevel):
            raise ValueError(f"optimization_level={self.optimization_level!r} must be 0, 1, "
                             "2 or 3 (-O0..-O3)")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            _positive_int(name, getattr(self, name))
        if self.block_size % 8:
            raise ValueError(f"block_size={self.block_size} must be a multiple of 8 "
                             "(e.g. 16, the default)")
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.kv_cache_memory is not None and self.num_kv_blocks is not None:
            raise ValueError("set either kv_cache_memory or num_kv_blocks, not both")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
            if self.num_kv_blocks < 2:
                raise ValueError("num_kv_blocks must be at least 2 (block 0 is the null block)")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} must be 'cpu' or 'cuda'")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available; use device='cpu'")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} must be 'fcfs' "
                             "or 'priority'")
        if not isinstance(self.long_prefill_token_threshold, int) \
                or self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold="
                             f"{self.long_prefill_token_threshold!r} must be 0 (off) or a "
                             "positive integer")
        self._validate_parallel()
        self.lora_config()  # a bad LoRA limit fails here, named
        from kiln.spec_decode import parse_speculative_config

        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.speculative_config is not None and self.speculative_config.uses_draft_kv \
                and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config.method='draft_model' runs with "
                             "tensor_parallel_size=1 only (the draft is not sharded); use "
                             "method 'ngram' with tensor parallelism, or -tp 1")
        self._validate_kv_transfer()
        self.compilation = _compilation(self.compilation)
        self.compilation.validate(self.max_num_batched_tokens)
        self._apply_level()

    def _validate_kv_transfer(self) -> None:
        from kiln.kv_transfer import parse_kv_transfer_config

        self.kv_transfer_config = parse_kv_transfer_config(self.kv_transfer_config)
        if self.kv_transfer_config is not None and self.tensor_parallel_size > 1:
            raise ValueError("kv_transfer_config runs with tensor_parallel_size=1 only (the "
                             "scheduler side reads every block it loads, and ranks hold "
                             "different heads); use -tp 1")

    def _validate_parallel(self) -> None:
        """What can be checked before the model is known; heads and sizes are checked
        against the checkpoint at start-up (`kiln.engine.setup.check_tensor_parallel`)."""
        from kiln.distributed.executor import BACKENDS
        from kiln.distributed.worker import cpu_threads_per_rank

        tp, backend = self.tensor_parallel_size, self.distributed_executor_backend
        _positive_int("tensor_parallel_size", tp)
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"distributed_executor_backend={backend!r} must be one of "
                             f"{', '.join(BACKENDS)}")
        if backend == "uni" and tp > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one process but "
                             f"tensor_parallel_size={tp}: use 'mp' (the default) or "
                             "'external_launcher'")
        if backend == "external_launcher":
            return  # the ranks may span hosts: torchrun decides what runs where
        if self.device == "cuda" and tp > 1 and tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tp} exceeds the "
                             f"{torch.cuda.device_count()} CUDA devices here")
        cpus = cpu_threads_per_rank(1)
        if self.device == "cpu" and tp > 2 * cpus:
            # Each rank needs a thread; past two ranks per CPU they only time-slice.
            raise ValueError(f"tensor_parallel_size={tp} exceeds what this host allows "
                             f"(at most {2 * cpus}: two ranks per CPU, {cpus} CPUs); lower "
                             "it, or spread ranks over hosts with torchrun")

    def lora_config(self) -> LoRAConfig | None:
        """The LoRAConfig when LoRA is on, else None."""
        from kiln.lora import LoRAConfig

        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_cpu_loras, self.max_lora_rank)

    def _apply_level(self) -> None:
        """Fill level-controlled fields that are still None; explicit settings win."""
        from kiln.optimization_levels import apply_level_defaults

        apply_level_defaults(self)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The requested dtype, or None for 'auto' (resolved against the checkpoint)."""
        return _DTYPES[self.dtype]


def _compilation(value: CompilationConfig | dict | None) -> CompilationConfig:
    if value is None:
        return CompilationConfig()
    if isinstance(value, dict):
        try:
            return CompilationConfig(**value)
        except TypeError as exc:
            raise ValueError(f"compilation: {exc}") from None
    if not isinstance(value, CompilationConfig):
        raise ValueError("compilation must be a CompilationConfig or a dict of its fields")
    return value


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
