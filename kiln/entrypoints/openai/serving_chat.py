"""POST /v1/chat/completions: the model's chat template turns the messages into one prompt;
`n` choices come back as assistant messages (or `chat.completion.chunk` deltas), with
tool calls taken out of them as the request's `tools` and `tool_choice` say."""
from __future__ import annotations

from typing import Any, AsyncIterator

import jinja2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.engine.async_engine import EngineDeadError, RequestStream
from kiln.entrypoints.openai import serving as sv
from kiln.entrypoints.openai.chat_output import ChoiceOutput
from kiln.entrypoints.openai.errors import bad_request
from kiln.entrypoints.openai.logprobs import chat_logprobs
from kiln.entrypoints.openai.params import to_sampling_params
from kiln.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from kiln.entrypoints.openai.tools import (ToolPlan, plan_tools, render_messages,
                                           template_knows_tools)


def _message(m: ChatMessage) -> dict[str, Any]:
    content = m.content
    if isinstance(content, list):  # text parts: joined as vLLM does
        content = "\n".join(part.text for part in content)
    role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for it
    return {**(m.model_extra or {}), "role": role, "content": content or ""}


def apply_chat_template(tokenizer: Any, req: ChatCompletionRequest,
                        plan: ToolPlan) -> dict[str, Any]:
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not template:
        raise bad_request("this model has no chat template: use /v1/completions", "messages")
    native = template_knows_tools(template)
    messages = render_messages([_message(m) for m in req.messages], plan, native)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=plan.tools if native and plan.tools else None,
            tokenize=False, add_generation_prompt=req.add_generation_prompt)
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise bad_request(f"the chat template rejected the messages: {exc}",
                          "messages") from None
    # The template already holds the special tokens: no second BOS (as LLM.chat does).
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text,
                                                                 add_special_tokens=False)}


def _plan(req: ChatCompletionRequest) -> ToolPlan:
    plan = plan_tools(req)
    own = req.structured_outputs is not None or (
        req.response_format is not None and req.response_format.type != "text")
    if own and plan.active and plan.choice != "auto":
        raise bad_request(f"tool_choice={plan.choice!r} constrains the output itself: drop "
                          "response_format / structured_outputs, or use tool_choice "
                          "'auto'", "tool_choice")
    return plan


async def create_chat_completion(ctx: sv.ServingContext, req: ChatCompletionRequest,
                                 request: Request) -> Response:
    plan = _plan(req)
    prompt = apply_chat_template(ctx.tokenizer, req, plan)
    params = to_sampling_params(req, len(prompt["prompt_token_ids"]), ctx.max_model_len,
                                plan.constraint() if plan.active else None,
                                ctx.default_sampling)
    rid = sv.new_id("chatcmpl")
    streams = await sv.start_requests(ctx, rid, [prompt], [params], "messages",
                                      req.kv_transfer_params)
    if req.stream:
        return sv.AbortingStreamingResponse(_stream(ctx, req, rid, streams, prompt, plan),
                                            streams)
    return await sv.until_disconnected(_full(ctx, req, rid, streams, prompt, plan), request,
                                       streams)


def _logprobs(ctx: sv.ServingContext, req: ChatCompletionRequest, token_ids: list[int],
              steps: list[dict[int, Any]] | None) -> dict[str, Any] | None:
    if not req.logprobs:
        return None
    return chat_logprobs(token_ids, steps or [], req.top_logprobs or 0, ctx.tokenizer)


async def _full(ctx: sv.ServingContext, req: ChatCompletionRequest, rid: str,
                streams: list[RequestStream], prompt: dict[str, Any],
                plan: ToolPlan) -> Response:
    choices: dict[int, sv.Choice] = {}
    try:
        async for _, out in sv.merge(streams):
            for c in out.outputs:
                choices.setdefault(c.index, sv.Choice()).add(c)
    except EngineDeadError as exc:
        return sv.engine_error(exc).response()
    body = []
    for i, ch in sorted(choices.items()):
        message, finish = ChoiceOutput(plan, ctx.tool_parser).message("".join(ch.text),
                                                                      ch.finish_reason)
        body.append({"index": i, "message": message,
                     "logprobs": _logprobs(ctx, req, ch.token_ids, ch.logprobs),
                     "finish_reason": finish, "stop_reason": ch.stop_reason})
    completion_tokens = sum(len(ch.token_ids) for ch in choices.values())
    return JSONResponse({"id": rid, "object": "chat.completion", "created": sv.now(),
                         "model": ctx.model_name, "choices": body,
                         "usage": sv.usage(len(prompt["prompt_token_ids"]),
                                           completion_tokens)})


async def _stream(ctx: sv.ServingContext, req: ChatCompletionRequest, rid: str,
                  streams: list[RequestStream], prompt: dict[str, Any], plan: ToolPlan
                  ) -> AsyncIterator[str]:
    header = {"id": rid, "object": "chat.completion.chunk", "created": sv.now(),
              "model": ctx.model_name}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None,
              finish_reason: str | None = None, stop_reason: Any = None) -> str:
        return sv.sse({**header, "choices": [{
            "index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}], **extra})

    # The role comes first, once per choice, as OpenAI sends it.
    for index in range(req.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    completion_tokens = 0
    shapers = [ChoiceOutput(plan, ctx.tool_parser) for _ in range(req.n)]
    try:
        async for _, out in sv.merge(streams):
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                delta, finish = shapers[c.index].delta(c.text, c.finish_reason)
                logprobs = _logprobs(ctx, req, c.token_ids, c.logprobs)
                if delta or finish is not None or logprobs is not None:
                    yield chunk(c.index, delta, logprobs, finish, c.stop_reason)
    except EngineDeadError as exc:
        yield sv.sse(sv.engine_error(exc).body())
    if include_usage:
        yield sv.sse({**header, "choices": [],
                      "usage": sv.usage(len(prompt["prompt_token_ids"]), completion_tokens)})
    yield sv.sse("[DONE]")
