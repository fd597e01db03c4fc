"""`kiln serve` as a client sees it: one real server process per module, driven with the
official `openai` client (and raw HTTP where the client would not send the bad input)."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import (API_KEY, ENGINE_KWARGS, MODEL_NAME, make_tiny_chat_model,
                          run_load, start_server, stop_server, wait_ready)

from kiln import LLM, SamplingParams
from kiln.entrypoints.openai.params import supports

pytestmark = pytest.mark.slow


def _has_n() -> bool:
    try:
        SamplingParams(n=2)
        return True
    except ValueError:
        return False


# The sampling work (issue 5) adds these; until it lands the server answers 400 for them.
needs_n = pytest.mark.xfail(not _has_n(), strict=True,
                            reason="engine lacks n>1 (SamplingParams work, issue 5)")
needs_logprobs = pytest.mark.xfail(not supports("logprobs"), strict=True,
                                   reason="engine lacks logprobs (SamplingParams work, issue 5)")
needs_stop = pytest.mark.xfail(not supports("stop"), strict=True,
                               reason="engine lacks stop strings (SamplingParams work, issue 5)")

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,"]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def env(tmp_path_factory, smollm2_dir):
    """(server, client, reference LLM). The reference engine is built while the server
    process starts, so the two start-ups overlap."""
    root = tmp_path_factory.mktemp("serve")
    model_dir = make_tiny_chat_model(root / "model", smollm2_dir)
    server = start_server(model_dir, root / "server.log")
    try:
        ref = LLM(str(model_dir), progress=False, **ENGINE_KWARGS)
        wait_ready(server)
        client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0,
                               timeout=60)
        yield server, client, ref
    finally:
        stop_server(server)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def post(server, path: str, body: bytes | dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.v1}{path}", content=data, headers=headers, timeout=60)


def test_startup_models_health_metrics(env):
    server, client, _ = env
    log = server.log()
    assert "start-up: engine" in log and "start-up: warm-up request" in log
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    # The exposition parses as Prometheus text, and every promised family is there.
    text = httpx.get(f"{server.base_url}/metrics").text
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {"kiln:request_success", "kiln:time_to_first_token_seconds",
            "kiln:inter_token_latency_seconds", "kiln:kv_cache_usage_perc"} <= families
    m = server.metrics()
    for name in ("kiln:num_requests_running", "kiln:num_requests_waiting",
                 "kiln:kv_cache_usage_perc", "kiln:prefix_cache_hit_rate",
                 "kiln:prompt_tokens_total", "kiln:generation_tokens_total",
                 "kiln:time_to_first_token_seconds_count",
                 "kiln:inter_token_latency_seconds_count"):
        assert name in m, name


def test_completion_greedy_equals_llm_generate(env):
    server, client, ref = env
    expected = ref.generate(PROMPTS, greedy(12), use_tqdm=False)
    for prompt, exp in zip(PROMPTS, expected):
        res = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12,
                                        temperature=0)
        assert res.choices[0].text == exp.outputs[0].text
        assert res.choices[0].finish_reason == exp.outputs[0].finish_reason
        assert res.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert res.usage.completion_tokens == len(exp.outputs[0].token_ids)
    # A batch of prompts in one request: one choice per prompt, in order.
    batch = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [e.outputs[0].text for e in expected]
    # Token-id prompts work too.
    ids = client.completions.create(model=MODEL_NAME, prompt=expected[0].prompt_token_ids,
                                    max_tokens=12, temperature=0)
    assert ids.choices[0].text == expected[0].outputs[0].text
    echo = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12,
                                     temperature=0, echo=True)
    assert echo.choices[0].text == PROMPTS[0] + expected[0].outputs[0].text


def test_chat_greedy_equals_llm_chat(env):
    _, client, ref = env
    exp = ref.chat(CHAT, greedy(10), use_tqdm=False)[0]
    res = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=10,
                                         temperature=0)
    assert res.object == "chat.completion"
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == exp.outputs[0].text
    assert res.usage.prompt_tokens == len(exp.prompt_token_ids)
    assert res.usage.completion_tokens == len(exp.outputs[0].token_ids)


def test_streaming_chat(env):
    _, client, ref = env
    exp = ref.chat(CHAT, greedy(10), use_tqdm=False)[0]
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == exp.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == exp.outputs[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(exp.outputs[0].token_ids)
    assert len(chunks) >= 4  # streamed piece by piece, not in one lump


def test_streaming_completion_raw_sse(env):
    server, _, ref = env
    exp = ref.generate(PROMPTS[1], greedy(8), use_tqdm=False)[0]
    res = post(server, "/completions", {"prompt": PROMPTS[1], "max_tokens": 8,
                                        "temperature": 0, "stream": True})
    assert res.status_code == 200
    assert res.headers["content-type"].startswith("text/event-stream")
    events = [e for e in res.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    pieces = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert "".join(p["choices"][0]["text"] for p in pieces) == exp.outputs[0].text


@needs_n
def test_n_greater_than_one(env):
    _, client, ref = env
    exp = ref.generate(PROMPTS[0], greedy(8), use_tqdm=False)[0].outputs[0]
    # Greedy: every choice is the greedy answer.
    res = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8,
                                    temperature=0, n=3)
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert all(c.text == exp.text for c in res.choices)
    assert res.usage.completion_tokens == 3 * len(exp.token_ids)
    # Sampled and streamed: every index gets its content and exactly one finish.
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8,
                                            temperature=1.0, seed=7, n=2, stream=True)
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert all(texts.values()) and all(len(f) == 1 for f in finishes.values())


@needs_logprobs
def test_logprobs(env):
    _, client, _ = env
    res = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6,
                                    temperature=0, logprobs=3)
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == res.usage.completion_tokens
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and sampled <= 0
        assert sampled == pytest.approx(max(top.values()))  # greedy takes the best
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


@needs_stop
def test_stop_strings(env):
    _, client, ref = env
    full = ref.generate(PROMPTS[2], greedy(16, ignore_eos=True), use_tqdm=False)[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    cut = text.index(stop)
    res = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=16,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert res.choices[0].text == text[:cut]
    assert res.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=16,
                                     temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True,
                                                 "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:cut + len(stop)]
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=16,
                                         temperature=0, stop=[stop], stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text[:cut]


# (what is sent, expected status, expected param, words the message must contain)
BAD = {
    "malformed-json": (b'{"prompt": "hi", "max_tokens": ', 400, None, "not valid JSON"),
    "not-an-object": (b'["hi"]', 400, None, "JSON object"),
    "wrong-type-max-tokens": ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens",
                              "integer"),
    "wrong-type-prompt": ({"prompt": {"text": "hi"}}, 400, "prompt", "prompt"),
    "negative-max-tokens": ({"prompt": "hi", "max_tokens": -5}, 400, "max_tokens",
                            "positive"),
    "bad-temperature": ({"prompt": "hi", "temperature": -1}, 400, "temperature",
                        "temperature"),
    "unknown-parameter": ({"prompt": "hi", "frobnicate": 1}, 400, "frobnicate",
                          "unknown parameter"),
    "unknown-model": ({"prompt": "hi", "model": "gpt-9"}, 404, "model", "does not exist"),
    "prompt-too-long": ({"prompt": "word " * 300}, 400, None, "max_model_len"),
    "max-tokens-too-many": ({"prompt": "hi", "max_tokens": 1000}, 400, "max_tokens",
                            "max_model_len"),
    "empty-prompt": ({"prompt": ""}, 400, "prompt", "empty"),
    "body-too-large": ({"prompt": "x" * (1 << 20)}, 413, None, "limit"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_fails_alone(env, case):
    server, client, _ = env
    body, status, param, words = BAD[case]
    res = post(server, "/completions", body)
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and words in err["message"], err
    # ... and the server carries on.
    ok = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_bad_chat_requests(env):
    server, client, _ = env
    res = post(server, "/chat/completions", {"messages": "hi"})
    assert res.status_code == 400 and res.json()["error"]["param"] == "messages"
    res = post(server, "/chat/completions", {"messages": [{"role": "user", "content": 5}]})
    assert res.status_code == 400 and "messages.0.content" in res.json()["error"]["param"]
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT,
                                       max_completion_tokens=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=CHAT)
    ok = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_api_key_required(env):
    server, _, _ = env
    missing = post(server, "/completions", {"prompt": "hi"}, key=None)
    assert missing.status_code == 401 and "missing API key" in missing.json()["error"]["message"]
    wrong = openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        wrong.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # probes need no key
    assert post(server, "/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_client_disconnect_aborts_and_frees_blocks(env):
    server, _, _ = env
    before = server.wait_idle()
    aborts = before.get('kiln:request_success_total{finished_reason="abort"}', 0)
    body = {"prompt": "Once upon a time", "max_tokens": 250, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{server.v1}/completions", json=body, headers=headers,
                      timeout=30) as res:
        assert res.status_code == 200
        next(res.iter_lines())  # the first token arrived: the request is running
    wait_for_aborts(server, aborts + 1)
    server.wait_idle()  # running 0, KV usage 0: the aborted request's blocks are free


def wait_for_aborts(server, expected: float, timeout: float = 30.0) -> None:
    name = 'kiln:request_success_total{finished_reason="abort"}'
    deadline = time.monotonic() + timeout
    while server.metrics().get(name, 0) < expected:
        assert time.monotonic() < deadline, f"no abort counted: {server.metrics()}"
        time.sleep(0.1)
    assert server.metrics()[name] == expected


def test_load_64_concurrent_streams_no_leak(env):
    server, _, _ = env
    before = server.wait_idle()
    result = asyncio.run(run_load(server.v1, API_KEY, MODEL_NAME, num_requests=64,
                                  max_tokens=16))
    print(f"\nload (tiny model, -O0, this machine): {result.summary()}")
    assert result.completed == 64 and result.tokens == 64 * 16  # none lost, none short
    after = server.wait_idle()  # running = waiting = 0 and no KV block held
    finished = 'kiln:request_success_total{finished_reason="length"}'
    assert after[finished] - before.get(finished, 0) == 64
    assert after["kiln:generation_tokens_total"] - before["kiln:generation_tokens_total"] \
        == 64 * 16
    # Half the prompts share a prefix: the prefix cache was hit, yet nothing stays held.
    assert after["kiln:prefix_cache_hits_total"] > before["kiln:prefix_cache_hits_total"]
    assert server.proc.poll() is None


def test_non_streaming_disconnect_aborts(env):
    server, _, _ = env
    before = server.wait_idle()
    aborts = before.get('kiln:request_success_total{finished_reason="abort"}', 0)
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 250}).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    # Gone before the answer: the server notices within its poll interval and aborts.
    wait_for_aborts(server, aborts + 1)
    server.wait_idle()
