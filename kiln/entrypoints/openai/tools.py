"""Tools in chat: the request's `tools` and `tool_choice`, how they reach the prompt, and
the constraint that enforces `required` and named choices.

- `auto`: the model decides; a tool-call parser (`tool_parsers.py`) finds its calls.
- `required`: the output is a JSON array of `{"name", "parameters"}` objects, one per
  call (vLLM's format), enforced by a grammar built from the tools' parameter schemas.
- a named function: the output is that function's arguments, enforced by its schema.
- `none`: no tool is called (the tools still reach the template, as in vLLM).

A chat template that knows tools gets them as `tools=`, and assistant `tool_calls` with
their arguments as objects. A template that does not (SmolLM2's) gets the Hermes format
spelled out: the tools in the system message, calls as `<tool_call>` blocks in the
assistant's content and results as `<tool_response>` blocks, so any chat model can be
prompted for tools.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from kiln.entrypoints.openai.errors import bad_request
from kiln.entrypoints.openai.protocol import ChatCompletionRequest
from kiln.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures "
    "within <tools></tools> XML tags. You may call one or more functions to assist with "
    "the user query. Don't make assumptions about what values to plug into functions. "
    "Here are the available tools: <tools>\n{tools}\n</tools>\nFor each function call "
    "return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What the request's tools mean for this chat completion."""

    tools: list[dict[str, Any]]  # OpenAI function tools, checked
    choice: str  # "none" | "auto" | "required" | "named"
    function: str | None = None  # the named function
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        if self.choice == "named":
            return StructuredOutputsParams(json=_parameters(self._tool(self.function)))
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {
            "name": {"type": "string", "enum": [t["function"]["name"]]},
            "parameters": _parameters(t)}, "required": ["name", "parameters"]}
            for t in self.tools]
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    def _tool(self, name: str | None) -> dict[str, Any]:
        return next(t for t in self.tools if t["function"]["name"] == name)


def plan_tools(req: ChatCompletionRequest) -> ToolPlan:
    tools = [_check_tool(i, t) for i, t in enumerate(req.tools or [])]
    choice, function = _check_choice(req.tool_choice, tools)
    return ToolPlan(tools, choice, function, req.parallel_tool_calls is not False)


def _check_tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" \
            or not isinstance(tool.get("function"), dict):
        raise bad_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}",
                          where)
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f"{where}.function.name must be a non-empty string",
                          f"{where}.function.name")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                          f"{where}.function.parameters")
    return tool


def _check_choice(choice: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise bad_request(f"tool_choice={choice!r} needs tools", "tool_choice")
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name in {t["function"]["name"] for t in tools}:
            return "named", name
        raise bad_request(f"tool_choice names function {name!r}, which is not in tools",
                          "tool_choice")
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                      "{'type': 'function', 'function': {'name': ...}}", "tool_choice")


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


# ---- the prompt ------------------------------------------------------------------------
def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def render_messages(messages: list[dict[str, Any]], plan: ToolPlan,
                    native: bool) -> list[dict[str, Any]]:
    """Messages for the chat template: assistant tool calls with repaired arguments and,
    for templates without tool support, everything in the Hermes format."""
    out = [_with_arguments_repaired(m) for m in messages]
    if native:
        return out
    out = [_hermes_message(m) for m in out]
    if plan.tools:
        text = _HERMES_SYSTEM.format(tools="\n".join(json.dumps(t["function"])
                                                     for t in plan.tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _with_arguments_repaired(m: dict[str, Any]) -> dict[str, Any]:
    """Arguments become objects (what templates read). Malformed ones become {} with a
    warning: they stay in the history, so failing here would fail every later turn."""
    calls = m.get("tool_calls")
    if m.get("role") != "assistant" or not isinstance(calls, list):
        return m
    fixed = []
    for call in calls:
        fn = dict((call or {}).get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            logger.warning("tool call %r in the history has malformed arguments; using {}",
                           fn.get("name"))
            args = {}
        fixed.append({**call, "function": {**fn, "arguments": args}})
    return {**m, "tool_calls": fixed}


def _hermes_message(m: dict[str, Any]) -> dict[str, Any]:
    if m.get("role") == "assistant" and m.get("tool_calls"):
        blocks = [json.dumps({"name": c["function"].get("name"),
                              "arguments": c["function"]["arguments"]})
                  for c in m["tool_calls"]]
        text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
        content = f"{m['content']}\n{text}" if m.get("content") else text
        return {k: v for k, v in m.items() if k != "tool_calls"} | {"content": content}
    if m.get("role") == "tool":
        return {**m, "content": f"<tool_response>\n{m.get('content') or ''}\n"
                                "</tool_response>"}
    return m
