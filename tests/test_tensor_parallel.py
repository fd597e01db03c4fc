"""Tensor parallelism on gloo: tp=2 (and tp=3) against tp=1 and transformers,
through the `mp` executor and through `torchrun` (`external_launcher`), plus start-up
checks and a warm start per rank.

Cost: every tp=2 engine is real worker processes; the one cold compile (Qwen3 at -O2,
both ranks in parallel) is paid once, by the `mp` case, and the torchrun launch then
loads those same per-rank entries (the warm-start check)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import TINY, hf_greedy
from server_utils import free_port

from kiln import LLM, SamplingParams

HERE = Path(__file__).parent
WORKER = HERE / "tp_worker.py"
sys.path.insert(0, str(HERE))
from tp_worker import PROMPTS  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, transformers.PreTrainedModel]]:
    """Tiny Llama (4 heads, 2 KV heads), tiny Qwen3 with ONE KV head (at tp=2 its KV
    head is replicated on both ranks) and a tiny Llama with SmolLM2's 9 heads and 3 KV
    heads (tp=3)."""
    root = tmp_path_factory.mktemp("tp")
    configs = {"llama": transformers.LlamaConfig(**TINY, tie_word_embeddings=False),
               "qwen3": transformers.Qwen3Config(**{**TINY, "num_key_value_heads": 1},
                                                 head_dim=32),
               "llama9": transformers.LlamaConfig(**{**TINY, "hidden_size": 144,
                                                     "num_attention_heads": 9,
                                                     "num_key_value_heads": 3,
                                                     "intermediate_size": 192})}
    out = {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    return out


def reference(model: transformers.PreTrainedModel) -> list[list[int]]:
    return [hf_greedy(model, p, 12) for p in PROMPTS]


def run_cases(cases: list[dict], torchrun: int = 0, timeout: float = 400) -> list[dict]:
    cmd = [sys.executable, str(WORKER), json.dumps(cases)]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(torchrun), "--master-port", str(free_port()), *cmd[1:]]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                         env=os.environ.copy())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


def test_mp_tp2_qwen3_matches_transformers_at_o0_and_o2(models, tmp_path):
    """`mp`: this test's subprocess is the engine, two workers hold the shards. Each
    executor runs both models (Llama under mp at -O0: the hung-worker test, with this
    process as the engine); Qwen3 (qk-norm, a replicated KV head) is the -O2 case for
    both, as one cold tp=2 compile costs about 45 s here. The -O0 case runs a LoRA
    adapter on all but the first prompt: each rank holds its slices of A and B (the
    replicated KV head's B whole), and the row-parallel layers add theirs before the
    all-reduce; it equals transformers + peft. That case spawns its workers as fresh
    interpreters (KILN_WORKER_FORK=0), and so does the next, the process's first with
    forking on; a third engine would fork them (test_pipeline_parallel checks that)."""
    from lora_utils import ALL, make_adapter

    adapter = make_adapter(models["qwen3"][1], tmp_path / "a", 4, ALL, seed=1)
    cases = [{"model": str(models["qwen3"][0]), "level": 0, "tp": 2,
              "lora": str(tmp_path / "a"), "env": {"KILN_WORKER_FORK": "0"}},
             {"model": str(models["qwen3"][0]), "level": 2, "tp": 2}]
    results = run_cases(cases)
    base = reference(models["qwen3"][1])
    assert results[0]["tokens"] == base[:1] + [hf_greedy(adapter, p, 12)
                                               for p in PROMPTS[1:]]
    assert results[0]["tokens"][1:] != base[1:]
    assert results[1]["tokens"] == base
    assert all(len(r["counters"]) == 2 for r in results)  # one report per rank


def test_warmup_tp2_reports_every_rank(models):
    """`kiln warmup -tp 2` builds (or loads) every rank's entry and reports each rank;
    after the mp test both ranks load theirs."""
    res = subprocess.run([sys.executable, "-m", "kiln.cli.main", "warmup", "--model",
                          str(models["qwen3"][0]), "-O2", "--dtype", "float32", "-tp", "2",
                          "--num-kv-blocks", "64", "--max-model-len", "128"],
                         capture_output=True, text=True, timeout=400, env=os.environ.copy())
    assert res.returncode == 0, res.stderr[-3000:]
    assert " rank 0 of 2" in res.stdout and " rank 1 of 2" in res.stdout, res.stdout
    caches = [line.split()[1] for line in res.stdout.splitlines()
              if line.strip().startswith("cache ")]
    assert len(set(caches)) == 2  # one entry per rank
    assert res.stdout.count("builds") == 2


def test_torchrun_tp2_matches_transformers_and_starts_warm(models):
    """`external_launcher` under torchrun. The Qwen3 -O2 entries the mp test compiled
    are loaded on both ranks with no Inductor compile: cache keys are per rank and the
    same under either executor. (Run alone, the first -O2 engine compiles them and the
    second is the warm one.)"""
    qwen3 = str(models["qwen3"][0])
    cases = [{"model": str(models["llama"][0]), "level": 0, "tp": 2},
             {"model": qwen3, "level": 2, "tp": 2}, {"model": qwen3, "level": 2, "tp": 2}]
    for case in cases:
        case["backend"] = "external_launcher"
    results = run_cases(cases, torchrun=2)
    for case, result in zip(cases, results):
        assert result["tokens"] == reference(models[Path(case["model"]).name][1]), case
    warm = results[2]["counters"]
    assert [c["num_inductor_compiles"] for c in warm] == [0, 0]
    assert [c["num_compiled_artifacts_loaded"] for c in warm] == [1, 1]


def test_tp3_splits_smollm2s_head_layout_like_transformers(models):
    """9 query heads and 3 KV heads, as SmolLM2 has: two ranks cannot split them, three
    can (one thread each on this host). -O0: the sharding is what is under test, not the
    compiler. A tiny model of that layout keeps the suite's budget (SmolLM2 itself at
    tp=3 took 27 s)."""
    path, model = models["llama9"]
    llm = LLM(str(path), dtype="float32", optimization_level=0, progress=False,
              tensor_parallel_size=3, max_model_len=128, num_kv_blocks=32)
    try:
        out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in out] == reference(model)


@pytest.mark.parametrize("kwargs, field", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not split"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "'uni'"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="slurm"),
     "distributed_executor_backend='slurm'"),
    (dict(tensor_parallel_size=10_000), "exceeds what this host allows"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="external_launcher"),
     "torchrun"),
])
def test_bad_parallel_config_is_a_startup_value_error(models, kwargs, field, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=field):
        LLM(str(models["llama"][0]), dtype="float32", optimization_level=0, progress=False,
            num_kv_blocks=16, **kwargs)


def _children(pid: int) -> list[int]:
    """Live descendants of `pid` (from /proc: no psutil here)."""
    parents = _parents()
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        frontier += kids
    return out


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":  # zombies are dead, just not reaped yet
                parents[int(entry.name)] = int(fields[1])
    return parents


def _workers(pid: int) -> list[int]:
    """The `mp` workers among `pid`'s descendants: spawned as
    `kiln.executor.multiproc_worker`, or forked by a zygote (whose command line they
    share; a process's later engines, kiln.executor.zygote)."""
    parents = _parents()
    family = _children(pid)
    zygotes = [p for p in family if "kiln.executor.zygote" in _cmdline(p)]
    return [p for p in family if "-m kiln.executor.multiproc_worker" in _cmdline(p)] + \
        [p for p in zygotes if parents.get(p) in zygotes]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.slow
def test_serve_tp2_answers_openai_and_dies_cleanly_when_a_worker_is_killed(
        tmp_path, smollm2_dir):
    """`kiln serve -tp 2` answers the real client like a tp=1 engine; killing worker
    rank 1 mid-stream fails the stream with an error naming the rank, /health turns 503,
    the server exits non-zero within 30 s and leaves no process behind."""
    import time

    import httpx
    import openai
    from server_utils import (API_KEY, ENGINE_KWARGS, MODEL_NAME, make_tiny_chat_model,
                              start_server, stop_server, wait_ready)

    model_dir = make_tiny_chat_model(tmp_path / "model", smollm2_dir)
    server = start_server(model_dir, tmp_path / "server.log", "-tp", "2")
    try:
        ref = LLM(str(model_dir), progress=False, **ENGINE_KWARGS)
        expected = ref.generate("The capital of France is",
                                SamplingParams(temperature=0, max_tokens=12),
                                use_tqdm=False)[0].outputs[0].text
        wait_ready(server)
        client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0,
                               timeout=60)
        res = client.completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                        max_tokens=12, temperature=0)
        assert res.choices[0].text == expected
        workers = _workers(server.proc.pid)
        assert len(workers) == 2, [_cmdline(p) for p in _children(server.proc.pid)]
        family = _children(server.proc.pid)
        stream = client.completions.create(model=MODEL_NAME, prompt="Once upon a time",
                                           max_tokens=None, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        os.kill(workers[1], 9)
        killed = time.monotonic()
        with pytest.raises(openai.APIError, match="rank 1"):
            for _ in stream:
                pass
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        assert health.status_code == 503
        server.proc.wait(timeout=30)
        assert time.monotonic() - killed < 30
        assert server.proc.returncode != 0
        time.sleep(0.5)  # let init reap what the server's exit orphaned
        left = [_cmdline(p) for p in family if "kiln" in _cmdline(p)]
        assert left == [], left
    finally:
        if server.proc.poll() is None:
            stop_server(server)


def test_startup_bound_is_never_shorter_than_the_default(monkeypatch):
    from kiln.distributed.parallel_state import startup_timeout_s

    monkeypatch.setenv("KILN_DIST_TIMEOUT_S", "5")
    assert startup_timeout_s() == 600
    monkeypatch.setenv("KILN_DIST_TIMEOUT_S", "900")
    assert startup_timeout_s() == 900
    monkeypatch.setenv("KILN_DIST_STARTUP_TIMEOUT_S", "30")
    assert startup_timeout_s() == 30


def test_hung_worker_times_out_instead_of_hanging(models, monkeypatch):
    """Llama at tp=2 through `mp` with this process as the engine matches transformers;
    then a worker that stops answering (SIGSTOP) fails the step within the step bound
    (KILN_DIST_TIMEOUT_S, 5 s here) with WorkerDiedError, and dropping the `LLM` leaves
    no worker. Start-up keeps its own bound (600 s): 5 s had failed the gloo connect
    itself on a loaded host."""
    import gc
    import signal
    import time

    from kiln.executor.multiproc import WorkerDiedError

    monkeypatch.setenv("KILN_DIST_TIMEOUT_S", "5")
    llm = LLM(str(models["llama"][0]), dtype="float32", optimization_level=0,
              progress=False, num_kv_blocks=32, tensor_parallel_size=2)
    try:  # a failure must not leave the engine in this process's distributed world
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference(models["llama"][1])
        workers = _workers(os.getpid())
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker rank|timed out"):
            llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4),
                         use_tqdm=False)
        assert time.monotonic() - start < 30
    except BaseException:
        llm.shutdown()
        raise
    del llm  # garbage collection alone must stop the workers
    gc.collect()
    time.sleep(0.5)
    assert [p for p in workers if "kiln" in _cmdline(p)] == []
