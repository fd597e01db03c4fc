"""The "cpu" attention backend: kiln's C++ kernels, called straight from the compiled graph.

Where the torch backend runs per-layer Python inside the opaque `kiln::unified_attention`
op (which is why the graph is split around it), this backend's layers call the C++ op
`kiln_cpu::unified_attention` directly (`native_layer_op`). Nothing in it needs Python, so
the CPU graph has no split points: Inductor compiles the whole model into one graph per
token range and calls attention like any extern kernel. The batch layout is installed
thread-locally in C++ around each forward (`activate`/`deactivate`, driven by
`set_forward_context`), the counterpart of the Python forward context.

Single-token rows use the in-place paged decode kernel; rows of a prefill chunk use SDPA
over their gathered blocks, as the torch backend does. A short multi-token row (draft
verification under speculative decoding: 1 + k tokens after a long context) is split into
one decode row per token, with causal lengths: gathering the whole context for SDPA cost
more than the attention itself there. The split rows stay one run in `decode_reqs`, so
the kernel reads each key and value row once for all of them (per KV head), each token's
result bit for bit what it would be alone. The kernel writes every token's K/V before any
row attends, so token j sees tokens 0..j of its own step.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

from kiln.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionLayerSpec,
                                    AttentionMetadata)
from kiln.ops import cpu_kernels

# Rows of up to this many tokens, after a context at least as long, run as decode rows.
SPLIT_MAX_QUERY = 16
_EVERY_ROW = torch.empty(0, dtype=torch.int64)  # no kept-row counts: decode steps, mostly


@dataclass(slots=True)
class CpuPagedMetadata(AttentionMetadata):
    # [R, 2] int64 (first entry, rows): runs of consecutive entries that are one request's
    # consecutive query tokens (a split verify row; rows = 1 for a decode row). The kernel
    # reads each key and value row once per run and KV head, not once per token.
    decode_reqs: torch.Tensor | None = None
    prefill_reqs: torch.Tensor | None = None  # [P] int64, the others
    # [P] int64: the trailing query rows of each prefill entry layer `keep_layer` computes
    # (query_keep); the C++ op zeroes the others' output there. Empty: every row.
    prefill_keep: torch.Tensor = _EVERY_ROW

    def activate(self, groups: Sequence[AttentionMetadata], kv_caches: Sequence[torch.Tensor],
                 layer_groups: Sequence[int], specs: Sequence[AttentionLayerSpec]) -> None:
        # Rows (and their split) are the same in every group: only tables and slots differ.
        torch.ops.kiln_cpu.set_batch(
            list(kv_caches), [float(s.scale) for s in specs],
            [s.sliding_window or 0 for s in specs],
            [float(s.logits_soft_cap or 0.0) for s in specs], list(layer_groups),
            [g.slot_mapping for g in groups], [g.block_table for g in groups],
            self.seq_lens, self.query_start_loc, self.decode_reqs, self.prefill_reqs,
            self.num_actual_tokens, self.keep_layer if len(self.prefill_keep) else -1,
            self.prefill_keep)

    def deactivate(self) -> None:
        torch.ops.kiln_cpu.clear_batch()


def _runs(runs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(runs, dtype=torch.int64).view(-1, 2)


def _keep(common: AttentionMetadata, requests: list[int]) -> torch.Tensor:
    """Each prefill entry's kept query rows (the request's `query_keep`); empty when the
    step keeps every row."""
    keep = common.query_keep
    if keep is None or not requests:
        return _EVERY_ROW
    return torch.tensor([keep[i] for i in requests], dtype=torch.int64)


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
        if not cpu_kernels.planned():
            reason = cpu_kernels.unavailable_reason()
            return f"kiln's C++ CPU kernels are not available ({reason})"
        return None

    @classmethod
    def build_metadata(cls, common: AttentionMetadata) -> CpuPagedMetadata:
        qsl, lens = common.query_start_loc_cpu, common.seq_lens_cpu
        decode, prefill = [], []
        split = False
        for i in range(common.num_reqs):
            q = qsl[i + 1] - qsl[i]
            if q == 1:
                decode.append((i, 1))
            elif q <= SPLIT_MAX_QUERY and lens[i] >= 2 * q:
                split = True
                break
            else:
                prefill.append(i)
        base = {f.name: getattr(common, f.name) for f in fields(AttentionMetadata)}
        if split:
            return cls._split_rows(common, base)
        return CpuPagedMetadata(**base, decode_reqs=_runs(decode),
                                prefill_reqs=torch.tensor(prefill, dtype=torch.int64),
                                prefill_keep=_keep(common, prefill))

    @staticmethod
    def _split_rows(common: AttentionMetadata, base: dict) -> CpuPagedMetadata:
        """One entry per decode token (short rows split, each with its causal length
        and its request's block-table row), one per prefill row."""
        qsl, lens = common.query_start_loc_cpu, common.seq_lens_cpu
        starts, seq_lens, table_rows, decode, prefill, requests = [], [], [], [], [], []
        for i in range(common.num_reqs):
            q = qsl[i + 1] - qsl[i]
            if q == 1 or (q <= SPLIT_MAX_QUERY and lens[i] >= 2 * q):
                decode.append((len(starts), q))
                for j in range(q):
                    starts.append(qsl[i] + j)
                    seq_lens.append(lens[i] - q + 1 + j)
                    table_rows.append(i)
            else:
                prefill.append(len(starts))
                requests.append(i)
                starts.append(qsl[i])
                seq_lens.append(lens[i])
                table_rows.append(i)
        starts.append(qsl[common.num_reqs])
        base.update(num_reqs=len(seq_lens),
                    query_start_loc=torch.tensor(starts, dtype=torch.int32),
                    seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                    block_table=common.block_table[torch.tensor(table_rows)],
                    query_start_loc_cpu=starts, seq_lens_cpu=seq_lens, max_query_len=1
                    if not prefill else common.max_query_len)
        return CpuPagedMetadata(**base, decode_reqs=_runs(decode),
                                prefill_reqs=torch.tensor(prefill, dtype=torch.int64),
                                prefill_keep=_keep(common, requests))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata,
                output: torch.Tensor) -> None:
        """The backend interface, for callers outside a model forward (tests, benches):
        installs the batch with this one cache as layer 0 and runs the op."""
        if not isinstance(metadata, CpuPagedMetadata):
            metadata = self.build_metadata(metadata)
        s, t = self.spec, query.shape[0]
        metadata.activate([metadata], [kv_cache], [0], [s])
        try:
            torch.ops.kiln_cpu.unified_attention(
                query.view(t, s.num_heads, s.head_size),
                key.view(t, s.num_kv_heads, s.head_size),
                value.view(t, s.num_kv_heads, s.head_size),
                output.view(t, s.num_heads, s.head_size), torch.tensor(0))
        finally:
            metadata.deactivate()
