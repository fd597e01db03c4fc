"""`kiln serve -dp 2` as a client sees it: a real front process and its two replica
processes (tiny random Llama with SmolLM2's tokenizer, -O0, float32), driven with the
official `openai` client. Every test that starts servers checks at its end that the front
and both replicas are gone."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import (
    API_KEY,
    ENGINE_KWARGS,
    MODEL_NAME,
    Server,
    make_tiny_chat_model,
    start_server,
    stop_server,
    wait_ready,
)

from kiln import LLM, SamplingParams
from kiln.cli.main import build_parser, main
from kiln.entrypoints.openai.dp_metrics import add_label, merge_expositions
from kiln.entrypoints.openai.dp_replicas import check_data_parallel, child_argv

pytestmark = pytest.mark.slow
DP_FLAGS = ("--dtype", "float32", "--max-model-len", "1024", "-dp", "2")
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir) -> Path:
    """The server tests' tiny chat model, with room for 1,000-token answers: a replica is
    killed while its requests still have hundreds of tokens to go."""
    path = make_tiny_chat_model(tmp_path_factory.mktemp("dp") / "model", smollm2_dir)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 1024  # default RoPE: the weights do not change
    (path / "config.json").write_text(json.dumps(config))
    return path


def replicas(server: Server) -> list[dict]:
    return httpx.get(f"{server.base_url}/dp/replicas", headers=AUTH, timeout=10).json()


def gone(pid: int) -> bool:
    """Exited (a zombie left to a non-reaping init counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def assert_all_gone(pids: list[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(gone(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if not gone(p)]
        time.sleep(0.1)


def samples(server: Server) -> dict[str, float]:
    """name{labels} -> value, the labels as the exposition writes them."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names)), "a family appears twice"
    return {m.group(1): float(m.group(2)) for line in text.splitlines()
            if (m := re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line))}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


async def _one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
    """(text, the replica that served it); i % 4 picks completion or chat, streamed or
    not."""
    kind, stream = ("chat" if i % 2 else "completion"), i % 4 >= 2
    if kind == "chat":
        args = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"Hi {i}"}],
                "max_tokens": 12, "temperature": 0}
        if stream:
            s = await client.chat.completions.create(**args, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in s
                            if c.choices])
            return text, s.response.headers["x-kiln-dp-engine"]
        raw = await client.chat.completions.with_raw_response.create(**args)
        return raw.parse().choices[0].message.content, raw.headers["x-kiln-dp-engine"]
    args = {"model": MODEL_NAME, "prompt": f"Request {i}: the number {i} is",
            "max_tokens": 12, "temperature": 0}
    if stream:
        s = await client.completions.create(**args, stream=True)
        text = "".join([c.choices[0].text async for c in s if c.choices])
        return text, s.response.headers["x-kiln-dp-engine"]
    raw = await client.completions.with_raw_response.create(**args)
    return raw.parse().choices[0].text, raw.headers["x-kiln-dp-engine"]


async def _concurrently(base_url: str, n: int) -> list[tuple[str, str]]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0,
                                timeout=60)
    try:
        return await asyncio.gather(*(_one(client, i) for i in range(n)))
    finally:
        await client.close()


def reference_answers(model_dir: Path, n: int) -> list[str]:
    """One engine's greedy answers to n requests, completions and chats alternating."""
    ref = LLM(str(model_dir), dtype="float32", progress=False, **ENGINE_KWARGS)
    prompts = [f"Request {i}: the number {i} is" for i in range(0, n, 2)]
    completions = ref.generate(prompts, greedy(12), use_tqdm=False)
    chats = ref.chat([[{"role": "user", "content": f"Hi {i}"}] for i in range(1, n, 2)],
                     greedy(12), use_tqdm=False)
    return [o.outputs[0].text for pair in zip(completions, chats) for o in pair]


def test_dp2_serves_like_one_engine_and_a_killed_replica_fails_only_its_own(model_dir,
                                                                           tmp_path):
    """32 concurrent requests answer as one engine and both replicas serve; then, on the
    same server (one start for the suite's budget), a replica killed mid-stream fails
    only its own requests, the other serves on, and the last one's death ends the front
    with exit 1. A clean SIGTERM stop is the Ray test's end."""
    server = start_server(model_dir, tmp_path / "dp.log", *DP_FLAGS)
    pids = [server.proc.pid]
    try:
        # The reference engine loads while the three server processes start.
        expected = reference_answers(model_dir, 32)
        wait_ready(server)
        reps = replicas(server)
        pids += [r["pid"] for r in reps]
        assert httpx.get(f"{server.base_url}/health").json()["replicas_alive"] == 2

        start = time.perf_counter()
        results = asyncio.run(_concurrently(server.v1, 32))
        print(f"\n32 requests through -dp 2 in {time.perf_counter() - start:.2f} s")
        assert [text for text, _ in results] == expected
        served = [engine for _, engine in results]
        assert set(served) == {"0", "1"}, served

        client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL_NAME]
        m = samples(server)
        # The router's count per replica agrees with which replica answered.
        for e in ("0", "1"):
            assert m[f'kiln:dp_requests_total{{engine="{e}"}}'] == served.count(e)
            assert m[f'kiln:dp_replica_up{{engine="{e}"}}'] == 1
            assert m[f'kiln:generation_tokens_total{{engine="{e}"}}'] > 0
        assert sum(m[f'kiln:generation_tokens_total{{engine="{e}"}}']
                   for e in "01") == 32 * 12
        assert {k for k in m if k.startswith("kiln:num_requests_running")} == {
            'kiln:num_requests_running{engine="0"}', 'kiln:num_requests_running{engine="1"}'}

        # A replica killed with requests in flight.
        client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0,
                               timeout=30)
        long = {"model": MODEL_NAME, "temperature": 0, "extra_body": {"ignore_eos": True}}
        streams = [client.completions.create(prompt=f"Story {i}:", max_tokens=900,
                                             stream=True, **long) for i in range(4)]
        engines = [s.response.headers["x-kiln-dp-engine"] for s in streams]
        assert sorted(engines) == ["0", "0", "1", "1"]  # least loaded, ties in turn
        iters = [iter(s) for s in streams]
        for it in iters:
            next(it)  # each request is running on its replica

        # Two non-streamed requests: one per replica (both have two in flight).
        results: list[object] = [None, None]

        def call(k: int) -> None:
            try:
                results[k] = client.completions.create(prompt=f"Plain {k}:", max_tokens=600,
                                                       **long)
            except openai.APIError as exc:
                results[k] = exc

        threads = [threading.Thread(target=call, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while [r["in_flight"] for r in replicas(server)] != [3, 3]:
            assert time.monotonic() < deadline, replicas(server)
            time.sleep(0.01)
        os.kill(reps[1]["pid"], signal.SIGKILL)

        start = time.monotonic()
        for it, engine in zip(iters, engines):
            if engine == "1":  # an error event, then the end: no hang
                with pytest.raises(openai.APIError, match="replica 1 died"):
                    for _ in it:
                        pass
            else:  # unharmed: it goes on, then the client leaves (aborted on replica 0)
                assert sum(1 for _, _ in zip(range(20), it)) == 20
        for s in streams:
            s.close()
        for t in threads:
            t.join(30)
        assert time.monotonic() - start < 20
        errors = [r for r in results if isinstance(r, openai.APIError)]
        assert len(errors) == 1 and errors[0].status_code == 502, results
        assert errors[0].code == "replica_failed"
        assert sum(1 for r in results if isinstance(r, openai.types.Completion)) == 1

        assert httpx.get(f"{server.base_url}/health").status_code == 200
        state = replicas(server)
        assert [r["alive"] for r in state] == [True, False]
        assert state[1]["exit_reason"] == "killed by SIGKILL"
        assert state[1]["errors_total"] == 3  # two streams and one plain request
        # New requests go to the survivor.
        after = asyncio.run(_concurrently(server.v1, 6))
        assert {engine for _, engine in after} == {"0"} and all(t for t, _ in after)
        m = samples(server)
        assert m['kiln:dp_replica_up{engine="1"}'] == 0
        assert not any('engine="1"' in k for k in m if not k.startswith("kiln:dp_"))
        deadline = time.monotonic() + 20  # the closed streams were aborted on replica 0
        while (m := samples(server))['kiln:num_requests_running{engine="0"}'] \
                or m['kiln:kv_cache_usage_perc{engine="0"}']:
            assert time.monotonic() < deadline, m
            time.sleep(0.1)
        assert m['kiln:request_success_total{engine="0",finished_reason="abort"}'] >= 2

        # The last replica dies: the front exits non-zero by itself.
        os.kill(reps[0]["pid"], signal.SIGKILL)
        assert server.proc.wait(timeout=30) == 1
    finally:
        stop_server(server)
    assert_all_gone(pids)




def test_replicas_die_with_a_killed_front(model_dir, tmp_path):
    server = start_server(model_dir, tmp_path / "dp.log", *DP_FLAGS)
    try:
        wait_ready(server)
        pids = [r["pid"] for r in replicas(server)]
        server.proc.kill()  # no handler runs: PR_SET_PDEATHSIG stops the replicas
        server.proc.wait()
        assert_all_gone(pids)
    finally:
        stop_server(server)


def _process_tree(root: int) -> dict[int, str]:
    """pid -> command line of `root` and every process below it."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True,
                         text=True, check=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines()]
    children: dict[int, list[tuple[int, str]]] = {}
    for pid, ppid, *args in rows:
        children.setdefault(int(ppid), []).append((int(pid), args[0] if args else ""))
    tree, todo = {}, [root]
    while todo:
        for pid, args in children.get(todo.pop(), []):
            tree[pid] = args
            todo.append(pid)
    return tree


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")
def test_dp2_on_ray_serves_like_one_engine_and_leaves_nothing(model_dir, tmp_path,
                                                              monkeypatch):
    """`--data-parallel-backend ray` with no RAY_ADDRESS: the front starts a local Ray on
    127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when the front imports Ray), one
    actor per replica starts its child; a killed child fails its stream and the other
    replica serves on; SIGTERM leaves no Ray process, actor or replica behind."""
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    server = start_server(model_dir, tmp_path / "dp.log", *DP_FLAGS,
                          "--data-parallel-backend", "ray")
    tree: dict[int, str] = {}
    try:
        expected = reference_answers(model_dir, 8)
        wait_ready(server)
        tree = _process_tree(server.proc.pid)
        for name in ("gcs_server", "raylet", "ReplicaActor", "dp_child"):
            assert any(name in args for args in tree.values()), (name, tree)
        reps = replicas(server)
        assert all(r["url"].startswith("http://127.0.0.1:") for r in reps), reps
        assert {r["pid"] for r in reps} <= set(tree)  # each child under its actor

        results = asyncio.run(_concurrently(server.v1, 8))
        assert [text for text, _ in results] == expected
        served = [engine for _, engine in results]
        m = samples(server)
        for e in ("0", "1"):  # both replicas served, as the router counted
            assert m[f'kiln:dp_requests_total{{engine="{e}"}}'] == served.count(e) > 0

        # A replica's child killed mid-stream: its stream fails, the other goes on.
        client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0,
                               timeout=30)
        streams = [client.completions.create(
            model=MODEL_NAME, prompt=f"Story {i}:", max_tokens=900, stream=True,
            temperature=0, extra_body={"ignore_eos": True}) for i in range(2)]
        engines = [s.response.headers["x-kiln-dp-engine"] for s in streams]
        assert sorted(engines) == ["0", "1"]
        iters = [iter(s) for s in streams]
        for it in iters:
            next(it)
        os.kill(reps[1]["pid"], signal.SIGKILL)
        for it, engine in zip(iters, engines):
            if engine == "1":
                with pytest.raises(openai.APIError, match="replica 1 died"):
                    for _ in it:
                        pass
            else:
                assert sum(1 for _, _ in zip(range(20), it)) == 20
        for s in streams:
            s.close()
        state = replicas(server)
        assert [r["alive"] for r in state] == [True, False]
        assert state[1]["exit_reason"] == "killed by SIGKILL"
        after = asyncio.run(_concurrently(server.v1, 4))
        assert {engine for _, engine in after} == {"0"} and all(t for t, _ in after)
    finally:
        stop_server(server)  # SIGTERM: the replicas stop, then the actors and the Ray
    assert server.proc.returncode == 0, server.log()[-3000:]
    assert "Started a local Ray instance" in server.log()
    assert_all_gone([server.proc.pid, *tree])


def test_the_ray_backend_without_ray_is_refused(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # find_spec: not installed
    argv = ["-dp", "2", "--data-parallel-backend", "ray"]
    with pytest.raises(ValueError, match=r"pip install 'kiln-llm\[ray\]'.*mp"):
        check_data_parallel(_args(*argv))
    assert main(["serve", *argv]) == 2
    assert "kiln: error:" in capsys.readouterr().err


def _args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("argv, words", [
    (["-dp", "0"], ["data_parallel_size=0", "-dp 1"]),
    (["-dp", "2", "--pd-proxy", "http://p", "http://d"], ["--pd-proxy", "-dp"]),
    (["-dp", "2", "--kv-transfer-config", '{"kv_connector": "torch_distributed"}'],
     ["torch_distributed", "without -dp"]),
])
def test_bad_data_parallel_settings_fail_at_start_up(argv, words, capsys):
    with pytest.raises(ValueError) as exc:
        check_data_parallel(_args(*argv))
    for w in words:
        assert w in str(exc.value)
    assert main(["serve", *argv]) == 2  # the CLI: one error line, no engine, no children
    assert "kiln: error:" in capsys.readouterr().err
    assert check_data_parallel(_args("-dp", "3")) == 3


def test_child_argv_drops_the_dp_flags():
    argv = ["serve", "m", "-dp", "2", "--port", "80", "--data-parallel-backend=mp",
            "--data-parallel-size=4", "-dp3", "-O0"]
    assert child_argv(argv, 1234) == ["serve", "m", "--port", "80", "-O0", "--host",
                                      "127.0.0.1", "--port", "1234",
                                      "--data-parallel-size", "1"]
    assert child_argv(argv, 1234, "10.0.0.7")[-6:-4] == ["--host", "10.0.0.7"]
    args = _args(*child_argv(argv, 1234)[1:])
    assert (args.port, args.host, args.data_parallel_size) == (1234, "127.0.0.1", 1)


def test_metrics_merge_labels_every_sample_once_per_family():
    a = ('# HELP x_total X.\n# TYPE x_total counter\nx_total 1.0\n'
         '# HELP h H.\n# TYPE h histogram\nh_bucket{le="1.0"} 2.0\nh_count 2.0\n'
         'h_sum 0.5\n# HELP y Y.\n# TYPE y gauge\ny{a="}} 1"} 3.0\nz{} 4.0\n')
    b = a.replace("1.0\n", "5.0\n")
    text = merge_expositions([(0, a), (1, b)])
    assert text.count("# TYPE h histogram") == 1 and text.count("# HELP x_total") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert [(s.labels, s.value) for s in families["x"].samples] == [
        ({"engine": "0"}, 1.0), ({"engine": "1"}, 5.0)]
    assert [s.labels for s in families["h"].samples if s.name == "h_bucket"] == [
        {"engine": "0", "le": "1.0"}, {"engine": "1", "le": "1.0"}]
    assert add_label('y{a="}} 1"} 3.0', 'engine="0"') == 'y{engine="0",a="}} 1"} 3.0'
    assert add_label("z{} 4.0", 'engine="1"') == 'z{engine="1"} 4.0'


def test_a_replica_that_cannot_start_fails_the_front(tmp_path):
    server = start_server(tmp_path / "no-such-model", tmp_path / "dp.log", "-dp", "2")
    try:
        assert server.proc.wait(timeout=120) == 1
        log = server.log()
        assert "during start-up" in log and "no-such-model" in log, log[-3000:]
        pids = [int(p) for p in re.findall(r"replica \d \(pid (\d+)\)", log)]
        assert len(set(pids)) == 2
        assert_all_gone(pids)
    finally:
        stop_server(server)
