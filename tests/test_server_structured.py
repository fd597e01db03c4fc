"""Structured output and tool calls through `kiln serve` with the real `openai` client, on
SmolLM2 (a real model: its constrained JSON must also close by itself)."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from server_utils import API_KEY, MODEL_NAME, start_server, stop_server, wait_ready

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False,
               "required": ["name", "age", "email_verified"],
               "properties": {"name": {"type": "string", "maxLength": 30},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "email_verified": {"type": "boolean"}}},
    "order": {"type": "object", "required": ["id", "items", "status"],
              "properties": {
                  "id": {"type": "integer", "minimum": 1},
                  "status": {"enum": ["pending", "shipped", "delivered"]},
                  "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                      "type": "object", "required": ["sku", "qty", "price"],
                      "additionalProperties": False,
                      "properties": {"sku": {"type": "string", "maxLength": 12},
                                     "qty": {"type": "integer", "minimum": 1,
                                             "maximum": 9},
                                     "price": {"type": "number", "minimum": 0}}}}}},
    "city": {"type": "object", "required": ["city", "location"],
             "properties": {"city": {"type": "string", "maxLength": 24},
                            "location": {"type": "object", "required": ["lat", "lon"],
                                         "properties": {
                                             "lat": {"type": "number", "minimum": -90,
                                                     "maximum": 90},
                                             "lon": {"type": "number", "minimum": -180,
                                                     "maximum": 180}}}}},
    "tags": {"type": "array", "minItems": 2, "maxItems": 4,
             "items": {"type": "string", "enum": ["red", "green", "blue", "black"]}},
}
PROMPTS = {"person": "Describe Ann, a 31 year old engineer, as JSON.",
           "order": "Write a JSON order with two items.",
           "city": "Give Paris and its coordinates as JSON.",
           "tags": "List some colors of a flag as JSON."}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                      "parameters": {"type": "object", "required": ["tz"],
                                                     "properties": {"tz": {
                                                         "type": "string",
                                                         "maxLength": 30}}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("serve-so")
    server = start_server(smollm2_dir, root / "server.log")
    try:
        wait_ready(server)
        yield openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    finally:
        stop_server(server)


def chat(client, messages, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 160)
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, **kw)


def concurrently(fn, items):
    """One request per item at once: they share engine steps (the suite's time)."""
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def test_json_schema_outputs_parse_and_validate(client):
    def ask(name):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "strict": True,
                                                      "schema": SCHEMAS[name]}}
        return chat(client, [{"role": "user", "content": PROMPTS[name]}],
                    response_format=fmt, n=2, seed=1, temperature=0.7, max_tokens=400)

    for name, r in zip(SCHEMAS, concurrently(ask, list(SCHEMAS))):
        for choice in r.choices:  # 100%: every sample of every schema
            assert choice.finish_reason == "stop", (name, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_object_choice_regex_and_streaming(client):
    r = chat(client, [{"role": "user", "content": "A JSON object about a cat, please."}],
             response_format={"type": "json_object"}, max_tokens=40)
    text = r.choices[0].message.content  # free-form JSON: it may well run to max_tokens
    assert text.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    r = client.completions.create(model=MODEL_NAME, prompt="Is the sky blue? Answer:",
                                  max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {
                                      "choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Give a date."}],
        temperature=0, max_tokens=20, stream=True,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch(r"20\d{2}-[01]\d-[0-3]\d", text)


def test_an_unclosed_json_finishes_with_length(client):
    r = chat(client, [{"role": "user", "content": PROMPTS["order"]}], max_tokens=6,
             response_format={"type": "json_schema",
                              "json_schema": {"name": "o", "schema": SCHEMAS["order"]}})
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 5}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= nope"}}},
     "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
     "structured_outputs"),
    ({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_constraints_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, ASK, **body)
    assert err.value.body["param"] == param, err.value.body
    assert chat(client, ASK, max_tokens=2).choices[0].finish_reason == "length"  # serving on


def _stream_tool_calls(stream) -> tuple[dict[int, dict], str | None, str]:
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = entry["id"] or tc.id
                entry["name"] += (tc.function.name or "") if tc.function else ""
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = c.finish_reason or finish
    return calls, finish, content


def test_tool_calls_round_trip(client):
    """required and named choices, streamed and not: call, tool result, final answer."""
    cases = [(stream, choice) for stream in (False, True) for choice in ("required", "named")]
    concurrently(lambda case: _round_trip(client, *case), cases)


def _round_trip(client, stream, tool_choice):
    choice = tool_choice if tool_choice == "required" else \
        {"type": "function", "function": {"name": "get_weather"}}
    # One call (maxItems 1): a 135M model may otherwise list calls until max_tokens.
    kw = dict(tools=WEATHER, tool_choice=choice, parallel_tool_calls=False, max_tokens=200)
    if stream:
        calls, finish, _ = _stream_tool_calls(chat(client, ASK, stream=True, **kw))
        calls = [{"id": c["id"], "type": "function",
                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for _, c in sorted(calls.items())]
    else:
        r = chat(client, ASK, **kw)
        finish = r.choices[0].finish_reason
        assert r.choices[0].message.content is None
        calls = [c.model_dump() for c in r.choices[0].message.tool_calls]
    assert finish == ("tool_calls" if tool_choice == "required" else "stop")
    assert len(calls) == 1 and calls[0]["id"].startswith("call_")
    for c in calls:
        tool = next(t for t in WEATHER if t["function"]["name"] == c["function"]["name"])
        jsonschema.validate(json.loads(c["function"]["arguments"]),
                            tool["function"]["parameters"])
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": calls}] + [
        {"role": "tool", "tool_call_id": c["id"], "content": '{"temp_c": 18, "sky": "sun"}'}
        for c in calls]
    final = chat(client, history, tools=WEATHER, max_tokens=30)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_hermes_tool_calls(client, stream):
    """The model's own `<tool_call>` text, forced here by a regex so a 135M model emits it,
    becomes `tool_calls`; text around it stays content."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    kw = dict(tools=WEATHER, tool_choice="auto", max_tokens=60,
              extra_body={"structured_outputs": {"regex": re.escape("Checking. " + call)}})
    if stream:
        calls, finish, content = _stream_tool_calls(chat(client, ASK, stream=True, **kw))
        got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    else:
        r = chat(client, ASK, **kw)
        finish, content = r.choices[0].finish_reason, r.choices[0].message.content
        got = [(c.function.name, json.loads(c.function.arguments))
               for c in r.choices[0].message.tool_calls]
    assert got == [("get_time", {"tz": "CET"})]
    assert finish == "tool_calls" and content.strip() == "Checking."


def test_malformed_history_arguments_are_coerced(client):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    r = chat(client, history, tools=WEATHER, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length")
