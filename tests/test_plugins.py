"""Plugins through real entry points: the example package (examples/kiln-example-plugin) is
pip-installed into a folder that only these tests' subprocesses see (PYTHONPATH), so the
rest of the suite never runs with it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from server_utils import API_KEY, make_tiny_chat_model, start_server, stop_server, wait_ready

from kiln import ModelRegistry
from kiln.models.llama import LlamaForCausalLM
from kiln.platforms.cuda import CudaPlatform

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("plugin_worker.py")


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    """The example package, installed with pip into its own folder (built from a copy, so
    the checkout gets no build/ or egg-info)."""
    root = tmp_path_factory.mktemp("plugin")
    src = shutil.copytree(ROOT / "examples" / "kiln-example-plugin", root / "src")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(root / "site"), str(src)],
                   check=True, capture_output=True)
    return root / "site"


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """A tiny Llama under the plugin's architecture name, and the same as plain Llama."""
    root = tmp_path_factory.mktemp("plugin-models")
    plain = make_tiny_chat_model(root / "plain", smollm2_dir)
    example = shutil.copytree(plain, root / "example")
    config = json.loads((example / "config.json").read_text())
    config["architectures"] = ["ExampleLlamaForCausalLM"]
    (example / "config.json").write_text(json.dumps(config))
    return {"plain": plain, "example": example}


def run_worker(plugin_path: Path, model: Path, tp: int, *extra: str,
               **env: str) -> tuple[dict, str]:
    environ = {**os.environ, "PYTHONPATH": f"{plugin_path}{os.pathsep}{ROOT / 'tests'}",
               **env}
    res = subprocess.run([sys.executable, str(WORKER), str(model), str(tp), *extra],
                         capture_output=True, text=True, env=environ, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), res.stderr


def hf_greedy(model: Path, prompts: list[list[int]], n: int = 8) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False)
        outs.append(ids[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("tp", [1, 2])
def test_a_plugin_model_loads_in_every_process_and_matches_transformers(
        plugin_path, models, tmp_path, tp):
    from plugin_worker import PROMPTS

    log = tmp_path / "loads.txt"
    extra = ("example_io",) if tp == 1 else ()
    env = {"KILN_EXAMPLE_PLUGIN_LOG": str(log)}
    if tp == 1:
        env["KILN_EXAMPLE_PLATFORM"] = "1"  # the platform plugin's "hardware is present"
    result, _ = run_worker(plugin_path, models["example"], tp, *extra, **env)
    assert result["tokens"] == hf_greedy(models["example"], PROMPTS)
    # The engine, and with tp=2 each of the two worker processes, ran the plugin once.
    pids = log.read_text().split()
    assert len(pids) == len(set(pids)) == (1 if tp == 1 else 3)
    # The stat logger saw every generated and every prompt token.
    assert result["stat_loggers"] == ["ExampleStatLogger"]
    assert result["stat_generation_tokens"] == sum(len(t) for t in result["tokens"])
    assert result["stat_prompt_tokens"] == sum(len(p) for p in PROMPTS)
    if tp == 1:
        assert result["platform"] == "ExamplePlatform" and result["configs_checked"] >= 1
        assert result["prefix_caching"] is False  # its check_and_update_config ran
        assert result["process"]["continuations"] == result["direct"]
        assert result["process"]["num_tokens"] == 6
        assert "data.words must be a non-empty list" in result["bad_input"]
    else:
        assert result["platform"] == "CpuPlatform" and result["prefix_caching"] is True


def test_a_broken_plugin_is_logged_and_kiln_plugins_filters(plugin_path, models, tmp_path):
    log = tmp_path / "loads.txt"
    result, stderr = run_worker(plugin_path, models["plain"], 1, KILN_EXAMPLE_PLUGIN_FAIL="1",
                                KILN_EXAMPLE_PLUGIN_LOG=str(log))
    assert "Failed to load plugin 'example'" in stderr
    assert "RuntimeError: the example plugin was asked to fail" in stderr  # the traceback
    assert result["tokens"] and not log.exists()  # start-up went on
    # Only the stat logger is allowed: the model plugin never loads, so its architecture
    # is unknown, with the supported ones listed.
    result, _ = run_worker(plugin_path, models["plain"], 1, KILN_PLUGINS="example_stats",
                           KILN_EXAMPLE_PLUGIN_LOG=str(log))
    assert result["stat_loggers"] == ["ExampleStatLogger"] and not log.exists()
    res = subprocess.run(
        [sys.executable, str(WORKER), str(models["example"]), "1"], capture_output=True,
        text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(plugin_path),
                                     "KILN_PLUGINS": "example_stats"})
    assert res.returncode != 0
    assert "architecture 'ExampleLlamaForCausalLM' is not supported" in res.stderr
    assert "LlamaForCausalLM" in res.stderr


def test_two_active_platform_plugins_are_refused(plugin_path, tmp_path):
    other = tmp_path / "other"
    (other / "other_platform-0.1.dist-info").mkdir(parents=True)
    (other / "other_platform-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: other-platform\nVersion: 0.1\n")
    (other / "other_platform-0.1.dist-info" / "entry_points.txt").write_text(
        "[kiln.platform_plugins]\nother = other_platform:detect\n")
    (other / "other_platform.py").write_text(
        "def detect():\n    return 'kiln.platforms.cpu:CpuPlatform'\n")
    code = "from kiln.platforms import current_platform; print(current_platform)"
    env = {**os.environ, "PYTHONPATH": f"{plugin_path}{os.pathsep}{other}"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, "KILN_EXAMPLE_PLATFORM": "1"})
    assert res.returncode != 0
    assert "two platform plugins are active: 'example_platform'" in res.stderr
    assert "'other' (kiln.platforms.cpu:CpuPlatform)" in res.stderr
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.stdout.strip() == "CpuPlatform()"  # the example's hardware is absent


