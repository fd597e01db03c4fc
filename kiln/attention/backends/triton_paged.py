"""Triton paged attention: one kernel launch for a whole mixed batch, graph-capturable.

The KV write and the attention kernel take every size from tensor shapes and every length
from device tensors (`query_start_loc`, `seq_lens`, `block_table`, `slot_mapping`), so a
CUDA graph captured for one batch replays correctly for any other batch of the same padded
shape: the backend declares `AttentionCGSupport.ALWAYS`. On a CPU it runs only under
`TRITON_INTERPRET=1` (numpy, slow) — that is how CI checks it against the torch backend.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from kiln.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionLayerSpec,
                                    AttentionMetadata)
from kiln.ops.triton_runtime import interpreter_reason, triton_installed

if TYPE_CHECKING:
    from kiln.attention.kernels.attention_kernel import UnifiedAttentionConfig

MAX_HEAD_SIZE = 256  # Q, a K/V tile and the fp32 accumulator of 256 lanes fit on chip
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TritonPagedBackend(AttentionBackend):
    name = "triton"
    cg_support = AttentionCGSupport.ALWAYS
    # Set by a tuning harness to force launch meta-parameters; None = default_config().
    kernel_config: ClassVar[UnifiedAttentionConfig | None] = None

    def __init__(self, spec: AttentionLayerSpec) -> None:
        super().__init__(spec)
        # Imported here, not at module level: selecting among backends must not import Triton.
        from kiln.attention.kernels import attention_kernel, kv_write

        self._attention = attention_kernel.unified_attention
        self._write = kv_write.write_kv

    @classmethod
    def supports(cls, head_size: int, dtype: torch.dtype, device: torch.device) -> str | None:
        if not triton_installed():
            return "the 'triton' package is not installed"
        if dtype not in DTYPES:
            return f"dtype {dtype} is not supported (float32, bfloat16, float16 are)"
        if not 1 <= head_size <= MAX_HEAD_SIZE:
            return f"head_size {head_size} is not supported (1..{MAX_HEAD_SIZE})"
        if device.type == "cpu":
            return interpreter_reason()
        if device.type != "cuda":
            return f"device type {device.type!r} is not supported (cuda, or cpu interpreted)"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (7, 5):
            return f"compute capability {major}.{minor} is below 7.5"
        if dtype == torch.bfloat16 and major < 8:
            return f"bfloat16 needs compute capability 8.0 (this GPU has {major}.{minor})"
        return None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata,
                output: torch.Tensor) -> None:
        # Every row is handed to the kernels, padding included: the write skips slot -1 and
        # the attention grid covers the padded count, so nothing here reads a host length.
        s, t = self.spec, query.shape[0]
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [blocks, block_size, kv_heads, hd]
        self._write(key.view(t, s.num_kv_heads, s.head_size),
                    value.view(t, s.num_kv_heads, s.head_size), key_cache, value_cache,
                    metadata.slot_mapping)
        self._attention(query.view(t, s.num_heads, s.head_size), key_cache, value_cache,
                        output.view(t, s.num_heads, s.head_size), metadata.block_table,
                        metadata.seq_lens, metadata.query_start_loc, s.scale,
                        config=self.kernel_config, sliding_window=s.sliding_window,
                        logits_soft_cap=s.logits_soft_cap)
