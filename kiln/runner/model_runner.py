"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

It owns the model, the KV cache and persistent input buffers whose addresses never change
(`input_ids`, `positions`, a `slot_mapping` and a `block_table` per KV-cache group,
`query_start_loc`, `seq_lens`);
each step fills their heads and the model reads slices of them. When the graph dispatcher
picks a graph, the token count is padded to its size inside these buffers (padding rows:
slot -1, null block, `is_padding`), so a captured graph always sees the same addresses.
Logits are computed only for each request's last scheduled token, and only when that
token completes its prompt or is a decode (a prefill chunk that stops short samples
nothing).
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from kiln.attention.backend import AttentionMetadata
from kiln.attention.forward_context import BatchDescriptor, ForwardContext, set_forward_context
from kiln.attention.selector import select_backend
from kiln.compiler.build import compile_model, use_regions
from kiln.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
from kiln.config.kv_transfer import KVTransferConfig
from kiln.config.lora import LoRAConfig
from kiln.config.quantization import QuantizationConfig
from kiln.config.speculative import SpeculativeConfig
from kiln.kv_transfer.base import KVConnectorRole
from kiln.kv_transfer.registry import connector_for
from kiln.lora.manager import LoRAManager
from kiln.models.layers import set_regions
from kiln.models.model_config import ModelConfig
from kiln.models.packing import plan_signature
from kiln.ops import cpu_kernels
from kiln.runner.buffers import CpuGpuBuffer
from kiln.runner.cudagraphs import (capture_all, graph_factory, resolve_dispatcher, wrap_full,
                                    wrap_pieces)
