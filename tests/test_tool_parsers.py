"""Tool calls in text and tools in prompts: the Hermes parser (whole and streamed, split
at every character) and the message rendering, without a model."""
from __future__ import annotations

import json

import pytest

from kiln.entrypoints.openai.chat_output import ChoiceOutput
from kiln.entrypoints.openai.tool_parsers import HermesToolParser, make_tool_parser
from kiln.entrypoints.openai.tools import ToolPlan, render_messages

TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}'
        '</tool_call> <tool_call>not json</tool_call> done')
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    for n in ("get_weather", "get_time")]


def calls(found):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found]


def test_hermes_extracts_calls_and_keeps_the_rest_as_content():
    found = HermesToolParser().extract(TEXT)
    assert calls(found.calls) == [("get_weather", {"city": "Paris"}),
                                  ("get_time", {"tz": "CET"})]
    assert found.content == "Let me check. \n <tool_call>not json</tool_call> done"
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in found.calls)
    assert HermesToolParser().extract("no calls").content == "no calls"
    unclosed = HermesToolParser().extract('<tool_call>{"name": "f", "arguments": {}}')
    assert calls(unclosed.calls) == [("f", {})] and unclosed.content is None


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_hermes_streaming_matches_the_whole_text(chunk):
    parser, content, found = HermesToolParser(), "", []
    for i in range(0, len(TEXT), chunk):
        text, new = parser.feed(TEXT[i:i + chunk])
        assert "<tool_c" not in text or "not json" in text  # a marker never leaks in part
        content, found = content + text, found + new
    text, new = parser.flush()
    content, found = content + text, found + new
    assert calls(found) == calls(HermesToolParser().extract(TEXT).calls)
    assert content == HermesToolParser().extract(TEXT).content


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes"):
        make_tool_parser("nope")


def test_required_and_named_constraints_and_finish_reasons():
    required = ToolPlan(TOOLS, "required", parallel=False).constraint().json
    assert required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    named = ToolPlan(TOOLS, "named", "get_time").constraint().json
    assert named == TOOLS[1]["function"]["parameters"]
    msg, finish = ChoiceOutput(ToolPlan(TOOLS, "required"), "hermes").message(
        '[{"name": "get_time", "parameters": {"x": 1}}]', "stop")
    assert finish == "tool_calls" and msg["content"] is None
    assert calls(msg["tool_calls"]) == [("get_time", {"x": 1})]
    msg, finish = ChoiceOutput(ToolPlan(TOOLS, "named", "get_time"), "hermes").message(
        '{"x": 2}', "stop")
    assert finish == "stop" and calls(msg["tool_calls"]) == [("get_time", {"x": 2})]
    msg, finish = ChoiceOutput(ToolPlan(TOOLS, "auto"), "hermes").message(TEXT, "length")
    assert finish == "length" and len(msg["tool_calls"]) == 2  # cut short: not tool_calls


def test_hermes_prompt_for_templates_without_tools_and_argument_repair(caplog):
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{broken"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "18C"}]
    native = render_messages(history, ToolPlan(TOOLS, "auto"), native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {}  # repaired, warned
    assert "malformed arguments" in caplog.text
    hermes = render_messages(history, ToolPlan(TOOLS, "auto"), native=False)
    assert hermes[0]["role"] == "system" and "<tools>" in hermes[0]["content"]
    assert '"get_time"' in hermes[0]["content"]
    assert hermes[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {}}'
                                    '\n</tool_call>') and "tool_calls" not in hermes[2]
    assert hermes[3]["content"] == "<tool_response>\n18C\n</tool_response>"