def test_endpoint_plugins_are_opt_in(plugin_path, models, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(plugin_path))
    stats = tmp_path / "stats.txt"
    monkeypatch.setenv("KILN_EXAMPLE_STATS_FILE", str(stats))
    servers = {flag: start_server(models["plain"], tmp_path / f"{flag}.log", *extra)
               for flag, extra in (("on", ("--endpoint-plugins", "example_routes",
                                           "--io-processor-plugin", "example_io")),
                                   ("off", ()))}
    try:
        for server in servers.values():
            wait_ready(server)
        auth = {"Authorization": f"Bearer {API_KEY}"}
        on, off = (f"{servers[k].base_url}" for k in ("on", "off"))
        r = httpx.get(f"{on}/example/hello", headers=auth)
        assert r.status_code == 200 and r.json() == {"hello": "from kiln-example-plugin"}
        assert httpx.get(f"{off}/example/hello", headers=auth).status_code == 404
        assert httpx.get(f"{on}/example/hello").status_code == 401  # the API key guards it
        r = httpx.post(f"{on}/process", headers=auth, timeout=60,
                       json={"data": {"words": ["Hello", "The sky is"], "max_tokens": 3}})
        assert r.status_code == 200 and r.json()["num_tokens"] == 6
        r = httpx.post(f"{on}/process", headers=auth, json={"data": {"words": 3}})
        assert r.status_code == 400 and "data.words" in r.json()["error"]["message"]
        r = httpx.post(f"{off}/process", headers=auth, json={"data": {}})
        assert r.status_code == 400 and "--io-processor-plugin" in r.json()["error"]["message"]
        steps = [line.split() for line in stats.read_text().splitlines()]
        assert sum(int(s[0]) for s in steps) >= 6  # the stat logger ran in both servers
    finally:
        for server in servers.values():
            stop_server(server)


def test_a_misnamed_io_processor_fails_before_the_model_loads(plugin_path, models):
    code = ("from kiln import LLM\n"
            f"LLM({str(models['plain'])!r}, optimization_level=0, io_processor_plugin='nope')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(plugin_path)}, timeout=120)
    assert res.returncode != 0
    assert "io_processor_plugin='nope' is not installed" in res.stderr
    assert "installed: example_io" in res.stderr


def test_a_misnamed_endpoint_plugin_fails_at_start_up(plugin_path, models):
    res = subprocess.run([sys.executable, "-m", "kiln.cli.main", "serve", str(models["plain"]),
                          "--endpoint-plugins", "nope"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(plugin_path)}, timeout=120)
    assert res.returncode == 2
    assert "--endpoint-plugins nope: not installed" in res.stderr
    assert "installed: example_routes" in res.stderr


def test_model_registry():
    assert "LlamaForCausalLM" in ModelRegistry.get_supported_archs()
    ModelRegistry.register_model("TestOnlyForCausalLM", LlamaForCausalLM)
    ModelRegistry.register_model("TestLazyForCausalLM", "kiln.models.llama:LlamaForCausalLM")
    try:
        assert ModelRegistry.load_model_cls("TestOnlyForCausalLM") is LlamaForCausalLM
        assert ModelRegistry.load_model_cls("TestLazyForCausalLM") is LlamaForCausalLM
        with pytest.raises(ValueError, match="'NopeForCausalLM' is not supported; kiln "
                                             "supports .*LlamaForCausalLM"):
            ModelRegistry.load_model_cls("NopeForCausalLM")
        with pytest.raises(ValueError, match="'package.module:Class'"):
            ModelRegistry.register_model("X", "kiln.models.llama.LlamaForCausalLM")
        with pytest.raises(ValueError, match="torch.nn.Module subclass"):
            ModelRegistry.register_model("X", dict)
        ModelRegistry.register_model("TestBrokenForCausalLM", "kiln.models.llama:Nope")
        with pytest.raises(ValueError, match="cannot import 'kiln.models.llama:Nope'"):
            ModelRegistry.load_model_cls("TestBrokenForCausalLM")
    finally:
        for arch in ("TestOnlyForCausalLM", "TestLazyForCausalLM", "TestBrokenForCausalLM"):
            ModelRegistry._models.pop(arch, None)


def test_device_id_namespaces(monkeypatch):
    cuda = CudaPlatform()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setattr(CudaPlatform, "_assigned_physical_ids", None)
    assert cuda.logical_device_id_to_visible_device_id(1) == 1
    CudaPlatform.set_assigned_physical_device_ids([5, 4])
    CudaPlatform.set_assigned_physical_device_ids([5, 4])  # idempotent
    assert cuda.device_id_to_physical_device_id(0) == 5
    assert cuda.logical_device_id_to_visible_device_id(0) == 1
    with pytest.raises(RuntimeError, match="already assigned"):
        CudaPlatform.set_assigned_physical_device_ids([6])
    monkeypatch.setattr(CudaPlatform, "_assigned_physical_ids", [6])
    with pytest.raises(RuntimeError, match="physical device 6 is not visible"):
        cuda.logical_device_id_to_visible_device_id(0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # empty counts as unset
    assert cuda.visible_device_ids() is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8a3c1f2e,GPU-77b0aa91")  # UUIDs
    monkeypatch.setattr(CudaPlatform, "_assigned_physical_ids", None)
    assert cuda.logical_device_id_to_visible_device_id(1) == 1
