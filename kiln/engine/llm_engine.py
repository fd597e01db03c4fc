"""LLMEngine: add requests, step, collect outputs. Synchronous; the model runs in the
executor's workers (in process, or one process per tensor-parallel rank)."""
from __future__ import annotations

import gc
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from kiln.compiler.cache import default_cache_root
from kiln.compiler.vec_isa import probe_in_background
from kiln.config.engine import EngineConfig
from kiln.distributed.pipeline import layer_partition
from kiln.engine.batch_queue import BatchQueue, tells_workers
from kiln.engine.detokenizer import token_namer
from kiln.engine.output_processor import OutputProcessor, sample_ids
from kiln.engine.outputs import RequestOutput
from kiln.engine.startup import (check_draft_model, check_kv_capacity,
                                 check_kv_transfer_params, check_sliding_window,
                                 check_tensor_parallel, kv_fingerprint, load_tokenizer,
                                 resolve_dtype, resolve_max_model_len)
from kiln.engine.stat_loggers import (iteration_stats, load_stat_loggers,
                                      log_engine_initialized, prompt_tokens_scheduled,
                                      record_all)
from kiln.executor.abstract import Executor
from kiln.executor.factory import make_executor, resolve_backend, runs_in_process
from kiln.executor.worker import RunnerSpec
from kiln.executor.zygote import engine_starting
from kiln.kv_cache.block_hash import BlockHasher
from kiln.kv_cache.kv_cache_manager import KVCacheManager
from kiln.kv_transfer.base import KVConnectorRole
from kiln.kv_transfer.registry import connector_for
from kiln.lora.registry import AdapterRegistry
from kiln.lora.request import LoRAError, LoRARequest
from kiln.models.model_config import ModelConfig
from kiln.models.model_source import gguf_source, resolve_model
from kiln.models.registry import model_class
from kiln.ops import cpu_kernels
from kiln.platforms import platform_for
from kiln.plugins import load_general_plugins
from kiln.quantization.resolve import resolve_quantization
from kiln.request import Request, RequestStatus
from kiln.runner.phases import Phases
from kiln.runner.state import RunnerLimits
from kiln.sampling.defaults import generation_defaults
from kiln.sampling.params import SamplingParams
from kiln.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kiln.scheduler.scheduler import Scheduler
from kiln.scheduler.step import SchedulerPolicy, SchedulerStats
from kiln.spec_decode.metrics import SpecDecodingStats

