"""`kiln serve` with LoRA adapters, as a client sees it: ONE real server process (started
with `--lora-modules` and `--allow-runtime-lora-updating`), the official `openai` client,
and greedy references from an in-process `LLM` whose token ids are checked against
transformers + peft. What needs a server without the runtime flag, or one that fails to
start, is checked in process on the app itself (no port, no engine thread)."""
from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import peft
import pytest
import torch
import transformers
from conftest import hf_greedy
from lora_utils import make_adapter
from server_utils import (API_KEY, ENGINE_KWARGS, MODEL_NAME, Server, make_tiny_chat_model,
                          start_server, stop_server, wait_ready)

from kiln import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.slow

PROMPT_IDS = [1, 520, 3000, 77, 9000, 4321]
CHAT = [{"role": "user", "content": "Name a colour."}]
# Two adapters on different modules; "sql" is served from start-up, "chat" loaded at run
# time, "wide" has a rank over the server's --max-lora-rank 16.
ADAPTERS = {"sql": (4, ["q_proj", "v_proj"], 10), "chat": (8, ["o_proj", "down_proj"], 11),
            "wide": (32, ["q_proj"], 12)}


@dataclass
class Env:
    server: Server
    client: openai.OpenAI
    ref: LLM
    peft_models: dict[str, peft.PeftModel]
    paths: dict[str, Path]
    root: Path

    def lora(self, name: str) -> LoRARequest:
        """The adapter for the reference engine. Its ids need not match the server's, and
        stay clear of those an in-process app on this engine hands out (1, 2, ...)."""
        return LoRARequest(name, 100 + list(ADAPTERS).index(name), str(self.paths[name]))


