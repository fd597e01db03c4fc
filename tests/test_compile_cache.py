"""The compile cache across real processes: cold saves, warm loads with zero Inductor
compilations (also after the directory moves), broken artifacts are repaired, keys follow
the configuration, and concurrent warmers leave one valid cache."""
from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import TINY

from kiln.compiler.build import compile_model
from kiln.compiler.cache import verify_artifact
from kiln.config.compilation import CompilationConfig
from kiln.models.loader import build_model
from kiln.models.model_config import ModelConfig

WORKER = Path(__file__).with_name("compile_worker.py")


def run_worker(model: Path, cache: Path) -> dict:
    res = subprocess.run([sys.executable, str(WORKER), str(model), str(cache)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def racers(tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    """Two processes warming one empty cache at once (the expensive part, shared by the
    tests): they exercise every lock and rename, and leave the cold cache the others
    copy and damage. One decoder layer: two unique pieces, so two artifacts (each
    compile is mostly a fixed g++ cost; a third piece cost the suite ~30 s)."""
    model, cache = tmp_path_factory.mktemp("llama1") / "model", tmp_path_factory.mktemp("cache")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        **{**TINY, "num_hidden_layers": 1})).float().save_pretrained(model)
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(model), str(cache)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return model, cache, results


@pytest.fixture(scope="module")
def cold(racers) -> tuple[Path, Path, dict]:
    """The racer that compiled (both may have, artifact by artifact)."""
    model, cache, results = racers
    first = max(results, key=lambda r: r["counters"]["num_inductor_compiles"])
    return model, cache, first


def _artifacts(result: dict) -> list[Path]:
    return sorted(Path(result["cache"], "artifacts").iterdir())


def test_cold_saves_and_warm_process_loads_without_compiling(racers, cold, tmp_path):
    model, cache, first = cold
    counters = [r["counters"] for r in racers[2]]
    # Every artifact was built by one racer or the other and saved by whoever built it;
    # each racer ends with both, built or loaded.
    assert sum(c["num_inductor_compiles"] for c in counters) >= 2, counters
    assert sum(c["num_compiled_artifacts_saved"] for c in counters) >= 2, counters
    assert all(c["num_inductor_compiles"] + c["num_compiled_artifacts_loaded"] >= 2
               for c in counters), counters
    assert first["compiler_calls"]  # the audit does see g++ when it runs
    assert all(verify_artifact(a) is None for a in _artifacts(first))
    assert (Path(first["cache"]) / "cache_key_factors.json").exists()
    # A copy at another path still loads warm: nothing in it is tied to its location.
    moved = tmp_path / "moved"
    shutil.copytree(cache, moved)
    warm = run_worker(model, moved)
    w = warm["counters"]
    assert w["num_inductor_compiles"] == 0 and w["num_compiled_artifacts_loaded"] == 2
    assert warm["compiler_calls"] == []  # the .so files travel with the artifacts
    if platform.machine() in ("x86_64", "AMD64"):
        # Inductor's vector-ISA checks (a build and a child Python each) are answered from
        # the machine's record, which the racers' probe wrote (kiln/compiler/vec_isa.py).
        assert warm["child_pythons"] == []
    # No Dynamo either: the split graph is rebuilt from the cache's graph record.
    assert w["num_graphs_seen"] == 0 and w["num_graphs_loaded"] == 1
    assert w["num_cache_repairs"] == 0
    assert warm["tokens"] == first["tokens"]


def test_corrupt_graph_record_falls_back_to_tracing(cold, tmp_path):
    """A corrupt graph record means tracing again; the intact artifact still loads and
    the deleted one is rebuilt (the third way of breaking an artifact)."""
    model, cache, first = cold
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    entry = Path(copy, Path(first["cache"]).name)
    record = entry / "graph.pkl"
    record.write_bytes(record.read_bytes()[:-40] + b"x" * 40)
    deleted = sorted((entry / "artifacts").iterdir())[0]
    _damage(_largest_file(deleted), "delete")
    again = run_worker(model, copy)
    c = again["counters"]
    assert c["num_graphs_seen"] == 1 and c["num_graphs_loaded"] == 0
    assert c["num_inductor_compiles"] == 1 and c["num_compiled_artifacts_loaded"] == 1
    assert c["num_cache_repairs"] == 2
    assert again["tokens"] == first["tokens"]
    assert verify_artifact(deleted) is None


def _largest_file(artifact: Path) -> Path:
    return max((p for p in artifact.rglob("*") if p.is_file() and p.suffix != ".json"),
               key=lambda p: p.stat().st_size)


def _damage(victim: Path, how: str) -> None:
    data = victim.read_bytes()
    if how == "corrupt":
        victim.write_bytes(data[:100] + bytes(b ^ 0xFF for b in data[100:200]) + data[200:])
    elif how == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    else:
        victim.unlink()


def test_broken_artifacts_are_detected_and_repaired(cold, tmp_path):
    """Both artifacts broken a different way (corrupt, truncated), repaired in one
    process (each repair run costs a process start and Inductor compiles)."""
    model, cache, first = cold
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    victims = sorted(Path(copy, Path(first["cache"]).name, "artifacts").iterdir())
    assert len(victims) == 2
    for victim_dir, how in zip(victims, ["corrupt", "truncate"]):
        _damage(_largest_file(victim_dir), how)
        assert verify_artifact(victim_dir) is not None, how
    repaired = run_worker(model, copy)
    c = repaired["counters"]
    assert c["num_cache_repairs"] == 2 and c["num_inductor_compiles"] == 2
    # The graph record's load stops at the first broken artifact; the traced path then
    # finds the other broken as well and rebuilds both.
    assert c["num_graphs_seen"] == 1
    assert repaired["tokens"] == first["tokens"]
    assert all(verify_artifact(v) is None for v in victims)  # rebuilt in place


def test_concurrent_processes_warm_one_empty_cache(racers):
    results = racers[2]
    assert len({json.dumps(r["tokens"]) for r in results}) == 1
    artifacts = _artifacts(results[0])
    assert len(artifacts) == 2 and all(verify_artifact(a) is None for a in artifacts)
    assert not [p for p in artifacts[0].parent.iterdir() if p.name.startswith(".")]


def test_key_follows_dtype_and_compilation_fields(tiny_models, tmp_path):
    path = tiny_models["llama"][0]
    cfg = ModelConfig.from_pretrained(path)

    def key(dtype=torch.float32, **fields) -> str:
        model = build_model(cfg, dtype, torch.device("cpu"), progress=False)
        settings = {"mode": 1, "splitting_ops": ["kiln::unified_attention"],
                    "compile_sizes": [], "compile_ranges_endpoints": [],
                    "cache_dir": str(tmp_path), **fields}
        cc = CompilationConfig(**settings)
        _, backend = compile_model(model, cc, dtype, torch.device("cpu"), 64, progress=False)
        return backend.cache.key

    base = key()
    assert key() == base
    # Nothing location-bound in the key: another checkout or venv computes the same one.
    factors = (tmp_path / base / "cache_key_factors.json").read_text()
    assert sys.prefix not in factors and str(Path(__file__).parents[1]) not in factors
    assert key(torch.bfloat16) != base
    assert key(compile_sizes=[4]) != base
    assert key(compile_ranges_endpoints=[8]) != base
    assert key(inductor_options={"max_autotune": True}) != base


def test_the_compiler_key_is_the_same_in_and_out_of_ci(monkeypatch):
    """torch reads CI=true (which CI services set) into a check's raise-or-warn setting;
    a cache warmed in CI must load outside it."""
    from torch._functorch import config as functorch_config

    from kiln.compiler.adaptors import InductorAdaptor

    keys = set()
    for in_ci in (True, False):
        monkeypatch.setattr(functorch_config, "error_on_custom_op_aliasing", in_ci)
        keys.add(InductorAdaptor({}).compute_hash())
    assert len(keys) == 1