from kiln.runner.drafter import make_drafter
from kiln.runner.kept_rows import KeptRows, step_rows
from kiln.runner.kv_alloc import build_kv_cache
from kiln.runner.load import load_weights
from kiln.runner.phases import Phases
from kiln.runner.pipeline_io import pipeline_io
from kiln.runner.prompt_logprobs import compute_prompt_logprobs
from kiln.runner.sample_step import sample_step
from kiln.runner.state import CachedRequestState, RunnerLimits, StepRow, adapter_blocks
from kiln.runner.step_timer import DecodeStepTimer
from kiln.sampling.sampler import Sampler
from kiln.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    """One rank's model, KV cache and persistent buffers; `execute` runs a step.

    Start-up is a fixed sequence (each step below needs the ones before it): load the
    weights, choose attention and lay out the KV cache, allocate the persistent buffers,
    install the LoRA slots, resolve the graph dispatcher, compile (or load) every size,
    capture the graphs, then the drafter and the KV connector."""

    def __init__(self, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 limits: RunnerLimits, *, kv_cache_memory: int | None = None,
                 num_kv_blocks: int | None = None, attention_backend: str | None = None,
                 compilation: CompilationConfig | None = None, progress: bool = True,
                 quantization: QuantizationConfig | None = None,
                 lora: LoRAConfig | None = None,
                 speculative: SpeculativeConfig | None = None,
                 draft_model_config: ModelConfig | None = None,
                 kv_transfer: tuple[KVTransferConfig, dict] | None = None) -> None:
        self.config, self.dtype, self.device, self.limits = model_config, dtype, device, limits
        self.quantization = quantization or QuantizationConfig()
        self.phases = phases = Phases()  # where start-up's seconds go (runner/phases.py)
        with cpu_kernels.beside_build():
            with phases("weights"):
                self.model = load_weights(model_config, self.quantization, dtype, device,
                                          progress)
            with phases("KV cache"):
                self._init_attention(attention_backend, kv_cache_memory, num_kv_blocks)
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self._alloc_buffers()
        self.kept_rows = KeptRows(self.model, limits.max_num_batched_tokens, device)
        self._init_lora(lora)
        # With speculation, uniform decode also comes as 1 + k tokens per request.
        self._spec_k = speculative.num_speculative_tokens if speculative else 0
        # Pipeline parallelism: `pp_in` exists before tracing; the hand-off wraps the
        # forward after compiling and capturing (which must not send anything).
        self.pipeline = pipeline_io(self.model, limits.max_num_batched_tokens, dtype, device)
        self._init_forward(compilation, lora, progress)
        if self.pipeline is not None:
            self.forward = self.pipeline.wrap(self.forward, bool(self.dispatcher.mode))
        with phases("drafter"):
            self.drafter = None if speculative is None else make_drafter(
                speculative, self, draft_model_config, compilation, attention_backend,
                progress)
        self._step_timer = None if self.drafter is None else DecodeStepTimer(
            self.drafter.observe_step)
        # The worker side of the KV connector, over this rank's cache layout.
        self.kv_connector = None if kv_transfer is None else connector_for(
            kv_transfer[0], KVConnectorRole.WORKER, kv_transfer[1], self.kv_spec,
            len(self.kv_caches), self.quantization)
        self._kv_layout.start_backfill()  # the rest of the cache, once nothing compiles

    def _init_attention(self, name: str | None, kv_cache_memory: int | None,
                        num_kv_blocks: int | None) -> None:
        """The attention backend (before tracing: a layer's call is fixed in the graph)
        and the KV cache: groups over this rank's KV heads, one pool, each layer's view."""
        layers = self.model.attention_layers()
        backend_cls = select_backend(name, self.config.head_dim, self.dtype, self.device,
                                     [layer.spec for layer in layers])
        self.attn_backend_cls = backend_cls
        self.attn_backends = [backend_cls(layer.spec) for layer in layers]
        for i, layer in enumerate(layers):
            layer.native_op = backend_cls.native_layer_op
            # This rank's KV caches, counted from 0 (a pipeline stage's layers start later).
            layer.layer_index = i
            layer.layer_id.fill_(i)  # whatever built the model
        kv = build_kv_cache([layer.spec for layer in layers], self.limits.block_size,
                            self.dtype, self.device, kv_cache_memory, num_kv_blocks)
        self.kv_groups, self.kv_spec, self.layer_groups = kv.groups, kv.spec, kv.layer_groups
        self.num_kv_blocks, self._kv_buffer, self.kv_caches = kv.num_blocks, kv.buffer, kv.caches
        self._kv_layout = kv  # its `ready` joined before the first forward writes the cache
        logger.info("attention backend %s; %s", backend_cls.name, kv.describe())

    def _init_lora(self, lora: LoRAConfig | None) -> None:
        """The LoRA slots (before tracing: they are graph inputs, written in place from
        then on), and the buffers copied to the device every step (the LoRA indices only
        when a graph reads them)."""
        self.lora = None if lora is None else LoRAManager(
            self.model, lora, self.lora_indices.device, self.dtype)
        self._step_buffers = (self.input_ids, self.positions, *self.slot_mappings,
                              self.is_padding) + ((self.lora_indices,) if self.lora else ())

    def _init_forward(self, compilation: CompilationConfig | None, lora: LoRAConfig | None,
                      progress: bool) -> None:
        """The dispatcher (resolved before compiling: a compile size that padding would
        skip fails fast), the compiled forward with every size built or loaded, and the
        captured graphs. Without compilation the forward is the eager model."""
        self.dispatcher = resolve_dispatcher(compilation, self.attn_backend_cls,
                                             self.limits.max_num_seqs, 1 + self._spec_k)
        self.forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self.model
        self.compile_backend = None
        if compilation is not None and compilation.mode == CompilationMode.PIECEWISE:
            with self.phases("compile"):  # trace, then compile or load every size
                set_regions(self.model, use_regions(compilation,
                                                    self.attn_backend_cls.native_layer_op))
                self.forward, self.compile_backend = compile_model(
                    self.model, compilation, self.dtype, self.device,
                    self.limits.max_num_batched_tokens, progress,
                    attention_backend=self.attn_backend_cls.name,
                    quantization=self.quantization.cache_key(),
                    lora=lora.cache_key() if lora else None,
                    weight_plan=plan_signature(self.model))
                self._compile_now()
        with self.phases("kernel wait"):  # -O0: the build ran beside the weights' load
            cpu_kernels.wait_planned()  # (a compile waited for it before running)
            if self._kv_layout.ready is not None:  # _compile_now's forwards wrote no KV
                self._kv_layout.ready.join()
        self.graph_capture_s = 0.0
        if self.dispatcher.mode:
            with self.phases("graphs"):
                self._install_graphs(compilation.graph_backend)
                self.capture_model(progress)

    def context(self, metadata: list[AttentionMetadata] | None,
                 desc: BatchDescriptor | None = None, padding: torch.Tensor | None = None,
                 mode: CUDAGraphMode | None = None) -> ForwardContext:
        return ForwardContext(metadata, self.kv_caches, self.attn_backends, desc, padding,
                              mode, self.layer_groups)

    @torch.inference_mode()
    def _compile_now(self) -> None:
        """Trace and compile (or load) every size and range before the first request.

        The trace is symbolic in the token count, so a short dummy batch suffices (a full
        2048-token forward would cost seconds); a second call with one token must reuse
        what was built. Attention is a no-op without metadata."""
        ctx = self.context(None)
        for n in (min(self.limits.max_num_batched_tokens, 16), 1):
            with set_forward_context(ctx):
                self.forward(self.input_ids.device[:n], self.positions.device[:n])

    # ---- graphs --------------------------------------------------------------------------
    def _install_graphs(self, graph_backend: str) -> None:
        factory = graph_factory(graph_backend)
        self.graph_wrappers = []
        if self.dispatcher.mode.has_piecewise_cudagraphs():
            self.graph_wrappers += wrap_pieces(self.compile_backend.split_gm, factory)
        if self.dispatcher.mode.has_full_cudagraphs():
            self.forward = wrap_full(self.forward, factory)
            self.graph_wrappers.append(self.forward)

    @torch.inference_mode()
    def capture_model(self, progress: bool = False) -> int:
        """Capture every key the dispatcher hands out before the first request; serving
        never captures."""
        return capture_all(self, progress)

    def _alloc_buffers(self) -> None:
        lim, dev = self.limits, self.device
        max_tokens, max_reqs = lim.max_num_batched_tokens, lim.max_num_seqs
        max_blocks = -(-lim.max_model_len // lim.block_size)
        self.input_ids = CpuGpuBuffer(max_tokens, dtype=torch.int64, device=dev)
        self.positions = CpuGpuBuffer(max_tokens, dtype=torch.int64, device=dev)
        # One slot mapping and block table per KV-cache group.
        self.slot_mappings = [CpuGpuBuffer(max_tokens, dtype=torch.int64, device=dev)
                              for _ in self.kv_groups]
        self.query_start_loc = CpuGpuBuffer(max_reqs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = CpuGpuBuffer(max_reqs, dtype=torch.int32, device=dev)
        self.block_tables = [CpuGpuBuffer(max_reqs, max_blocks, dtype=torch.int32, device=dev)
                             for _ in self.kv_groups]
        self.is_padding = CpuGpuBuffer(max_tokens, dtype=torch.bool, device=dev)
        self.lora_indices = CpuGpuBuffer(max_tokens, dtype=torch.int64, device=dev)
        self.lora_indices.np[:] = -1  # each token's LoRA slot; -1: the base model
        self.lora_indices.copy_to_device()
        self._arange = np.arange(max(lim.max_model_len, max_tokens) + 1, dtype=np.int64)

    # ---- state ---------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), [list(ids) for ids in new.block_ids],
                new.num_computed_tokens, params, gen, new.num_prompt_tokens,
                new.eos_token_ids, new.lora_request)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            for ids, new_ids in zip(state.block_ids, cached.new_block_ids):
                ids.extend(new_ids)
            state.num_computed_tokens = start = cached.num_computed_tokens
            if cached.token_ids:  # pipeline stages before the last never sampled them
                state.token_ids[start: start + len(cached.token_ids)] = cached.token_ids

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self._step_timer is not None:
            self._step_timer.start(so)
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput([], [])
        req_ids = list(so.num_scheduled_tokens)
        step = step_rows(self.requests, req_ids, so, self._lora_slots(req_ids))
        rows, logits_indices, sample_ids = step.rows, step.logits_indices, step.sample_ids
        meta = so.kv_connector_metadata if self.kv_connector is not None else None
        if meta is not None:
            if self.lora is not None and self.lora.failed:  # rows that ran without theirs
                meta.drop_saves(adapter_blocks(map(self.requests.get, req_ids),
                                               self.lora.failed))
            self.kv_connector.start_load_kv(meta, self._kv_buffer)
        step_states = [self.requests[rid] for rid in req_ids]
        with self.kept_rows.reading(step_states, step, so.total_num_scheduled_tokens) as keep:
            hidden = self.forward_rows(rows, self._spec_k + 1 if so.scheduled_spec_decode_tokens
                                       else 1, keep)
        if self.pipeline is not None and not self.pipeline.stage.last:
            return ModelRunnerOutput(req_ids, [])  # the last stage samples and answers
        out = ModelRunnerOutput(req_ids, [], failed_loras=self.lora.failed if self.lora else {})
        if meta is not None:  # the blocks this step filled, copied out before any reuse
            for layer, kv in enumerate(self.kv_caches):
                self.kv_connector.save_kv_layer(layer, kv, meta)
            self.kv_connector.wait_for_save(meta)
            out.kv_connector_stats = self.kv_connector.take_worker_stats()
        sampled: dict[str, list[int]] = {}
        states = [self.requests[rid] for rid in sample_ids]
        if states:
            indices = torch.tensor(logits_indices, dtype=torch.int64, device=self.device)
            sampled = sample_step(self, hidden[indices], states, out, so)
        out.sampled_token_ids = [sampled.get(rid, []) for rid in req_ids]
        out.prompt_logprobs = compute_prompt_logprobs(
            self.model.compute_logits, hidden, step_states,
            so.num_scheduled_tokens, self.query_start_loc.np)
        if self.drafter is not None:  # drafts for the next step, from the tokens just taken
            out.spec_token_ids = self.drafter.propose(rows, states)
        return out

    def forward_rows(self, rows: list[StepRow], uniform_query_len: int = 1,
                     query_keep: list[int] | None = None) -> torch.Tensor:
        """One forward over `rows` (each request's tokens this step, in batch order):
        fills the persistent buffers, lets the dispatcher pick the graph, pads, builds the
        attention metadata and runs the model. Returns the hidden states, padded rows
        included ([padded tokens, hidden]); row r's tokens are at query_start_loc[r]...
        `query_keep`: the kept rows (kiln.runner.kept_rows), the only rows then read."""
        bs, num_reqs = self.limits.block_size, len(rows)
        qsl, seq_lens = self.query_start_loc.np, self.seq_lens.np
        tables = [t.np for t in self.block_tables]
        slot_maps = [m.np for m in self.slot_mappings]
        for table in tables:
            table[:num_reqs] = 0  # unused entries point at the null block
        qsl[0] = offset = 0
        for i, row in enumerate(rows):
            n = len(row.token_ids)
            start, end = row.start, row.start + n
            self.input_ids.np[offset: offset + n] = row.token_ids
            pos = self._arange[start:end]
            self.positions.np[offset: offset + n] = pos
            if self.lora is not None:
                self.lora_indices.np[offset: offset + n] = row.lora_slot
            for table, slots, ids in zip(tables, slot_maps, row.block_ids):
                table[i, : len(ids)] = ids
                slots[offset: offset + n] = table[i, pos // bs] * bs + pos % bs
            offset += n
            seq_lens[i], qsl[i + 1] = end, offset
        max_query_len = int(np.diff(qsl[: num_reqs + 1]).max())
        uniform = offset == num_reqs * max_query_len and max_query_len in (1, uniform_query_len)
        mode, desc = self.dispatcher.dispatch(offset, uniform_decode=uniform,
                                              query_len=max_query_len)
        padded = desc.num_tokens
        # Padding rows: token 0 at position 0, slot -1 (never written), flagged.
        self.input_ids.np[offset:padded] = 0
        self.positions.np[offset:padded] = 0
        for slots in slot_maps:
            slots[offset:padded] = -1
        if self.lora is not None:
            self.lora_indices.np[offset:padded] = -1
        self.is_padding.np[:offset] = False
        self.is_padding.np[offset:padded] = True
        if mode is CUDAGraphMode.FULL:
            # The graph's attention covers the descriptor's requests: padding requests get
            # the key's tokens per request (while padded tokens remain), the null block and
            # no writes.
            per = padded // desc.num_reqs if desc.uniform else 1
            for i in range(num_reqs, desc.num_reqs):
                take = min(per, padded - int(qsl[i]))
                qsl[i + 1], seq_lens[i] = qsl[i] + take, take
                for table in tables:
                    table[i] = 0
            num_reqs, offset_md = desc.num_reqs, padded
        else:
            offset_md = offset
        metadata = self.build_metadata(offset_md, num_reqs, padded, max_query_len, query_keep)
        ctx = self.context(metadata, desc, self.is_padding.device[:padded], mode)
        with set_forward_context(ctx):
            return self.forward(self.input_ids.device[:padded], self.positions.device[:padded])

    def _lora_slots(self, req_ids: list[str]) -> list[int] | None:
        """Each request's LoRA slot (-1: none), after making its adapter resident; None
        without LoRA (no graph reads the indices then: nothing to fill)."""
        if self.lora is None:
            return None
        loras = [self.requests[rid].lora_request for rid in req_ids]
        slot_of = self.lora.activate(r for r in loras if r is not None)
        return [-1 if r is None else slot_of[r.lora_int_id] for r in loras]

    def build_metadata(self, num_actual_tokens: int, num_reqs: int, num_padded: int,
                        max_query_len: int, query_keep: list[int] | None = None
                        ) -> list[AttentionMetadata]:
        """The backend's metadata per KV-cache group, from common metadata made of slices
        of the persistent buffers (fixed addresses: a FULL graph reads them on replay).
        Groups share the rows and differ in block table, slot mapping and window. The
        slot mappings cover the padded rows."""
        for buf in self._step_buffers:
            buf.copy_to_device(num_padded)
        seq_lens = self.seq_lens.np
        qsl = self.query_start_loc.copy_to_device(num_reqs + 1)
        lens = self.seq_lens.copy_to_device(num_reqs)
        qsl_cpu = self.query_start_loc.np[: num_reqs + 1].tolist()
        lens_cpu = seq_lens[:num_reqs].tolist()
        out = []
        for group, table, slots in zip(self.kv_groups, self.block_tables, self.slot_mappings):
            common = AttentionMetadata(
                num_actual_tokens=num_actual_tokens, num_reqs=num_reqs,
                query_start_loc=qsl, seq_lens=lens,
                block_table=table.copy_to_device(num_reqs),
                slot_mapping=slots.device[:num_padded],
                query_start_loc_cpu=qsl_cpu, seq_lens_cpu=lens_cpu,
                max_query_len=max_query_len, max_seq_len=int(seq_lens[:num_reqs].max()),
                block_size=self.limits.block_size,
                sliding_window=getattr(group.spec, "sliding_window", None),
                query_keep=query_keep,
                keep_layer=self.kept_rows.keep_layer)
            out.append(self.attn_backend_cls.build_metadata(common))
        return out
