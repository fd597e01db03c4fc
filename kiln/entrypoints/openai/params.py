"""The one place an OpenAI request becomes `SamplingParams`.

Rules: a field the client did not send takes the engine's default (the model's
generation config, kiln.sampling.defaults), else SamplingParams' default; `max_tokens`
defaults to the generation config's max_new_tokens, else to what fits in max_model_len
after the prompt (capped there in either case), and an explicit one that does not fit is a
400 (as OpenAI and vLLM do) rather than a silent truncation. A field this engine's
SamplingParams does not have yet is a 400 unless it is set to its neutral value,
so a client never gets a silently different sampler than it asked for.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kiln.entrypoints.openai.errors import APIError, bad_request, from_value_error
from kiln.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kiln.sampling.defaults import with_defaults
from kiln.sampling.params import SamplingParams
from kiln.structured_output.params import StructuredOutputsParams

# Values that leave sampling unchanged: sending them needs no support from the engine.
_NEUTRAL: dict[str, Any] = {"n": 1, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                            "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                            "min_tokens": 0, "stop": [], "stop_token_ids": [],
                            "include_stop_str_in_output": False, "logit_bias": {},
                            "skip_special_tokens": True, "ignore_eos": False}
_PASSTHROUGH = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
                "min_tokens", "ignore_eos", "include_stop_str_in_output",
                "skip_special_tokens")
_MAX_N = 128  # a cap on fan-out per request, so one request cannot take every sequence slot


def sampling_fields() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(SamplingParams))


def supports(field_name: str) -> bool:
    """Whether this engine's SamplingParams has the field (some arrive with later work)."""
    return field_name in sampling_fields()


def to_sampling_params(req: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                       max_model_len: int,
                       structured: StructuredOutputsParams | None = None,
                       defaults: dict[str, Any] | None = None) -> SamplingParams:
    """`structured`: a constraint the endpoint made itself (tool calls); else the
    request's own `response_format` / `structured_outputs`, if any. `defaults`: the
    engine's `default_sampling`, for the fields the request did not send."""
    defaults = dict(defaults or {})
    default_max = defaults.pop("max_tokens", None)
    chat = isinstance(req, ChatCompletionRequest)
    max_name = "max_completion_tokens" if chat and req.max_completion_tokens is not None \
        else "max_tokens"
    kwargs: dict[str, Any] = {name: getattr(req, name) for name in _PASSTHROUGH
                              if getattr(req, name) is not None}
    if isinstance(kwargs.get("stop"), str):
        kwargs["stop"] = [kwargs["stop"]]
    if req.n > _MAX_N:
        raise bad_request(f"n={req.n} is above the server's limit of {_MAX_N}", "n")
    if req.logit_bias is not None:
        kwargs["logit_bias"] = _logit_bias(req.logit_bias)
    logprobs = _logprobs(req)
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    kwargs["structured_outputs"] = structured or structured_outputs(req)
    kwargs["max_tokens"] = _max_tokens(getattr(req, max_name), max_name, prompt_len,
                                       max_model_len, default_max)
    kwargs = with_defaults(defaults, kwargs,
                           constrained=kwargs["structured_outputs"] is not None)
    for name in list(kwargs):
        if not supports(name):
            if kwargs[name] != _NEUTRAL.get(name, object()):
                raise bad_request(f"{name} is not supported by this kiln engine yet", name)
            del kwargs[name]
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise from_value_error(exc, sampling_fields(),
                               {"max_tokens": max_name,
                                "logprobs": "top_logprobs" if chat else "logprobs"}) from None


def _max_tokens(requested: int | None, name: str, prompt_len: int, max_model_len: int,
                default: int | None = None) -> int:
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens but max_model_len is "
                       f"{max_model_len} (prompt plus at least one new token must fit); "
                       "shorten the prompt", None, "context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested < 1:
        raise bad_request(f"{name}={requested} must be a positive integer", name)
    if requested > room:
        raise APIError(400, f"{name}={requested} plus the prompt's {prompt_len} tokens is "
                       f"more than max_model_len={max_model_len}; ask for at most {room} "
                       "tokens or shorten the prompt", name, "context_length_exceeded")
    return requested


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                              "logit_bias") from None
    return out


def structured_outputs(req: CompletionRequest | ChatCompletionRequest
                       ) -> StructuredOutputsParams | None:
    """The request's constraint from `response_format` or vLLM's `structured_outputs`
    (not both), parsed now: a bad schema, regex or grammar is a 400 naming its field."""
    fmt = req.response_format
    if fmt is not None and fmt.type != "text" and req.structured_outputs is not None:
        raise bad_request("give response_format or structured_outputs, not both",
                          "structured_outputs")
    if req.structured_outputs is not None:
        return _checked(lambda: StructuredOutputsParams(**req.structured_outputs),
                        "structured_outputs")
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _checked(lambda: StructuredOutputsParams(json_object=True), "response_format")
    schema = (fmt.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format json_schema needs json_schema.schema, a JSON "
                          "schema object", "response_format.json_schema.schema")
    return _checked(lambda: StructuredOutputsParams(json=schema),
                    "response_format.json_schema.schema")


def _checked(make: Any, param: str) -> StructuredOutputsParams:
    from kiln.structured_output.backend import grammar_for
    try:
        params = make()
        grammar_for(params)
    except (ValueError, TypeError) as exc:  # TypeError: an unknown key in the dict
        message = str(exc).replace("StructuredOutputsParams.__init__()", "structured_outputs")
        if not message.startswith(param):
            message = f"{param}: {message}"
        raise bad_request(message, param) from None
    return params
