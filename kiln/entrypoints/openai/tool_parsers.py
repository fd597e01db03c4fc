"""Tool-call parsers: the model's tool-call format -> OpenAI `tool_calls`.

A registry by name (`--tool-call-parser`); each parser extracts calls from a finished
text and, while streaming, splits new text into content and complete calls. Hermes
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) is built in: Qwen2/2.5,
Hermes and the prompt kiln writes for templates without tool support use it.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI tool call; arguments become a JSON string."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


@dataclass(slots=True)
class Extracted:
    content: str | None
    calls: list[dict[str, Any]] = field(default_factory=list)


class ToolParser:
    """Parses one choice's text. `feed` (streaming) returns (content delta, new calls);
    `flush` gives what is left at the end; `extract` parses a whole text at once."""

    def extract(self, text: str) -> Extracted:
        raise NotImplementedError

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        raise NotImplementedError

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def __init__(self) -> None:
        self._buffer = ""

    @staticmethod
    def _call(body: str) -> dict[str, Any] | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        return tool_call(obj["name"], obj.get("arguments", obj.get("parameters", {})))

    def extract(self, text: str) -> Extracted:
        if self.START not in text:
            return Extracted(text)
        calls, kept = [], []
        last = 0
        for m in self._BLOCK.finditer(text):
            call = self._call(m.group(1))
            if call is None:
                continue  # not a call after all: it stays content
            kept.append(text[last:m.start()])
            last = m.end()
            calls.append(call)
        kept.append(text[last:])
        content = "".join(kept).strip()
        return Extracted(content or None, calls)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """Content outside blocks streams at once, except a tail that may begin
        `<tool_call>`; a block is emitted as one call when it closes."""
        self._buffer += delta
        content, calls = [], []
        while True:
            start = self._buffer.find(self.START)
            if start < 0:
                keep = _partial_suffix(self._buffer, self.START)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            end = self._buffer.find(self.END, start)
            if end < 0:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
                break
            block = self._buffer[start + len(self.START): end]
            call = self._call(block.strip())
            content.append(self._buffer[:start])
            if call is None:
                content.append(self._buffer[start: end + len(self.END)])
            else:
                calls.append(call)
            self._buffer = self._buffer[end + len(self.END):]
        return "".join(content), calls

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        rest, self._buffer = self._buffer, ""
        found = self.extract(rest)
        return found.content or "", found.calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


_PARSERS: dict[str, Callable[[], ToolParser]] = {"hermes": HermesToolParser}


def register_tool_parser(name: str, factory: Callable[[], ToolParser]) -> None:
    _PARSERS[name] = factory


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def make_tool_parser(name: str) -> ToolParser:
    if name not in _PARSERS:
        raise ValueError(f"tool_call_parser={name!r} is unknown; choose one of "
                         f"{tool_parser_names()}")
    return _PARSERS[name]()


def calls_from_required(text: str) -> list[dict[str, Any]]:
    """`tool_choice="required"`: the constrained output, a JSON array of
    {"name", "parameters"}; [] if it was cut short (finish_reason "length")."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    return [tool_call(i["name"], i.get("parameters", {})) for i in items
            if isinstance(i, dict) and isinstance(i.get("name"), str)]
