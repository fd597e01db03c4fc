"""Engine configuration: every user-facing knob, validated in one place.

Misconfiguration raises `ValueError` at start-up naming the field and the fix; nothing
here uses `assert` (which `python -O` strips).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.config.compilation import CompilationConfig
from kiln.config.generation import parse_generation_config, parse_override
from kiln.config.kv_transfer import KVTransferConfig, parse_kv_transfer_config
from kiln.config.levels import OptimizationLevel, apply_level_defaults
from kiln.config.lora import LoRAConfig
from kiln.config.parallel import check_parallel, check_pipeline_features
from kiln.config.quantization import CHOICES as QUANTIZATION_CHOICES
from kiln.config.speculative import SpeculativeConfig, parse_speculative_config
from kiln.config.utils import parse_bytes, positive_int
from kiln.platforms import platform_for

_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16"}


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
    # Contiguous layer stages, one process group of tensor_parallel_size ranks each
    # (KILN_PP_LAYER_PARTITION overrides the even split)
    pipeline_parallel_size: int = 1
    # "uni" | "mp" | "external_launcher"; None: "mp" when tp * pp > 1
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
    # Default sampling parameters (kiln.config.generation), vLLM's names: "auto" (the
    # model's generation_config.json), "kiln" (none), or a folder or file path; and a dict
    # (or JSON) of generation-config keys laid over it
    generation_config: str = "auto"
    override_generation_config: dict | str | None = None
    # An IO processor plugin by name (kiln.entrypoints.io_processor); None: the model
    # config.json's `io_processor_plugin`, if any
    io_processor_plugin: str | None = None

    def __post_init__(self) -> None:
        # The platform (a plugin's may, kiln.platforms) adjusts the fields first, so what it
        # sets is validated and gets the level's defaults like the user's own settings.
        if self.device in ("cpu", "cuda"):
            platform_for(self.device).check_and_update_config(self)
        self.dtype = parse_dtype(self.dtype)
        self.generation_config = parse_generation_config(self.generation_config)
        self.override_generation_config = parse_override(self.override_generation_config)
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization={self.quantization!r} must be one of "
                             f"{', '.join(QUANTIZATION_CHOICES)}, or unset to follow the "
                             "checkpoint")
        if self.optimization_level not in tuple(OptimizationLevel):
            raise ValueError(f"optimization_level={self.optimization_level!r} must be 0, 1, "
                             "2 or 3 (-O0..-O3)")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            positive_int(name, getattr(self, name))
        if self.block_size % 8:
            raise ValueError(f"block_size={self.block_size} must be a multiple of 8 "
                             "(e.g. 16, the default)")
        if self.max_model_len is not None:
            positive_int("max_model_len", self.max_model_len)
        if self.kv_cache_memory is not None and self.num_kv_blocks is not None:
            raise ValueError("set either kv_cache_memory or num_kv_blocks, not both")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        if self.num_kv_blocks is not None:
            positive_int("num_kv_blocks", self.num_kv_blocks)
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
        check_parallel(self.tensor_parallel_size, self.distributed_executor_backend,
                       self.device, self.pipeline_parallel_size)
        self.lora_config()  # a bad LoRA limit fails here, named
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.speculative_config is not None and self.speculative_config.uses_draft_kv \
                and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config.method='draft_model' runs with "
                             "tensor_parallel_size=1 only (the draft is not sharded); use "
                             "method 'ngram' with tensor parallelism, or -tp 1")
        self._validate_kv_transfer()
        check_pipeline_features(self)
        self.compilation = _compilation(self.compilation)
        self.compilation.validate(self.max_num_batched_tokens)
        self._apply_level()

    def _validate_kv_transfer(self) -> None:
        self.kv_transfer_config = parse_kv_transfer_config(self.kv_transfer_config)
        if self.kv_transfer_config is not None and self.tensor_parallel_size > 1:
            raise ValueError("kv_transfer_config runs with tensor_parallel_size=1 only (the "
                             "scheduler side reads every block it loads, and ranks hold "
                             "different heads); use -tp 1")
        sc = self.speculative_config
        if self.kv_transfer_config is not None and sc is not None and sc.uses_draft_kv:
            # The connector moves the target's KV only: a prefix loaded from a tier or a
            # prefill instance leaves the draft's slots for it stale, and acceptance would
            # drop with no sign. Refused rather than degraded silently.
            raise ValueError("speculative_config.method='draft_model' does not run with "
                             "kv_transfer_config yet (a loaded prefix carries the target's "
                             "KV, not the draft's); use method 'ngram' with a KV connector")

    def lora_config(self) -> LoRAConfig | None:
        """The LoRAConfig when LoRA is on, else None."""
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_cpu_loras, self.max_lora_rank)

    def _apply_level(self) -> None:
        """Fill level-controlled fields that are still None; explicit settings win."""
        apply_level_defaults(self.compilation, self.optimization_level, self.device,
                             self.max_num_seqs, self.max_num_batched_tokens)

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
