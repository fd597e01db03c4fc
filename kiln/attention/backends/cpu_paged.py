"""The "cpu" attention backend: kiln's C++ kernels, called straight from the compiled graph.

Where the torch backend runs per-layer Python inside the opaque `kiln::unified_attention`
op (which is why the graph is split around it), this backend's layers call the C++ op
`kiln_cpu::unified_attention` directly (`native_layer_op`). Nothing in it needs Python, so
the CPU graph has no split points: Inductor compiles the whole model into one graph per
token range and calls attention like any extern kernel. The batch layout is installed
thread-locally in C++ around each forward (`activate`/`deactivate`, driven by
`set_forward_context`), the counterpart of the Python forward context.

Single-token rows use the in-place paged decode kernel; rows of a prefill chunk use SDPA
over their gathered blocks, as the torch backend does.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

from kiln.attention.backend import AttentionBackend, AttentionCGSupport, AttentionMetadata
from kiln.ops import cpu_kernels


@dataclass(slots=True)
class CpuPagedMetadata(AttentionMetadata):
    decode_reqs: torch.Tensor | None = None  # [R] int64, single-token requests
    prefill_reqs: torch.Tensor | None = None  # [P] int64, the others

    def activate(self, kv_caches: Sequence[torch.Tensor], scales: Sequence[float]) -> None:
        torch.ops.kiln_cpu.set_batch(list(kv_caches), [float(s) for s in scales],
                                     self.slot_mapping, self.block_table,
                                     self.seq_lens, self.query_start_loc, self.decode_reqs,
                                     self.prefill_reqs, self.num_actual_tokens)

    def deactivate(self) -> None:
        torch.ops.kiln_cpu.clear_batch()


class CpuPagedBackend(AttentionBackend):
    name = "cpu"
    # Lengths are read on the host per step; there are no CUDA graphs on a CPU anyway.
    cg_support = AttentionCGSupport.NEVER
    native_layer_op = True

    @classmethod
    def supports(cls, head_size: int, dtype: torch.dtype, device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"it runs on the CPU only, not {device.type}"
        if dtype not in (torch.float32, torch.bfloat16):
            return f"dtype {dtype} is not supported (float32, bfloat16 are)"
        if head_size % 16 or head_size > 256:
            return f"head_size {head_size} is not a multiple of 16 up to 256"
        if not cpu_kernels.loaded():
            reason = cpu_kernels.unavailable_reason()
            return f"kiln's C++ CPU kernels are not available ({reason})"
        return None

    @classmethod
    def build_metadata(cls, common: AttentionMetadata) -> CpuPagedMetadata:
        qsl = common.query_start_loc_cpu
        decode, prefill = [], []
        for i in range(common.num_reqs):
            (decode if qsl[i + 1] - qsl[i] == 1 else prefill).append(i)
        base = {f.name: getattr(common, f.name) for f in fields(AttentionMetadata)}
        return CpuPagedMetadata(**base, decode_reqs=torch.tensor(decode, dtype=torch.int64),
                                prefill_reqs=torch.tensor(prefill, dtype=torch.int64))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata,
                output: torch.Tensor) -> None:
        """The backend interface, for callers outside a model forward (tests, benches):
        installs the batch with this one cache as layer 0 and runs the op."""
        if not isinstance(metadata, CpuPagedMetadata):
            metadata = self.build_metadata(metadata)
        s, t = self.spec, query.shape[0]
        metadata.activate([kv_cache], [s.scale])
        try:
            torch.ops.kiln_cpu.unified_attention(
                query.view(t, s.num_heads, s.head_size),
                key.view(t, s.num_kv_heads, s.head_size),
                value.view(t, s.num_kv_heads, s.head_size),
                output.view(t, s.num_heads, s.head_size), 0)
        finally:
            metadata.deactivate()
