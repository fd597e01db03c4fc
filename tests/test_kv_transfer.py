"""KV connectors: the disk tier (restarts, corruption, concurrency, budget) and P/D
disaggregation over torch.distributed, all against plain decoding (float32, greedy)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy, random_prompts
from kiln import LLM, SamplingParams
from kiln.compiler.counter import compilation_counter
from kiln.entrypoints.openai.metrics import ServerMetrics
from kiln.kv_cache.block_hash import hash_block
from kiln.kv_transfer.disk import SUFFIX, DiskBlockStore
from kiln.kv_transfer.layout import make_layout
from server_utils import free_port

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SHARED = random_prompts(1, [70], seed=11)[0]  # four full blocks and a bit
PROMPTS = [SHARED + tail for tail in random_prompts(3, [5, 19, 33], seed=12)] \
    + random_prompts(1, [90], seed=13)
HERE = Path(__file__).parent


def _disk(path: Path, **extra) -> dict:
    return {"kv_connector": "disk", "kv_role": "kv_both",
            "kv_connector_extra_config": {"path": str(path), **extra}}


def _llm(path: Path, level: int = 0, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", progress=False, optimization_level=level,
               max_model_len=128, **kwargs)


def _tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.flush_kv_saves()
    return [o.outputs[0].token_ids for o in outs]


def _blocks(tier: Path) -> list[Path]:
    return sorted(tier.rglob(f"*{SUFFIX}"))


@pytest.fixture(scope="module")
def tiny(tiny_models):
    path, model = tiny_models["llama"]
    return path, [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]


# ---- configuration --------------------------------------------------------------------------
@pytest.mark.parametrize("config,field", [
    ({"kv_connector": "nfs"}, "kv_connector"),
    ({"kv_connector": "disk", "kv_role": "both", "kv_connector_extra_config":
      {"path": "/tmp/x"}}, "kv_role"),
    ({"kv_connector": "disk"}, "path"),
    ({"kv_connector": "disk", "kv_connector_extra_config": {"path": "/tmp/x", "size": 1}},
     "unknown field"),
    ({"kv_connector": "disk", "kv_connector_extra_config": {"path": "/tmp/x",
                                                            "max_size": "lots"}}, "max_size"),
    ({"kv_connector": "torch_distributed"}, "kv_both"),
    ({"kv_connector": "disk", "kv_port": 0, "kv_connector_extra_config": {"path": "/x"}},
     "kv_port"),
    ('{"kv_connector": ', "JSON"),
    ({"connector": "disk"}, "unknown field"),
])
def test_bad_kv_transfer_config_is_a_start_up_error_naming_the_field(config, field):
    from kiln.config.engine import EngineConfig

    with pytest.raises(ValueError, match=field):
        EngineConfig(kv_transfer_config=config)


def test_kv_transfer_refuses_tensor_parallelism_and_bad_request_params(tiny, tmp_path):
    from kiln.config.engine import EngineConfig

    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineConfig(kv_transfer_config=_disk(tmp_path), tensor_parallel_size=2)
    llm = _llm(tiny[0], kv_transfer_config=_disk(tmp_path))
    for bad, match in (({"do_remote_prefil": True}, "unknown key"),
                       ({"do_remote_prefill": "yes"}, "true or false"), ([1], "dict")):
        with pytest.raises(ValueError, match=match):
            llm.engine.add_request("x", {"prompt_token_ids": [1, 2]}, GREEDY,
                                   kv_transfer_params=bad)
    assert not llm.engine.has_unfinished_requests()


# ---- the disk tier ---------------------------------------------------------------------------
def test_disk_tier_survives_a_restart_with_chunking_and_preemption(tiny, tmp_path):
    path, refs = tiny
    # 14 usable blocks for four requests of up to 102 tokens: preemption; a 48-token
    # budget chunks every prompt; prefix caching stays on (local hits come first).
    kwargs = dict(num_kv_blocks=15, max_num_batched_tokens=48,
                  kv_transfer_config=_disk(tmp_path))
    first = _llm(path, **kwargs)
    assert _tokens(first) == refs
    saved = first.engine.get_stats().kv_transfer
    assert saved.blocks_saved == len(_blocks(tmp_path)) > 0
    assert first.engine.get_stats().num_preemptions > 0
    first.shutdown()

    again = _llm(path, **kwargs)  # a fresh engine: an empty prefix cache, a warm tier
    assert _tokens(again) == refs
    stats = again.engine.get_stats()
    kt = stats.kv_transfer
    assert kt.blocks_loaded > 0 and kt.hit_tokens == 16 * kt.blocks_loaded
    assert 0 < kt.hit_rate <= 1 and kt.load_failures == 0
    assert kt.bytes_loaded == kt.blocks_loaded * 2 * 2 * 16 * 2 * 16 * 4  # layers, K/V, ...
    pool = again.engine.scheduler.kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1  # nothing leaked
    text = ServerMetrics(again.engine.get_stats).render().decode()
    assert f"kiln:kv_transfer_blocks_loaded_total {kt.blocks_loaded}.0" in text
    assert "kiln:kv_transfer_hit_rate" in text


def test_disk_tier_at_o2_matches_plain_and_compiles_nothing_while_serving(tiny, tmp_path):
    path, refs = tiny
    # Preemption (15 blocks) and chunked prefill (32 tokens per request-step) in play;
    # the token budget stays the default, so the compiled ranges are the usual ones.
    kwargs = dict(num_kv_blocks=15, long_prefill_token_threshold=32,
                  kv_transfer_config=_disk(tmp_path))
    writer = _llm(path, 2, **kwargs)
    assert _tokens(writer) == refs
    assert writer.engine.get_stats().num_preemptions > 0  # its saves survived preemption
    writer.shutdown()
    reader = _llm(path, 2, **kwargs)
    before = compilation_counter.clone()
    assert _tokens(reader) == refs
    assert not any(compilation_counter.delta(before).values())
    assert reader.engine.get_stats().kv_transfer.blocks_loaded > 0


def test_corrupt_and_truncated_blocks_are_misses_recomputed_and_rewritten(tiny, tmp_path):
    path, refs = tiny
    first = _llm(path, kv_transfer_config=_disk(tmp_path))
    assert _tokens(first) == refs
    store = DiskBlockStore(tmp_path, _layout_of(first), 1 << 30, False)
    first.shutdown()
    # Between runs: the first block of the shared prefix and of the unrelated prompt
    # (both are read next run) lose one payload byte and their last 7 bytes.
    corrupt, truncated = (store.path_of(hash_block(None, p[:16])) for p in (SHARED,
                                                                          PROMPTS[3]))
    data = bytearray(corrupt.read_bytes())
    data[-100] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-7])
    # Prefix caching off: every prompt looks its blocks up in the tier each time.
    llm = _llm(path, kv_transfer_config=_disk(tmp_path), enable_prefix_caching=False)
    assert _tokens(llm) == refs
    kt = llm.engine.get_stats().kv_transfer
    assert kt.load_failures >= 2
    assert all(store.get(bytes.fromhex(f.name[: -len(SUFFIX)])) is not None
               for f in _blocks(tmp_path))
    before = kt.load_failures
    assert _tokens(llm) == refs  # the recomputed blocks were saved again, whole
    assert llm.engine.get_stats().kv_transfer.load_failures == before


def _layout_of(llm: LLM):
    return llm.engine.kv_connector.layout


def _store(tmp_path: Path, max_size: int, blocks: int = 4096) -> DiskBlockStore:
    layout = make_layout({"model": "test"}, num_layers=2, block_size=16, num_kv_heads=2,
                         head_size=blocks // 128, dtype=torch.float32, quantization=None)
    return DiskBlockStore(tmp_path, layout, max_size, writer=True)


def test_size_budget_holds_and_evicts_least_recently_used(tmp_path):
    store = _store(tmp_path, max_size=10 * (4096 * 4 + 64))
    nbytes = store.layout.block_bytes
    hashes = [i.to_bytes(16, "little") for i in range(40)]
    for start in range(0, 40, 4):
        batch = hashes[start:start + 4]
        store.put(batch, torch.randint(0, 255, (4, nbytes), dtype=torch.uint8))
        store.flush()
        assert sum(f.stat().st_size for f in _blocks(tmp_path)) <= store.max_size
        if start == 4:
            time.sleep(0.02)
            assert store.get(hashes[0]) is not None  # a hit: hashes[0] is fresh again
    kept = {bytes.fromhex(f.name[: -len(SUFFIX)]) for f in _blocks(tmp_path)}
    assert hashes[0] not in kept or hashes[1] not in kept  # evicted in LRU order...
    assert set(hashes[-4:]) <= kept  # ...the newest always stay
    assert store.take_stats()["blocks_evicted"] == 40 - len(kept)


def test_a_writer_killed_mid_save_leaves_no_partial_block(tmp_path):
    code = (f"import sys, torch; sys.path.insert(0, {str(HERE)!r})\n"
            "from test_kv_transfer import _store\n"
            f"s = _store(__import__('pathlib').Path({str(tmp_path)!r}), 1 << 40, 1 << 20)\n"
            "i = 0\n"
            "while True:\n"
            "    s.put([i.to_bytes(16, 'little')], torch.ones(1, s.layout.block_bytes,"
            " dtype=torch.uint8)); s.flush(); i += 1\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while len(_blocks(tmp_path)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    store = _store(tmp_path, 1 << 40, 1 << 20)
    files = _blocks(tmp_path)
    assert len(files) >= 3
    for f in files:  # every visible block is whole and verifies
        assert store.get(bytes.fromhex(f.name[: -len(SUFFIX)])) is not None
    assert store.take_stats().get("load_failures", 0) == 0
    for tmp in tmp_path.rglob("*.tmp.*"):  # a dead writer's temporary file: swept
        os.utime(tmp, (0, 0))
    store._evict(0)
    assert not list(tmp_path.rglob("*.tmp.*"))


def test_two_processes_save_and_load_one_prefix_concurrently(tiny, tmp_path):
    path, refs = tiny
    prompts = json.dumps(PROMPTS[:3])
    cmd = [sys.executable, str(HERE / "kv_tier_worker.py"), str(path), str(tmp_path),
           prompts, str(GREEDY.max_tokens)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    results = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1])
               for p in procs]
    assert all(p.returncode == 0 for p in procs)
    for r in results:
        assert r["tokens"] == refs[:3] and r["stats"]["load_failures"] == 0
    third = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True,
                                      timeout=300).stdout.strip().splitlines()[-1])
    assert third["tokens"] == refs[:3]
    # Every full block before each prompt's last token came from the tier, or from the
    # prefix cache once the first request brought the shared prefix in.
    assert third["stats"]["hit_tokens"] >= 16 * 4
    assert third["stats"]["hit_tokens"] + third["prefix_cache_hits"] == 16 * (4 + 5 + 6)


# ---- prefill/decode disaggregation ----------------------------------------------------------
def _pd(role: str, port: int, **extra) -> dict:
    return {"kv_connector": "torch_distributed", "kv_role": role, "kv_port": port,
            "kv_connector_extra_config": extra}


def decode_outputs(llm: LLM, prompts, params, remote: bool, loras=None) -> list:
    """Each prompt's finished completion, its KV loaded from the producer if `remote`;
    `params` and `loras` one for all or one per prompt."""
    eng = llm.engine
    per = [params] * len(prompts) if isinstance(params, SamplingParams) else params
    for i, (p, sp) in enumerate(zip(prompts, per)):
        eng.add_request(f"d{i}", {"prompt_token_ids": p}, sp,
                        lora_request=loras[i] if loras else None,
                        kv_transfer_params={"do_remote_prefill": True} if remote else None)
    done: dict[str, object] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[f"d{i}"] for i in range(len(prompts))]


def _decode(llm: LLM, prompts, params, remote: bool) -> list[list[int]]:
    return [o.token_ids for o in decode_outputs(llm, prompts, params, remote)]


def test_torch_distributed_pd_equals_one_instance(tiny):
    path, refs = tiny
    port = free_port()
    prefill = _llm(path, kv_transfer_config=_pd("kv_producer", port))
    # The decode instance at -O2 (the graph the disk-tier test at -O2 compiled): loaded
    # blocks feed compiled steps.
    decode = _llm(path, 2, kv_transfer_config=_pd("kv_consumer", port, remote_timeout_s=60))
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    assert [t[:1] for t in _tokens(prefill, params=one)] == [r[:1] for r in refs]
    assert _decode(decode, PROMPTS, GREEDY, remote=True) == refs
    stats = decode.engine.get_stats()
    kt = stats.kv_transfer
    full = sum((len(p) - 1) // 16 for p in PROMPTS)
    # Every full prompt block was received (or hit locally once the first one came).
    assert kt.hit_tokens + stats.prefix_cache_hits == 16 * full
    assert kt.hit_tokens >= 16 * 4 and kt.remote_waits == len(PROMPTS)
    assert kt.remote_timeouts == 0
    prefill.engine.flush_kv_saves()  # sends queued until the consumer joined are counted
    sent = prefill.engine.get_stats().kv_transfer
    assert sent.blocks_saved >= kt.blocks_loaded and sent.save_failures == 0
    # A later request with the same prefix is sent again (the consumer may have evicted
    # it): the decode instance never waits for blocks that will not come.
    before = sent.blocks_saved
    _tokens(prefill, PROMPTS[:1], one)
    assert prefill.engine.get_stats().kv_transfer.blocks_saved == before + 4


def test_a_producer_whose_port_is_taken_fails_at_start_up(tiny):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match="kv_port"):
            _llm(tiny[0], kv_transfer_config=_pd("kv_producer", port))


def test_a_consumer_whose_producer_never_comes_computes_the_prompt(tiny):
    path, refs = tiny
    decode = _llm(path, kv_transfer_config=_pd("kv_consumer", free_port(),
                                               remote_timeout_s=0.3))
    start = time.monotonic()
    # Two prompts without a common prefix: of two that share one, the second to give up
    # waiting may find the shared blocks computed here by the first and need nothing
    # remote (seen once: one timeout counted, not two).
    assert _decode(decode, PROMPTS[::3], GREEDY, remote=True) == refs[::3]
    kt = decode.engine.get_stats().kv_transfer
    assert kt.remote_timeouts == 2 and kt.hit_tokens == 0
    assert time.monotonic() - start < 30
    decode.shutdown()  # stops its link's connection attempts


def test_disk_pd_producer_publishes_and_consumer_loads(tiny, tmp_path):
    path, refs = tiny
    prefill = _llm(path, kv_transfer_config={**_disk(tmp_path), "kv_role": "kv_producer"})
    decode = _llm(path, kv_transfer_config={**_disk(tmp_path), "kv_role": "kv_consumer"})
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    _tokens(prefill, params=one)
    published = _blocks(tmp_path)
    assert _decode(decode, PROMPTS, GREEDY, remote=True) == refs
    kt = decode.engine.get_stats().kv_transfer
    assert kt.blocks_loaded > 0 and kt.remote_waits == len(PROMPTS)
    assert _blocks(tmp_path) == published  # a consumer never writes
    # The producer's own prefix-cache hits are published too (a consumer may lack them).
    assert prefill.engine.get_stats().kv_transfer.lookups == 0
