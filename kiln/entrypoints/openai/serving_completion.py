"""POST /v1/completions: one engine request per prompt, `n` choices each; choice index is
`prompt_index * n + completion index`, as in OpenAI's batched completions."""
from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.engine.async_engine import EngineDeadError, RequestStream
from kiln.entrypoints.openai import serving as sv
from kiln.entrypoints.openai.errors import bad_request
from kiln.entrypoints.openai.logprobs import completion_logprobs
from kiln.entrypoints.openai.params import to_sampling_params
from kiln.entrypoints.openai.protocol import CompletionRequest


def _prompts(ctx: sv.ServingContext, req: CompletionRequest) -> list[dict[str, Any]]:
    """Every prompt as {"prompt": text | None, "prompt_token_ids": [...]}."""
    raw = req.prompt
    batch = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else raw
    if not batch:
        raise bad_request("prompt must not be empty", "prompt")
    prompts = []
    for p in batch:
        if isinstance(p, str):
            if ctx.tokenizer is None:
                raise bad_request("this model has no tokenizer: send token ids", "prompt")
            prompts.append({"prompt": p, "prompt_token_ids": ctx.tokenizer.encode(p)})
        else:
            prompts.append({"prompt": None, "prompt_token_ids": list(p)})
        if not prompts[-1]["prompt_token_ids"]:
            raise bad_request("the prompt is empty: give at least one token", "prompt")
    return prompts


def _check_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (kiln returns every sequence it samples)",
                          "best_of")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo together with logprobs is not supported", "echo")


async def create_completion(ctx: sv.ServingContext, req: CompletionRequest,
                            request: Request) -> Response:
    _check_unsupported(req)
    prompts = _prompts(ctx, req)
    params = [to_sampling_params(req, len(p["prompt_token_ids"]), ctx.max_model_len,
                                 defaults=ctx.default_sampling) for p in prompts]
    rid = sv.new_id("cmpl")
    streams = await sv.start_requests(ctx, rid, prompts, params, "prompt",
                                      req.kv_transfer_params)
    echo = [_echo_text(ctx, p) if req.echo else "" for p in prompts]
    if req.stream:
        return sv.AbortingStreamingResponse(_stream(ctx, req, rid, streams, prompts, echo),
                                            streams)
    return await sv.until_disconnected(_full(ctx, req, rid, streams, prompts, echo),
                                       request, streams)


def _echo_text(ctx: sv.ServingContext, prompt: dict[str, Any]) -> str:
    if prompt["prompt"] is not None:
        return prompt["prompt"]
    return ctx.tokenizer.decode(prompt["prompt_token_ids"]) if ctx.tokenizer else ""


def _header(ctx: sv.ServingContext, rid: str, created: int) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created,
            "model": ctx.model_name}


async def _full(ctx: sv.ServingContext, req: CompletionRequest, rid: str,
                streams: list[RequestStream], prompts: list[dict[str, Any]],
                echo: list[str]) -> Response:
    choices: dict[int, sv.Choice] = {}
    try:
        async for i, out in sv.merge(streams):
            for c in out.outputs:
                choices.setdefault(i * req.n + c.index, sv.Choice()).add(c)
    except EngineDeadError as exc:
        return sv.engine_error(exc).response()
    body = []
    for index in sorted(choices):
        ch = choices[index]
        text = echo[index // req.n] + "".join(ch.text)
        logprobs = None
        if req.logprobs is not None:
            logprobs, _ = completion_logprobs(ch.token_ids, ch.logprobs, ctx.tokenizer, 0)
        body.append({"index": index, "text": text, "logprobs": logprobs,
                     "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason})
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    completion_tokens = sum(len(ch.token_ids) for ch in choices.values())
    return JSONResponse({**_header(ctx, rid, sv.now()), "choices": body,
                         "usage": sv.usage(prompt_tokens, completion_tokens)})


async def _stream(ctx: sv.ServingContext, req: CompletionRequest, rid: str,
                  streams: list[RequestStream], prompts: list[dict[str, Any]],
                  echo: list[str]) -> AsyncIterator[str]:
    header = _header(ctx, rid, sv.now())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}
    started: set[int] = set()
    offsets: dict[int, int] = {}
    completion_tokens = 0
    try:
        async for i, out in sv.merge(streams):
            for c in out.outputs:
                index = i * req.n + c.index
                text = c.text
                if index not in started:
                    started.add(index)
                    text = echo[i] + text
                logprobs = None
                if req.logprobs is not None:
                    logprobs, offsets[index] = completion_logprobs(
                        c.token_ids, c.logprobs or [], ctx.tokenizer, offsets.get(index, 0))
                completion_tokens += len(c.token_ids)
                yield sv.sse({**header, "choices": [{
                    "index": index, "text": text, "logprobs": logprobs,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}], **extra})
    except EngineDeadError as exc:
        yield sv.sse(sv.engine_error(exc).body())
    if include_usage:
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        yield sv.sse({**header, "choices": [],
                      "usage": sv.usage(prompt_tokens, completion_tokens)})
    yield sv.sse("[DONE]")