if TYPE_CHECKING:  # imported on first use: xgrammar loads only when a constraint comes
    from kiln.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class LLMEngine:
    """Owns the tokenizer, scheduler and runner. `add_request` validates a request alone:
    a bad one raises `ValueError` and leaves the engine and every other request as they
    were."""

    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        failure = None
        try:
            self._start(config, progress)
        except cpu_kernels.BuildFailed as exc:  # after the plan counted on the kernels
            failure = str(exc)
        if failure is None:
            return
        # Outside the handler: its traceback would keep the first runner (weights, KV
        # cache) alive beside the second.
        gc.collect()
        logger.warning("%s; starting again without them (slower; an `auto` dtype becomes "
                       "float32)", failure)
        self._start(config, progress)

    def _start(self, config: EngineConfig, progress: bool) -> None:
        start = time.perf_counter()
        self.config = config
        self.phases = phases = Phases()  # where start-up's seconds go
        load_general_plugins()  # plugins register models before any is resolved
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        in_process = runs_in_process(config.distributed_executor_backend, tp, pp)
        if config.device == "cpu" and in_process and config.compilation.mode:
            # Imports Inductor (about 1 s, which loading or compiling needs later anyway)
            # to find the probe's recorded answer: shown, so that the phases add up.
            with phases("compiler import"):
                probe_in_background()  # mp workers probe their own
        with phases("model files"):  # a GGUF file's one-time conversion lands here
            path = resolve_model(config.model, progress=progress)
        if config.device == "cpu" and in_process and config.tensor_parallel_size == 1:
            # mp workers build (or wait) their own; torchrun ranks too, in line: a rank
            # that alone restarted after a failed build would desert the others.
            # A first start's g++ overlaps all up to the first kernel call; not the
            # conversion, which ran 3x slower beside it (kiln.ops.cpu_kernels).
            cpu_kernels.start_loading(default_cache_root())
        with phases("model config"):
            self.model_config = mc = ModelConfig.from_pretrained(path)
        model_class(mc.architecture)  # unknown architectures fail before any loading
        check_tensor_parallel(mc, tp)
        layer_partition(mc.num_layers, pp)  # a bad split fails here, named
        check_sliding_window(mc, config)
        self.quantization = qc = resolve_quantization(config.quantization, path,
                                                      gguf_source(config.model))
        platform = platform_for(config.device)
        if qc.method is not None and qc.method != "none" and \
                qc.method not in platform.supported_quantization:
            raise ValueError(f"quantization={qc.method!r} does not run on "
                             f"{platform.device_type} (it runs: "
                             f"{', '.join(platform.supported_quantization)}); fp8 is a CUDA "
                             "Triton kernel: on a CPU use --quantization int8")
        if qc.method == "gguf" and config.tensor_parallel_size > 1:
            raise ValueError("quantization='gguf' runs with tensor_parallel_size=1 only (its "
                             "blocks are not sharded yet); pass --quantization none to "
                             "shard the dequantized weights, or -tp 1")
        if resolve_backend(config.distributed_executor_backend, tp, pp) == "mp":
            engine_starting(bool(config.compilation.mode))  # a zygote from the second on
        if config.device == "cpu":
            with phases("kernels"):  # loaded; built here where no build runs beside
                cpu_kernels.ensure_planned(default_cache_root(), progress)
        self.dtype = resolve_dtype(config, mc)
        self.max_model_len = resolve_max_model_len(config, mc)
        with phases("tokenizer"):
            self.tokenizer = load_tokenizer(path)
        # Fields a request leaves unset take these (kiln.sampling.defaults).
        self.default_sampling = generation_defaults(config.generation_config, path,
                                                    config.override_generation_config)
        torch.manual_seed(config.seed)
        self.lora_config = config.lora_config()
        self.loras = AdapterRegistry(mc, self.lora_config) if self.lora_config else None
        limits = RunnerLimits(config.max_num_seqs, config.max_num_batched_tokens,
                              self.max_model_len, config.block_size)
        self.speculative = sc = config.speculative_config
        draft_mc = None if sc is None or not sc.uses_draft_kv else \
            check_draft_model(sc, mc, self.tokenizer, progress)
        kvt = config.kv_transfer_config
        fingerprint = None if kvt is None else kv_fingerprint(path, gguf_source(config.model))
        spec = RunnerSpec(mc, self.dtype, config.device, limits, config.seed,
                          config.kv_cache_memory, config.num_kv_blocks,
                          config.attention_backend, config.compilation, progress,
                          quantization=qc, lora=self.lora_config, speculative=sc,
                          draft_model_config=draft_mc,
                          kv_transfer=None if kvt is None else (kvt, fingerprint))
        with phases("workers"):
            self.executor: Executor = make_executor(config.distributed_executor_backend,
                                                    tp, spec, pp)
        phases.split("workers", self.executor.startup_phases)
        # Workers stop with the engine: garbage-collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, self.executor.shutdown)
        try:
            check_kv_capacity(self.executor.num_kv_blocks, self.executor.kv_groups,
                              self.max_model_len, config.max_num_batched_tokens)
        except ValueError:
            self._finalizer()  # a failed start-up leaves no worker behind
            raise
        kv = KVCacheManager(self.executor.kv_groups, self.executor.num_kv_blocks,
                            enable_caching=config.enable_prefix_caching)
        # Block hashes also name blocks in a KV connector's tier (which outlives the
        # engine: adapters count there by their files, not their ids).
        keys = self.loras.keys if self.loras else None
        self._hasher = BlockHasher(config.block_size, keys) \
            if config.enable_prefix_caching or kvt is not None else None
        self.kv_connector = None if kvt is None else connector_for(
            kvt, KVConnectorRole.SCHEDULER, fingerprint, self.executor.kv_spec,
            mc.num_layers, qc)
        # The connector's links and threads stop with the engine.
        self._close_connector = weakref.finalize(
            self, self.kv_connector.close if self.kv_connector else lambda: None)
        policy = SchedulerPolicy(config.scheduling_policy, config.long_prefill_token_threshold,
                                 config.full_sequence_must_fit)
        self.scheduler = Scheduler(kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=self.max_model_len, policy=policy,
                                   max_loras=self.lora_config.max_loras if self.lora_config
                                   else 0,
                                   spec_stats=None if sc is None else
                                   SpecDecodingStats(sc.num_speculative_tokens),
                                   num_lookahead_tokens=sc.num_speculative_tokens
                                   if sc is not None and sc.uses_draft_kv else 0,
                                   kv_connector=self.kv_connector)
        depth = self.scheduler.pipeline_depth = self.executor.max_concurrent_batches
        self.batch_queue = BatchQueue(self.executor, depth) if depth > 1 else None
        self._last_stats_log = time.monotonic()
        self.output_processor = OutputProcessor(self.tokenizer, token_namer(self.tokenizer))
        # Plugin stat loggers live where outputs are processed (rank 0 under torchrun).
        self.stat_loggers = load_stat_loggers(config) if self.executor.is_driver else []
        log_engine_initialized(self.stat_loggers)
        self.load_time_s = time.perf_counter() - start
        logger.info("engine ready in %.1f s: %s, %s, max_model_len=%d, quantization %s%s%s "
                    "(%s)", self.load_time_s, mc.architecture, self.dtype,
                    self.max_model_len, qc.method or "none",
                    f", speculative {sc.describe()}" if sc else "",
                    f", KV connector {kvt.describe()}" if kvt else "", phases.describe())

    @property
    def runner(self) -> Any:
        """The in-process model runner (`uni`, `external_launcher`)."""
        return self.executor.runner

    def shutdown(self) -> None:
        """Stop the executor's workers now (also done at garbage collection and exit)."""
        self._finalizer()
        self._close_connector()

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str | dict[str, Any]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, "
                             f"got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
        return prompt, self.tokenizer.encode(prompt)

    def add_request(self, request_id: str, prompt: str | dict[str, Any],
                    params: SamplingParams | None = None, *, priority: int = 0,
                    cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None,
                    kv_transfer_params: dict[str, Any] | None = None) -> None:
        params = params or SamplingParams(**self.default_sampling)
        check_kv_transfer_params(kv_transfer_params)
        if request_id in self.output_processor.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        self._validate_prompt(ids)
        self._validate_token_ids(params)
        so = params.structured_outputs
        grammar = None if so is None else self.structured_output_manager().submit(so)
        if lora_request is not None:
            self.add_lora(lora_request)
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        taken = [rid for rid in sample_ids(request_id, params.n)
                 if rid in self.scheduler.requests]
        if taken:  # e.g. user id "0_x" next to an n>1 request "x": nothing is added
            raise ValueError(f"request id(s) {taken} are already in use")
        for rid, child in self.output_processor.add(request_id, text, ids, params):
            request = Request(rid, ids, child, eos, priority=priority, cache_salt=cache_salt,
                              lora_request=lora_request, block_hasher=self._hasher,
                              kv_transfer_params=kv_transfer_params)
            if grammar is not None:  # each sample walks the grammar on its own
                request.structured = self.scheduler.structured.new_request(so, grammar)
            self.scheduler.add_request(request)
        if lora_request is not None:
            self.loras.request_counts[lora_request.lora_name] += 1

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but max_model_len is "
                             f"{self.max_model_len} (prompt plus at least one new token "
                             "must fit); shorten the prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {vocab})")

    def _validate_token_ids(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", list(params.logit_bias or {}))):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary "
                                 f"[0, {vocab})")

    def structured_output_manager(self) -> StructuredOutputManager:
        """The grammar manager, made on first use: engines that never see a constraint
        never load xgrammar or build its vocabulary tables."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer, and this model "
                             "has none")
        from kiln.structured_output.manager import StructuredOutputManager
        if self.scheduler.structured is None:
            self.scheduler.structured = StructuredOutputManager(
                self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        return self.scheduler.structured

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Check and register an adapter (once per id; requests naming it check it too).
        Raises LoRAError for a bad adapter, or when the engine runs without LoRA."""
        if not isinstance(lora_request, LoRARequest):
            raise LoRAError(f"lora_request must be a kiln.LoRARequest, got "
                             f"{type(lora_request).__name__}")
        if self.loras is None:
            raise LoRAError(f"request names LoRA adapter {lora_request.lora_name!r} but "
                             "this engine runs without LoRA: start it with enable_lora=True "
                             "(--enable-lora)")
        self.loras.check(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter: workers free its slot and CPU copy. Requests already running
        with it must be finished first (the caller's duty, as in vLLM)."""
        if self.loras is None or self.loras.forget(lora_int_id) is None:
            return False
        self.executor.collective_rpc("remove_lora", lora_int_id)
        return True

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort user requests (every sample of an n>1 request); unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            samples = self.output_processor.sample_ids(rid)
            self.scheduler.finish_requests(samples, RequestStatus.FINISHED_ABORTED)
            self.output_processor.remove(rid)

    def _fail_adapters(self, failed: dict[int, str]) -> None:
        """Adapters a worker could not load (their files changed or vanished after the
        engine checked them): their requests fail alone, and the engine forgets them, so
        the next request naming one checks its files again."""
        for lid, why in failed.items():
            self.loras.forget(lid)
            ids = [rid for rid, r in self.scheduler.requests.items() if r.lora_int_id == lid]
            logger.warning("LoRA adapter %d failed to load in a worker (%s); %d request(s) "
                           "fail", lid, why, len(ids))
            self.scheduler.fail_requests(ids, f"LoRA adapter {lid} could not be loaded: {why}")

    def has_unfinished_requests(self) -> bool:
        """Requests to finish, or pipeline steps still in flight (their requests may
        have been aborted meanwhile: stepping receives them, so no worker waits on an
        answer the engine never reads)."""
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def get_stats(self) -> SchedulerStats:
        """Running/waiting counts, KV usage, prefix-cache queries and hits, preemptions,
        with speculative decoding its acceptance statistics (`spec_decoding`), with a KV
        connector what it loaded and saved (`kv_transfer`)."""
        return self.scheduler.make_stats()

    def flush_kv_saves(self) -> None:
        """Wait until the KV connector's saves in flight are stored (and counted)."""
        if self.kv_connector is not None:
            for counters in self.executor.collective_rpc("flush_kv_saves"):
                self.kv_connector.update_connector_output(counters)

    def _maybe_log_stats(self) -> None:
        interval = self.config.log_stats_interval_s
        if not interval or time.monotonic() - self._last_stats_log < interval:
            return
        self._last_stats_log = time.monotonic()
        s = self.get_stats()
        logger.info("running %d, waiting %d, KV usage %.1f%%, prefix-cache hit rate %.1f%%, "
                    "preemptions %d%s", s.num_running, s.num_waiting, 100 * s.kv_cache_usage,
                    100 * s.prefix_cache_hit_rate, s.num_preemptions,
                    "" if s.spec_decoding is None else
                    f", draft acceptance {100 * s.spec_decoding.acceptance_rate:.1f}% (mean "
                    f"accepted length {s.spec_decoding.mean_accepted_length:.2f})")

    # ---- stepping ------------------------------------------------------------------------
    def _schedule(self) -> tuple[SchedulerOutput, int]:
        so = self.scheduler.schedule()
        prompt_tokens = prompt_tokens_scheduled(self.scheduler.requests, so.num_scheduled_tokens) \
            if self.stat_loggers else 0
        return so, prompt_tokens

    def _idle(self) -> None:
        # Nothing to run or tell the workers: every waiting request's grammar is still
        # compiling, or its KV still arriving. Wait (briefly) rather than spin.
        self.scheduler.idle_wait(timeout_s=0.05)

    def _step_now(self) -> tuple[SchedulerOutput, ModelRunnerOutput, int]:
        so, prompt_tokens = self._schedule()
        if not tells_workers(so):
            self._idle()
            return so, ModelRunnerOutput([], []), prompt_tokens
        return so, self.executor.execute(so), prompt_tokens

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return at most one output per user request that got new
        tokens, shaped by its `output_kind` (cumulative, delta, or final only). Under
        pipeline parallelism a step may only send work and return nothing yet."""
        done = self._step_now() if self.batch_queue is None else \
            self.batch_queue.step(self._schedule, self._idle)
        if done is None:
            return []
        so, runner_out, prompt_tokens = done
        if runner_out.failed_loras:
            self._fail_adapters(runner_out.failed_loras)
        self._maybe_log_stats()
        core_outputs = self.scheduler.update_from_output(so, runner_out)
        core_outputs += self.scheduler.take_errors()  # failed alone while scheduling
        if self.stat_loggers:
            record_all(self.stat_loggers, self.get_stats(),
                       iteration_stats(prompt_tokens, core_outputs))
        outputs, stopped = self.output_processor.process(core_outputs, runner_out)
        if stopped:  # finished by a stop string: free their blocks now
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs
