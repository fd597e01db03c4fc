"""Prefill/decode disaggregation over HTTP: a real prefill server, decode server and
`kiln serve --pd-proxy` (three processes on 127.0.0.1), the KV moving between the two
servers over a torch.distributed gloo pair; answers equal one in-process instance
(float32: in bfloat16 a loaded prefix's last token is computed in another kernel than in
one whole prefill, and a tiny random model's near-ties can flip on that)."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest

from kiln import LLM, SamplingParams
from server_utils import (API_KEY, ENGINE_KWARGS, MODEL_NAME, Server, free_port,
                          make_tiny_chat_model, start_server, stop_server, wait_ready)

PROMPT = ("You are a careful assistant. Answer in one short sentence, plainly. " * 3
          + "Question: what is a kiln?")


def _kv(role: str, port: int) -> list[str]:
    return ["--dtype", "float32", "--kv-transfer-config", json.dumps({
        "kv_connector": "torch_distributed", "kv_role": role, "kv_port": port,
        "kv_connector_extra_config": {"remote_timeout_s": 60}})]


def _proxy(p_url: str, d_url: str, log_path) -> Server:
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "serve",
                             "--pd-proxy", p_url, d_url, "--port", str(port),
                             "--pd-prefill-timeout", "30"], stdout=log,
                            stderr=subprocess.STDOUT)
    return Server(proc, f"http://127.0.0.1:{port}", log_path)


@pytest.fixture(scope="module")
def pd(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("pd")
    model_dir = make_tiny_chat_model(root / "model", smollm2_dir)
    kv_port = free_port()
    servers = [start_server(model_dir, root / "p.log", *_kv("kv_producer", kv_port)),
               start_server(model_dir, root / "d.log", *_kv("kv_consumer", kv_port))]
    p, d = servers
    servers.append(_proxy(p.base_url, d.base_url, root / "proxy.log"))
    servers.append(_proxy(f"http://127.0.0.1:{free_port()}", d.base_url,  # P is down
                          root / "proxy-down.log"))
    try:
        ref = LLM(str(model_dir), progress=False, dtype="float32", **ENGINE_KWARGS)
        for s in servers:
            wait_ready(s)
        yield servers, ref
    finally:
        for s in servers:
            stop_server(s)


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)


def test_pd_through_the_proxy_equals_one_instance(pd):
    (p, d, proxy, _), ref = pd
    want = ref.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16,
                                                 ignore_eos=True), use_tqdm=False)
    want = want[0].outputs[0].text
    client = _client(proxy)
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].text == want
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == want
    metrics = d.metrics()
    # The first request loads the prompt's blocks; the second hits them in D's own cache.
    assert metrics["kiln:kv_transfer_hit_tokens_total"] >= 16 * 3
    assert metrics["kiln:kv_transfer_remote_timeouts_total"] == 0
    assert p.metrics()["kiln:kv_transfer_blocks_saved_total"] > 0
    stats = httpx.get(f"{proxy.base_url}/proxy_stats").json()
    assert stats == {"requests": 2, "prefill_failures": 0}


def test_pd_proxy_with_the_prefill_instance_down_lets_decode_compute(pd):
    (_, d, _, proxy_down), ref = pd
    chat = [{"role": "user", "content": "Name a colour."}]
    want = ref.chat([chat], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    got = _client(proxy_down).chat.completions.create(model=MODEL_NAME, messages=chat,
                                                      max_tokens=8, temperature=0)
    assert got.choices[0].message.content == want[0].outputs[0].text
    assert httpx.get(f"{proxy_down.base_url}/proxy_stats").json()["prefill_failures"] == 1


def test_unknown_kv_transfer_params_are_a_400_and_the_server_keeps_serving(pd):
    (_, d, _, _), _ = pd
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2,
            "kv_transfer_params": {"do_remote_prefil": True}}
    r = httpx.post(f"{d.v1}/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and "do_remote_prefil" in r.json()["error"]["message"]
    ok = _client(d).completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
