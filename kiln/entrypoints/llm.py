"""`LLM`: the offline Python API, shaped like vLLM's."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any, Callable, Iterator, Sequence

from tqdm import tqdm

from kiln.config.engine import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.outputs import CompletionOutput, RequestOutput
from kiln.entrypoints.io_processor import (as_prompts, check_io_processor_name,
                                           get_io_processor)
from kiln.lora.request import LoRARequest
from kiln.sampling.params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | dict[str, Any]
Message = dict[str, str]


def _with_budget(model: str | None, dtype: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """kwargs with max_num_batched_tokens filled when unset (absent or None): the budget
    `kiln bench budget` measured for these settings on this device, else EngineConfig's
    default. An explicit value always wins."""
    if kwargs.get("max_num_batched_tokens") is not None:
        return kwargs
    from kiln.config.engine import parse_dtype
    from kiln.ops.tuning import tuned_budget

    kwargs = {k: v for k, v in kwargs.items() if k != "max_num_batched_tokens"}
    tuned = tuned_budget(model, parse_dtype(dtype), kwargs.get("quantization"),
                         kwargs.get("device", "cpu"))
    if tuned is not None:
        logger.info("max_num_batched_tokens=%d: measured for this model and host by `kiln "
                    "bench budget` (the tuning table); pass it to override", tuned)
        kwargs["max_num_batched_tokens"] = tuned
    return kwargs


class LLM:
    """Generate text offline. `model=None` is the embedded default (SmolLM2-135M-Instruct).

    >>> llm = LLM()
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto",
                 optimization_level: int = 2, progress: bool = True, **kwargs: Any) -> None:
        kwargs = _with_budget(model, dtype, kwargs)
        config = EngineConfig(model=model, dtype=dtype, optimization_level=optimization_level,
                              **kwargs)
        check_io_processor_name(config.io_processor_plugin)
        self.engine = LLMEngine(config, progress=progress)
        self._ids = itertools.count()
        try:
            self.io_processor = get_io_processor(config, self.engine.model_config.path)
        except ValueError:
            self.engine.shutdown()  # a failed start-up leaves no worker behind
            raise

    def shutdown(self) -> None:
        """Stop the engine's worker processes now (garbage collection does it too)."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no sampling_params: SamplingParams'
        defaults with the model's generation config laid over them (vLLM's method; see
        `generation_config`). An explicit SamplingParams is used as given."""
        return SamplingParams(**self.engine.default_sampling)

    def process(self, data: Any, use_tqdm: bool = False) -> Any:
        """Run the IO processor plugin (`io_processor_plugin`) on `data`: parse, pre-process
        into prompts, generate, post-process; returns what the plugin returns."""
        proc = self.io_processor
        if proc is None:
            raise ValueError("process() needs an IO processor: start the LLM with "
                             "io_processor_plugin=NAME (an installed kiln.io_processor_plugins "
                             "entry)")
        parsed = proc.parse_request(data)
        request_id = str(next(self._ids))
        prompts = as_prompts(proc.pre_process(parsed, request_id))
        outputs = self.generate(prompts, proc.sampling_params(parsed), use_tqdm=use_tqdm)
        return proc.post_process(outputs, request_id)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. A prompt that
        is rejected (too long, empty, an unusable adapter) gets an output with `error` set
        and finish_reason 'error'; the others run normally. `lora_request`: one adapter
        for every prompt, or one entry (None: the base model) per prompt."""
        order, results = self._add(prompts, sampling_params, priority,
                                   RequestOutputKind.FINAL_ONLY, lora_request)
        driver = self.engine.executor.is_driver
        self._run(results, use_tqdm and driver, total=len(order))
        # Under torchrun every rank runs the engine; only rank 0 hands outputs back.
        return [results[rid] for rid in order] if driver else []

    def generate_stream(self, prompts: Prompt | Sequence[Prompt],
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                        ) -> Iterator[RequestOutput]:
        """Yield delta outputs as the engine steps: each carries only the text, tokens and
        logprobs new since that request's previous output (concatenated, they are the
        final result). Rejected prompts are yielded first, with `error` set."""
        order, results = self._add(prompts, sampling_params, None, RequestOutputKind.DELTA,
                                   lora_request)
        driver = self.engine.executor.is_driver
        if driver:
            yield from results.values()
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            if driver:
                yield from outputs

    def _add(self, prompts: Prompt | Sequence[Prompt],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             priority: Sequence[int] | None, kind: RequestOutputKind,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> tuple[list[str], dict[str, RequestOutput]]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = _broadcast(sampling_params, len(prompts), self.get_default_sampling_params)
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        loras = _broadcast_lora(lora_request, len(prompts))
        order: list[str] = []
        results: dict[str, RequestOutput] = {}
        for prompt, p, prio, lora in zip(prompts, params, priorities, loras):
            rid = str(next(self._ids))
            order.append(rid)
            try:
                self.engine.add_request(rid, prompt, dataclasses.replace(p, output_kind=kind),
                                        priority=prio, lora_request=lora)
            except ValueError as exc:
                logger.warning("request %s rejected: %s", rid, exc)
                results[rid] = _error_output(rid, prompt, str(exc))
        return order, results

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them.
        `tools` (OpenAI function tools) reach the template, or the Hermes tool prompt
        when the template knows no tools (as `kiln serve` does); the replies are text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, tools)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, conversation: list[Message],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        from kiln.entrypoints.openai.tools import (ToolPlan, render_messages, template_knows_tools)
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with raw text")
        native = template_knows_tools(tok.chat_template)
        conversation = render_messages(list(conversation), ToolPlan(tools or [], "auto"),
                                       native)
        text = tok.apply_chat_template(conversation, tools=tools if native else None,
                                       tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
        # The template already carries the special tokens: don't add a second BOS.
        return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}

    def _run(self, results: dict[str, RequestOutput], use_tqdm: bool, total: int) -> None:
        bar = tqdm(total=total, initial=len(results), desc="generating", unit="req",
                   disable=not use_tqdm)
        generated, start = 0, time.perf_counter()
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():  # final outputs only
                generated += sum(len(c.token_ids) for c in out.outputs)
                results[out.request_id] = out
                bar.update(1)
            bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} tok/s",
                                refresh=False)
        bar.close()


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None, n: int,
               default: Callable[[], SamplingParams]) -> list[SamplingParams]:
    if params is None:
        return [default()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts: give one, "
                         "or one per prompt")
    return list(params)


def _broadcast_lora(lora: LoRARequest | Sequence[LoRARequest | None] | None,
                    n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    if len(lora) != n:
        raise ValueError(f"got {len(lora)} lora_requests for {n} prompts: give one, or one "
                         "(or None) per prompt")
    return list(lora)


def _error_output(rid: str, prompt: Prompt, message: str) -> RequestOutput:
    # Any malformed prompt lands here (a bare list of ids too): it must fail alone.
    text = prompt if isinstance(prompt, str) else \
        prompt.get("prompt") if isinstance(prompt, dict) else None
    ids = list(prompt.get("prompt_token_ids", [])) if isinstance(prompt, dict) else []
    return RequestOutput(rid, text, ids, [CompletionOutput(0, "", [], finish_reason="error")],
                         finished=True, error=message)
