"""The soak's request kinds (`kiln bench soak`): one function each, sent with the real
`openai` client (hostile ones with plain HTTP), each returning an `Outcome`."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

KINDS = ("chat", "stream", "n2_logprobs", "json_schema", "tools", "adapter", "stop",
         "dropped_stream", "hostile")
REFERENCE = [{"role": "user", "content": "Name three colours of fired clay."}]
TOPICS = ("kilns", "rivers", "bread", "trains", "the moon", "glazes", "bees", "maps")
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}


@dataclass(frozen=True, slots=True)
class Target:
    """The server's names: its model, the adapter (None without LoRA), its context."""

    model: str
    adapter: str | None
    max_model_len: int


@dataclass(slots=True)
class Outcome:
    kind: str
    latency_s: float
    ok: bool = False
    refused: bool = False  # a hostile request refused with a 4xx, as meant
    invalid: bool = False  # a constrained answer that does not hold its constraint
    truncated: bool = False  # a constrained answer cut by max_tokens (not invalid)
    status: int | None = None
    error: str | None = None

    @property
    def unexpected(self) -> bool:
        return not (self.ok or self.refused)


def _messages(turn: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me one fact about {TOPICS[turn % 8]}."}]


async def _chat(api: Any, model: str, turn: int, **kw: Any) -> Any:
    return await api.chat.completions.create(model=model, messages=_messages(turn),
                                             max_tokens=kw.pop("max_tokens", 32),
                                             temperature=0.7, seed=turn, **kw)


async def _plain(o: Outcome, api: Any, http: Any, t: Target, turn: int) -> None:
    r = await _chat(api, t.adapter if o.kind == "adapter" else t.model, turn)
    o.ok = isinstance(r.choices[0].message.content, str)


async def _stream(o: Outcome, api: Any, http: Any, t: Target, turn: int) -> None:
    stream = await _chat(api, t.model, turn, stream=True)
    finish, chunks = None, 0
    async for chunk in stream:
        chunks += 1
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if o.kind == "dropped_stream" and chunks == 2:
            await stream.close()  # the client goes away mid-answer
            o.ok = True
            return
    o.ok = finish is not None and chunks > 0


async def _n2(o: Outcome, api: Any, http: Any, t: Target, turn: int) -> None:
    r = await _chat(api, t.model, turn, n=2, logprobs=True, top_logprobs=2)
    o.ok = len(r.choices) == 2 and all(c.logprobs is not None and c.logprobs.content
                                       for c in r.choices)


async def _schema(o: Outcome, api: Any, http: Any, t: Target, turn: int) -> None:
    r = await _chat(api, t.model, turn, max_tokens=64, response_format={
        "type": "json_schema", "json_schema": {"name": "fact", "schema": SCHEMA}})
    choice = r.choices[0]
    if choice.finish_reason == "length":
        o.ok = o.truncated = True
        return
    try:
        value = json.loads(choice.message.content)
        o.invalid = not (set(value) == {"name", "count"} and isinstance(value["name"], str)
                         and isinstance(value["count"], int) and 0 <= value["count"] <= 99)
    except (TypeError, ValueError):
        o.invalid = True
    o.ok = not o.invalid


async def _tools(o: Outcome, api: Any, http: Any, t: Target, turn: int) -> None:
    r = await _chat(api, t.model, turn, max_tokens=48, tools=[TOOL], tool_choice="required")
    choice = r.choices[0]
    if choice.finish_reason == "length":
        o.ok = o.truncated = True
        return
    calls = choice.message.tool_calls or []
    try:
        o.invalid = not calls or not all(
            c.function.name == "get_weather"
            and isinstance(json.loads(c.function.arguments).get("city"), str)
            for c in calls)
    except (TypeError, ValueError, AttributeError):
        o.invalid = True
    o.ok = not o.invalid


async def _stop(o: Outcome, api: Any, http: Any, t: Target, turn: int) -> None:
    r = await _chat(api, t.model, turn, stop=[".", "\n"])
    text = r.choices[0].message.content or ""
    o.ok = "." not in text and "\n" not in text


# Each must be refused with a 4xx and leave the server serving the others.
HOSTILE: tuple[dict[str, Any] | str, ...] = (
    {"temperature": -1.0}, {"max_tokens": -5}, {"model": "no-such-model"}, {"n": 0},
    "too long",  # a prompt over the server's max_model_len
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
    "{not json")


async def _hostile(o: Outcome, api: Any, http: Any, t: Target, turn: int) -> None:
    bad = HOSTILE[turn % len(HOSTILE)]
    if bad == "too long":  # numbers: a token per digit at least, in any tokenizer here
        words = " ".join(str(i % 1000) for i in range(t.max_model_len))
        bad = {"messages": [{"role": "user", "content": words}]}
    if isinstance(bad, str):
        r = await http.post("/v1/chat/completions", content=bad,
                            headers={"content-type": "application/json"})
    else:
        body = {"model": t.model, "messages": _messages(turn), "max_tokens": 8, **bad}
        r = await http.post("/v1/chat/completions", json=body)
    o.status = r.status_code
    o.refused = 400 <= r.status_code < 500
    if not o.refused:
        o.error = f"hostile {str(bad)[:60]!r} answered {r.status_code}"


SENDERS: dict[str, Callable[..., Awaitable[None]]] = {
    "chat": _plain, "adapter": _plain, "stream": _stream, "dropped_stream": _stream,
    "n2_logprobs": _n2, "json_schema": _schema, "tools": _tools, "stop": _stop,
    "hostile": _hostile}


async def send(kind: str, api: Any, http: Any, t: Target, turn: int) -> Outcome:
    import openai

    o = Outcome(kind, 0.0)
    start = time.monotonic()
    try:
        await SENDERS[kind](o, api, http, t, turn)
        if not (o.ok or o.refused) and o.error is None:
            o.error = f"{kind}: an answer of the wrong shape"
    except openai.APIStatusError as exc:
        o.status, o.error = exc.status_code, f"{kind}: {exc.status_code} {str(exc)[:200]}"
    except Exception as exc:  # a client-side failure is the soak's finding too
        o.error = f"{kind}: {type(exc).__name__}: {str(exc)[:200]}"
    o.latency_s = time.monotonic() - start
    return o
