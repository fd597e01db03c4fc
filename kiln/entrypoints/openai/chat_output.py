"""One chat choice's text -> the assistant message (or its streamed deltas), with tool
calls taken out according to the request's `ToolPlan`."""
from __future__ import annotations

from typing import Any

from kiln.entrypoints.openai.tool_parsers import (ToolParser, calls_from_required,
                                                  make_tool_parser, tool_call)
from kiln.entrypoints.openai.tools import ToolPlan


class ChoiceOutput:
    def __init__(self, plan: ToolPlan, parser_name: str) -> None:
        self.plan = plan
        self.parser: ToolParser | None = make_tool_parser(parser_name) \
            if plan.active and plan.choice == "auto" else None
        self._calls = 0  # calls streamed so far (their `index`)
        self._text: list[str] = []  # required: the JSON array, parsed at the end

    def message(self, text: str, finish_reason: str | None
                ) -> tuple[dict[str, Any], str | None]:
        """The whole message, and the finish reason ("tool_calls" when the model ended
        by calling tools)."""
        content, calls = self._split(text)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        return msg, self._finish(bool(calls), finish_reason)

    def _split(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        if not self.plan.active:
            return text, []
        if self.plan.choice == "named":
            return None, [tool_call(self.plan.function, text)]
        if self.plan.choice == "required":
            return None, calls_from_required(text)
        found = self.parser.extract(text)
        calls = found.calls if self.plan.parallel else found.calls[:1]
        return found.content, calls

    def _finish(self, called: bool, finish_reason: str | None) -> str | None:
        if called and finish_reason == "stop" and self.plan.choice != "named":
            return "tool_calls"  # named calls end with "stop", as OpenAI's do
        return finish_reason

    def delta(self, text: str, finish_reason: str | None
              ) -> tuple[dict[str, Any], str | None]:
        """The streamed delta for new text; at the end, what was held back."""
        if not self.plan.active:
            return ({"content": text} if text or finish_reason is None else {}), \
                finish_reason
        if self.plan.choice == "named":
            return self._named_delta(text), finish_reason
        content, calls = "", []
        if self.plan.choice == "required":
            self._text.append(text)
            if finish_reason is not None:
                calls = calls_from_required("".join(self._text))
        else:
            content, calls = self.parser.feed(text)
            if finish_reason is not None:
                more, late = self.parser.flush()
                content, calls = content + more, calls + late
            if not self.plan.parallel:
                calls = calls[: max(0, 1 - self._calls)]
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": self._calls + i, **c}
                                   for i, c in enumerate(calls)]
            self._calls += len(calls)
        return delta, self._finish(self._calls > 0, finish_reason)

    def _named_delta(self, text: str) -> dict[str, Any]:
        """The arguments stream as they come; the first delta carries id and name."""
        if not text:
            return {}
        entry: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if self._calls == 0:
            call = tool_call(self.plan.function, "")
            entry = {"index": 0, "id": call["id"], "type": "function",
                     "function": {"name": self.plan.function, "arguments": text}}
            self._calls = 1
        return {"tool_calls": [entry]}