@pytest.fixture(scope="module")
def env(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("serve-lora")
    model_dir = make_tiny_chat_model(root / "model", smollm2_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    paths = {name: root / name for name in ADAPTERS}
    models = {name: make_adapter(base.eval(), paths[name], r, targets, seed)
              for name, (r, targets, seed) in ADAPTERS.items()}
    # float32: the token ids are compared with transformers, and -O0 keeps start-up short.
    server = start_server(model_dir, root / "server.log", "--dtype", "float32",
                          "--max-loras", "2", "--lora-modules", f"sql={paths['sql']}",
                          "--allow-runtime-lora-updating")
    try:
        ref = LLM(str(model_dir), progress=False, dtype="float32", enable_lora=True,
                  max_loras=2, **ENGINE_KWARGS)
        wait_ready(server)
        client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0,
                               timeout=60)
        yield Env(server, client, ref, models, paths, root)
    finally:
        stop_server(server)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def expected(env: Env, name: str | None, max_tokens: int = 8) -> str:
    """The reference text, after checking the reference's tokens against peft's."""
    lora = None if name is None else env.lora(name)
    out = env.ref.generate({"prompt_token_ids": PROMPT_IDS}, greedy(max_tokens),
                           use_tqdm=False, lora_request=lora)[0].outputs[0]
    if name is not None:
        assert out.token_ids == hf_greedy(env.peft_models[name], PROMPT_IDS, max_tokens)
    return out.text


def complete(client: openai.OpenAI, model: str, max_tokens: int = 8) -> str:
    res = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=max_tokens,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert res.model == model
    return res.choices[0].text


def post(env: Env, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{env.server.v1}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"})


def lora_count(env: Env, name: str) -> float:
    return env.server.metrics().get(f'kiln:lora_requests_total{{lora_name="{name}"}}', 0)


def wait_count(env: Env, name: str, value: float, timeout: float = 10.0) -> None:
    """The count is published by the engine thread just after the step that answered."""
    deadline = time.monotonic() + timeout
    while lora_count(env, name) != value:
        assert time.monotonic() < deadline, (name, lora_count(env, name), value)
        time.sleep(0.05)


def test_models_lists_base_and_adapters(env):
    assert "LoRA on (--lora-modules and --allow-runtime-lora-updating)" in env.server.log()
    cards = {m.id: m for m in env.client.models.list().data}
    assert list(cards) == [MODEL_NAME, "sql"]
    sql = cards["sql"].model_dump()
    assert sql["parent"] == MODEL_NAME and sql["root"] == str(env.paths["sql"])
    assert env.client.models.retrieve("sql").id == "sql"
    assert env.client.models.retrieve(MODEL_NAME).model_dump()["parent"] is None
    with pytest.raises(openai.NotFoundError):
        env.client.models.retrieve("nope")


def test_model_field_selects_the_adapter(env):
    base, sql = expected(env, None), expected(env, "sql")
    assert base != sql  # the adapter really changes the answer
    assert complete(env.client, MODEL_NAME) == base
    before = lora_count(env, "sql")
    assert complete(env.client, "sql") == sql
    chat_ref = env.ref.chat(CHAT, greedy(6), use_tqdm=False,
                            lora_request=env.lora("sql"))[0].outputs[0].text
    chat = env.client.chat.completions.create(model="sql", messages=CHAT, max_tokens=6,
                                              temperature=0, extra_body={"ignore_eos": True})
    assert chat.model == "sql" and chat.choices[0].message.content == chat_ref
    wait_count(env, "sql", before + 2)  # one engine request each


def test_unknown_model_is_404(env):
    with pytest.raises(openai.NotFoundError, match="does not exist") as info:
        complete(env.client, "nope")
    assert info.value.body["code"] == "model_not_found"
    assert complete(env.client, "sql")  # and the server carries on


def test_runtime_load_and_unload(env):
    for body, words in (({"lora_name": "x", "lora_path": str(env.root / "missing")},
                         "adapter_config.json"),
                        ({"lora_name": "wide", "lora_path": str(env.paths["wide"])}, "rank"),
                        ({"lora_name": "sql", "lora_path": str(env.paths["chat"])},
                         "already been loaded"),
                        ({"lora_name": MODEL_NAME, "lora_path": str(env.paths["chat"])},
                         "base model")):
        res = post(env, "/load_lora_adapter", body)
        assert res.status_code == 400 and words in res.json()["error"]["message"], res.text
    assert [m.id for m in env.client.models.list().data] == [MODEL_NAME, "sql"]
    res = post(env, "/load_lora_adapter", {"lora_name": "chat",
                                           "lora_path": str(env.paths["chat"])})
    assert res.status_code == 200 and "added successfully" in res.text
    assert [m.id for m in env.client.models.list().data] == [MODEL_NAME, "sql", "chat"]
    # Base and both adapters at once (two slots): each gets its own answer.
    want = {name: expected(env, None if name == MODEL_NAME else name)
            for name in (MODEL_NAME, "sql", "chat")}

    async def all_at_once() -> dict[str, str]:
        client = openai.AsyncOpenAI(base_url=env.server.v1, api_key=API_KEY, max_retries=0)
        texts = await asyncio.gather(*(client.completions.create(
            model=m, prompt=PROMPT_IDS, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True}) for m in want))
        await client.close()
        return {m: t.choices[0].text for m, t in zip(want, texts)}

    assert asyncio.run(all_at_once()) == want
    wait_count(env, "chat", 1)
    res = post(env, "/unload_lora_adapter", {"lora_name": "chat"})
    assert res.status_code == 200 and "removed successfully" in res.text
    assert [m.id for m in env.client.models.list().data] == [MODEL_NAME, "sql"]
    with pytest.raises(openai.NotFoundError):
        complete(env.client, "chat")
    res = post(env, "/unload_lora_adapter", {"lora_name": "chat"})
    assert res.status_code == 400 and "cannot be found" in res.text


def test_unload_waits_for_running_requests(env):
    """An adapter deleted and unloaded while a request runs with it: the request
    finishes with it, and the workers drop it only then (dropping it at once would make
    the next step reload it from the deleted directory)."""
    path = env.root / "ephemeral"
    shutil.copytree(env.paths["chat"], path)
    assert post(env, "/load_lora_adapter", {"lora_name": "eph",
                                            "lora_path": str(path)}).status_code == 200
    want = expected(env, "chat", max_tokens=48)
    stream = env.client.completions.create(model="eph", prompt=PROMPT_IDS, max_tokens=48,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
    chunks = [next(iter(stream)).choices[0].text]  # running now
    shutil.rmtree(path)  # from here on, a reload from disk would fail the engine
    assert post(env, "/unload_lora_adapter", {"lora_name": "eph"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(env.client, "eph")
    chunks += [c.choices[0].text for c in stream if c.choices]
    assert "".join(chunks) == want
    assert httpx.get(f"{env.server.base_url}/health").status_code == 200
    assert complete(env.client, "sql") == expected(env, "sql")


def test_metrics_count_requests_per_adapter(env):
    before = lora_count(env, "sql")
    env.client.completions.create(model="sql", prompt=[PROMPT_IDS, PROMPT_IDS[:3]],
                                  max_tokens=2, temperature=0)
    wait_count(env, "sql", before + 2)  # one engine request per prompt
    env.server.wait_idle()  # and every adapter request's KV blocks are free again


def test_endpoints_404_without_the_flag_and_bad_modules_fail_start_up(env, monkeypatch):
    """In process, on the reference engine: no port and no engine thread needed."""
    from kiln.cli.main import build_parser
    from kiln.entrypoints.openai.app import ServerSettings, build_app

    app = build_app(env.ref.engine, ServerSettings(MODEL_NAME))

    async def calls() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://kiln") as c:
            return [await c.post("/v1/load_lora_adapter", json={
                        "lora_name": "sql", "lora_path": str(env.paths["sql"])}),
                    await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})]

    for res in asyncio.run(calls()):
        assert res.status_code == 404 and "--allow-runtime-lora-updating" in res.text
    bad = ServerSettings(MODEL_NAME, lora_modules=(("broken", str(env.root / "missing")),))
    with pytest.raises(ValueError, match="--lora-modules broken=.*adapter_config.json"):
        build_app(env.ref.engine, bad)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert build_parser().parse_args(["serve"]).allow_runtime_lora_updating


@pytest.mark.parametrize("value, words", [
    ("sql=/a", None), ('{"name": "sql", "path": "/a", "base_model_name": "m"}', None),
    ("sql", "NAME=PATH"), ("=/a", "non-empty"), ('{"name": "sql"}', "'path'"),
    ('{"name": ', "not valid JSON")])
def test_parse_lora_module(value, words):
    from kiln.entrypoints.openai.models import parse_lora_module

    if words is None:
        assert parse_lora_module(value) == ("sql", "/a")
    else:
        with pytest.raises(ValueError, match=words):
            parse_lora_module(value)
