"""`kiln bench`: every mode on a tiny random model writes well-formed JSON and charts.

Numbers are only sanity-checked (positive, ordered percentiles, consistent totals):
speed targets live in benchmarks/, never in timed tests.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from kiln.cli.main import main
from kiln.distributed.hosts import free_port

PNG = b"\x89PNG\r\n\x1a\n"
SUMMARY = {"n", "mean", "min", "p50", "p90", "p99", "max"}


@pytest.fixture(scope="module")
def tiny(tiny_models) -> str:
    """The session's tiny Llama checkpoint (shared with the parity tests)."""
    return str(tiny_models["llama"][0])


def bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    assert main(["bench", *args, "--json", str(out), "--plot", str(tmp_path / "plots")]) == 0
    return json.loads(out.read_text())


def check_summary(s: dict, n: int | None = None) -> None:
    assert set(s) == SUMMARY
    if n is not None:
        assert s["n"] == n
    assert 0 <= s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    assert s["min"] <= s["mean"] <= s["max"]


def check_pngs(tmp_path: Path, *names: str) -> None:
    for name in names:
        assert (tmp_path / "plots" / name).read_bytes()[:8] == PNG


def test_latency(tiny, tmp_path, capsys):
    # -O0: the harness is under test, not the compiler (`kiln bench compile` covers that;
    # a tiny -O2 build here cost 30 s of the suite).
    r = bench(tmp_path, "latency", "--model", tiny, "-O0", "--batch-size", "2",
              "--input-len", "8", "--output-len", "5", "--num-iters", "2", "--num-iters-warmup", "1")
    assert r["mode"] == "latency" and r["config"]["batch_size"] == 2
    assert r["device"].startswith("cpu:") and r["kiln_version"]
    check_summary(r["prefill_ms"], n=2)
    check_summary(r["decode_step_ms"], n=2 * 4)  # output 5 = 1 prefill token + 4 decode steps
    check_summary(r["e2e_s"], n=2)
    assert r["e2e_s"]["max"] * 1e3 >= r["prefill_ms"]["max"]  # seconds vs milliseconds
    assert r["decode_tok_s"] > 0 and r["output_tok_s"] > 0 and r["load_time_s"] > 0
    assert len(r["samples"]["decode_step_ms"]) == 8
    assert "decode step (ms)" in capsys.readouterr().out
    check_pngs(tmp_path, "latency.png")


def test_throughput(tiny, tmp_path):
    r = bench(tmp_path, "throughput", "--model", tiny, "-O0", "--num-prompts", "5", "--input-len",
              "8", "--output-len", "4", "--random-range-ratio", "0.5", "--temperature", "1.0")
    assert r["config"]["temperature"] == 1.0  # every token sampled; EOS still ignored
    assert r["num_requests"] == 5 and r["total_output_tokens"] >= 5
    assert r["total_input_tokens"] >= 5 * 4  # lengths drawn in 4..12
    assert math.isclose(r["requests_per_s"], 5 / r["elapsed_s"])
    assert math.isclose(r["total_tok_s"], (r["total_input_tokens"] + r["total_output_tokens"])
                        / r["elapsed_s"])
    check_summary(r["ttft_s"], n=5)
    check_summary(r["latency_s"], n=5)
    assert r["latency_s"]["max"] <= r["elapsed_s"]
    check_pngs(tmp_path, "throughput.png")


def test_kernels_pick_fastest_and_write_tuning_table(tiny, tmp_path, monkeypatch):
    from kiln.bench import cases
    from kiln.ops.tuning import lookup
    from kiln.platforms import device_name

    # A wrong candidate is reported and never chosen.
    monkeypatch.setitem(cases._EXTRA, "rms_norm",
                        {"broken": lambda s, x, weight: (lambda: x * 2)})
    table = tmp_path / "tuning.json"
    r = bench(tmp_path, "kernels", "--model", tiny, "--batch-sizes", "1", "2",
              "--prefill-lens", "8", "--context-len", "20", "--no-compiled", "--iters", "2",
              "--warmup", "1", "--tuning-file", str(table))
    from kiln.ops import cpu_kernels

    ops = {"linear", "fused_moe", "attention", "rms_norm", "rope", "silu_and_mul",
           "top_k_top_p"}
    if cpu_kernels.loaded():  # the quantized kernel's direct vs panel paths
        ops.add("linear_quant")
    assert set(r["best"]) == ops and r["tuning_file"] == str(table)
    broken = [x for x in r["results"] if x["candidate"] == "broken"]
    assert broken and all(not x["ok"] and "wrong result" in x["error"] for x in broken)
    for x in r["results"]:
        if x["candidate"] != "broken":
            assert x["ok"], x
            assert 0 < x["median_us"] <= x["p90_us"] and x["calls_per_sample"] >= 1
    attention = r["best"]["attention"]
    assert len(attention) == 3  # decode b=1, decode b=2, prefill 8
    for entry in r["best"]["rms_norm"].values():
        assert entry["best"] != "broken" and entry["best"] == min(entry["us"],
                                                                  key=entry["us"].get)
    written = json.loads(table.read_text())
    assert written["version"] == 1
    assert set(written["devices"][device_name("cpu")]) == ops
    key = next(iter(attention))
    assert lookup("attention", key, "cpu", path=table)["best"] == attention[key]["best"]
    assert attention[key]["best"] in ("torch", "cpu")
    check_pngs(tmp_path, "kernels_attention.png", "kernels_rope.png")


def test_tuning_table_steers_backend_selection(tmp_path, monkeypatch, caplog):
    from kiln.attention.backends.torch_paged import TorchPagedBackend
    from kiln.attention.selector import BACKENDS, select_backend
    from kiln.bench.tuning import merge_into
    from kiln.ops.tuning import shape_key
    from kiln.platforms import device_name

    class Tuned(TorchPagedBackend):
        name = "tuned"

    monkeypatch.setitem(BACKENDS, "tuned", Tuned)
    table = tmp_path / "tuning.json"
    monkeypatch.setenv("KILN_TUNING_FILE", str(table))
    # The untuned default: kiln's C++ backend where it is built, else torch.
    default = select_backend(None, 64, torch.float32, torch.device("cpu"))
    assert default.name in ("cpu", "torch")
    key = shape_key(phase="decode", batch=8, context=256, heads=9, kv_heads=3, head_size=64,
                    dtype=torch.float32)
    merge_into(table, device_name("cpu"), {"attention": {key: {"best": "tuned", "config": None,
                                                                "us": {"tuned": 1.0}}}})
    with caplog.at_level("INFO"):
        assert select_backend(None, 64, torch.float32, torch.device("cpu")) is Tuned
    assert "tuning table" in caplog.text
    # Another head size or dtype was not tuned; a named backend always wins.
    assert select_backend(None, 32, torch.float32, torch.device("cpu")) is default
    assert select_backend(None, 64, torch.bfloat16, torch.device("cpu")) is default
    assert select_backend("torch", 64, torch.float32, torch.device("cpu")) is TorchPagedBackend
    monkeypatch.setattr(Tuned, "supports", classmethod(lambda cls, *a: "not here"))
    assert select_backend(None, 64, torch.float32, torch.device("cpu")) is default
    table.write_text("{not json")  # a broken table is ignored with a warning, never fatal
    assert select_backend(None, 64, torch.float32, torch.device("cpu")) is default
    assert "ignoring the tuning table" in caplog.text


def test_compile_cold_and_warm(tiny, tmp_path):
    # The eager compile backend traces and splits without codegen: the subprocess and
    # fresh-cache mechanics are the same, in seconds instead of an Inductor build.
    r = bench(tmp_path, "compile", "--model", tiny, "--compile-backend", "eager",
              "--levels", "1")
    [row] = r["rows"]
    assert row["level"] == 1 and r["config"]["engine_args"] == [
        "--model", tiny, "--compile-backend", "eager"]
    for run in (row["cold"], row["warm"]):
        assert 0 < run["load_s"] < run["startup_s"] < run["process_s"]
        assert run["first_token_s"] > 0 and run["compiles"] > 0
    assert math.isclose(row["warm_over_cold"], row["warm"]["startup_s"]
                        / row["cold"]["startup_s"])
    check_pngs(tmp_path, "compile.png")


# ---- serve ------------------------------------------------------------------------------
class _StubHandler(BaseHTTPRequestHandler):
    """A minimal OpenAI-style server: one SSE chunk per token, GAP seconds apart."""

    GAP = 0.01
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def _send(self, body: bytes, ctype: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(json.dumps({"data": [{"id": "stub-model"}]}).encode(), "application/json")

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["stream"] and req["model"] == "stub-model"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        n = req["max_tokens"]
        for i in range(n):
            time.sleep(self.GAP)
            chunk = {"choices": [{"index": 0, "text": f" t{i}",
                                  "finish_reason": "length" if i == n - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.close_connection = True


def test_serve_client_against_stub_server(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        r = bench(tmp_path, "serve", "--url", url, "--num-prompts", "6", "--output-len", "4",
                  "--input-len", "5", "--max-concurrency", "3", "--request-rate", "200")
    finally:
        server.shutdown()
    assert r["completed"] == 6 and r["failed"] == 0 and r["config"]["model"] == "stub-model"
    assert r["total_output_tokens"] == 24 and r["total_input_tokens"] == 6 * 7  # from usage
    check_summary(r["ttft_ms"], n=6)
    check_summary(r["itl_ms"], n=6 * 3)
    check_summary(r["tpot_ms"], n=6)
    check_summary(r["e2e_ms"], n=6)
    gap_ms = _StubHandler.GAP * 1e3
    assert r["ttft_ms"]["min"] >= gap_ms * 0.9 and r["itl_ms"]["p50"] >= gap_ms * 0.9
    assert r["e2e_ms"]["min"] >= r["ttft_ms"]["min"]
    assert math.isclose(r["output_tok_s"], 24 / r["duration_s"])
    check_pngs(tmp_path, "serve.png")


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "http://example.com",
                                 "ftp://127.0.0.1:21", "http://127.0.0.1.example.com"])
def test_serve_refuses_remote_urls(url):
    from kiln.bench.serve import run_serve

    with pytest.raises(ValueError, match="url="):
        run_serve(url, 1, 4, 4)


def test_serve_against_kiln_serve(tiny, tmp_path):
    import httpx

    port = free_port()
    # The tiny model has no tokenizer: the benchmark sends token-id prompts.
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "serve", tiny,
                             "--host", "127.0.0.1", "--port", str(port), "-O0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:  # bounded wait for start-up
            if proc.poll() is not None:
                pytest.fail(f"kiln serve exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("kiln serve did not answer /v1/models within 180 s")
            time.sleep(0.3)
        r = bench(tmp_path, "serve", "--url", url, "--num-prompts", "4", "--input-len", "8",
                  "--output-len", "6", "--max-concurrency", "2", "--prompt-type", "ids")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert r["completed"] == 4 and r["failed"] == 0, r["errors"]
    assert r["total_output_tokens"] == 4 * 6 and r["total_input_tokens"] == 4 * 8
    check_summary(r["ttft_ms"], n=4)
    check_summary(r["itl_ms"], n=4 * 5)
    check_summary(r["tpot_ms"], n=4)
    check_summary(r["e2e_ms"], n=4)
    assert r["output_tok_s"] > 0
    check_pngs(tmp_path, "serve.png")


@pytest.mark.slow
def test_quality_reports_perplexity_and_agreement(tmp_path):
    """`kiln bench quality` on the embedded model, float32, eager: its native GGUF weights
    are the same values as the dequantized checkpoint, so perplexity and greedy outputs
    agree; int8 stays within 2% perplexity over the text's first 510 tokens (0.75% over
    the whole text in 256-token windows; two windows keep the suite's budget)."""
    r = bench(tmp_path, "quality", "-O0", "--dtype", "float32", "--methods", "none", "int8",
              "gguf", "--window", "256", "--max-windows", "2", "--max-tokens", "8")
    rows = {row["method"]: row for row in r["rows"]}
    assert set(rows) == {"none", "int8", "gguf"}
    assert rows["none"]["tokens_scored"] == 2 * 255 and 5 < rows["none"]["perplexity"] < 100
    assert abs(rows["gguf"]["perplexity_vs_none"]) < 1e-3
    assert rows["gguf"]["greedy_identical"] == rows["gguf"]["greedy_prompts"] == 8
    assert abs(rows["int8"]["perplexity_vs_none"]) < 0.02


def test_lora_overhead(tiny, tmp_path, capsys):
    """`kiln bench lora`: the base engine, the LoRA engine on base requests and on requests
    spread over random adapters it writes itself (valid PEFT directories: a bad one would
    fail its requests), interleaved."""
    r = bench(tmp_path, "lora", "--model", tiny, "-O0", "--num-prompts", "4", "--input-len",
              "8", "--output-len", "4", "--num-adapters", "2", "--rank", "4", "--repeats", "2")
    assert r["mode"] == "lora" and r["config"]["num_adapters"] == 2
    assert set(r["runs"]) == {"base", "lora-base", "lora-mixed"}
    assert all(len(v) == 2 and min(v) > 0 for v in r["runs"].values())
    assert set(r["overhead"]) == {"lora-base", "lora-mixed"}
    assert "overhead vs base" in capsys.readouterr().out


def test_structured_overhead(tmp_path, smollm2_dir, capsys):
    """`kiln bench structured`: free vs JSON-schema-constrained decode steps with the
    whole batch in, on a tiny model with SmolLM2's tokenizer (the grammar needs one)."""
    from server_utils import make_tiny_chat_model

    model = make_tiny_chat_model(tmp_path / "chat", smollm2_dir)
    r = bench(tmp_path, "structured", "--model", str(model), "-O0", "--num-prompts", "4",
              "--output-len", "8", "--repeats", "1")
    assert r["mode"] == "structured" and r["compile_cold_ms"] > r["compile_cached_ms"] > 0
    assert set(r["runs"]) == {"free", "mixed", "constrained"}
    assert set(r["overhead"]) == {"mixed", "constrained"}
    assert all(len(v) == 1 and v[0] > 0 for v in r["runs"].values())
    assert "overhead" in capsys.readouterr().out


def test_spec_decode_speedup_and_acceptance(tmp_path, smollm2_dir, capsys):
    """`kiln bench spec`: base vs n-gram speculation at batch 1 on both workloads, on a
    tiny chat model with SmolLM2's tokenizer; greedy outputs must be identical."""
    from server_utils import make_tiny_chat_model

    model = make_tiny_chat_model(tmp_path / "chat", smollm2_dir)
    r = bench(tmp_path, "spec", "--model", str(model), "-O0", "--output-len", "12",
              "--repeats", "1", "--speculative-config",
              '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}')
    assert r["mode"] == "spec" and r["identical"] is True
    assert set(r["speedup"]) == {"grounded", "chat"} and all(v > 0 for v in r["speedup"].values())
    for w, (lo, hi) in r["speedup_range"].items():  # one repeat: the ratio of its two runs
        runs = r["runs"][w]
        assert lo == hi == r["speedup"][w] == runs["spec"][0] / runs["base"][0]
    # A random model rarely repeats its prompt: the numbers are the harness's, not a bar.
    assert len(r["acceptance"]["grounded"]["per_position_acceptance"]) == 3
    assert all(len(c) == 1 for w in r["runs"].values() for c in w.values())
    assert "speedup" in capsys.readouterr().out


def test_kv_tier_ttft_in_fresh_processes(tmp_path, smollm2_dir, capsys):
    """`kiln bench kv`: none / cold / warm disk tier, each a fresh process, on a tiny chat
    model with SmolLM2's tokenizer; the warm runs load the prefix and agree with none."""
    from server_utils import make_tiny_chat_model

    model = make_tiny_chat_model(tmp_path / "chat", smollm2_dir)
    r = bench(tmp_path, "kv", "--model", str(model), "-O0", "--dtype", "float32",
              "--prefix-len", "100", "--repeats", "1")
    assert r["mode"] == "kv" and r["identical"] is True
    assert [len(r["runs"][c]) for c in ("none", "warm", "cold")] == [1, 1, 1]
    assert r["runs"]["warm"][0]["kv_transfer"]["blocks_loaded"] == 100 // 16
    assert r["runs"]["cold"][0]["kv_transfer"]["blocks_saved"] >= 100 // 16
    assert r["runs"]["none"][0]["kv_transfer"] is None
    assert r["speedup"] > 0 and "warm tier vs none" in capsys.readouterr().out


def test_moe_kiln_vs_transformers(tmp_path, capsys):
    """`kiln bench moe`: the random Mixtral, both engines, one batch size, tiny workload."""
    r = bench(tmp_path, "moe", "-O", "0", "--dtype", "float32", "--batch-sizes", "2",
              "--input-len", "8", "--output-len", "3", "--repeats", "1")
    assert r["mode"] == "moe" and set(r["median_tok_s"]) == {"2"}
    assert all(v > 0 for v in r["median_tok_s"]["2"].values()) and r["speedup"]["2"] > 0
    assert "transformers tok/s" in capsys.readouterr().out


def test_budget_is_measured_written_and_used(tiny, tmp_path, monkeypatch, capsys):
    """`kiln bench budget`: per candidate budget a long prompt arrives beside decoding
    requests and every step until its first token is timed; the choice (the smallest
    budget within 90% of the best prefill rate) lands in the tuning table under the key
    an engine with the same flags looks up, and such an engine given no budget starts
    with it, while an explicit budget wins."""
    from kiln import LLM

    table = tmp_path / "tuning.json"
    monkeypatch.setenv("KILN_TUNING_FILE", str(table))
    r = bench(tmp_path, "budget", "--model", tiny, "-O0", "--candidates", "64", "16",
              "--prompt-len", "96", "--decode-rows", "2", "--repeats", "1")
    assert r["mode"] == "budget" and r["config"]["candidates"] == [16, 64]
    small, large = r["runs"]["16"], r["runs"]["64"]
    assert small["steps"] >= 96 // 16 + 1 > large["steps"] >= 2  # decode rows share steps
    check_summary(small["step_ms"], n=small["steps"])
    top = max(v["prefill_tok_s"] for v in r["runs"].values())
    assert r["best"] == min(int(b) for b, v in r["runs"].items()
                            if v["prefill_tok_s"] >= 0.9 * top)
    assert r["tuning_file"] == str(table) and r["key"] in table.read_text()
    assert f"chosen: max_num_batched_tokens={r['best']}" in capsys.readouterr().out
    for given, expected in ((None, r["best"]), (32, 32)):
        llm = LLM(tiny, optimization_level=0, progress=False, num_kv_blocks=32,
                  max_num_batched_tokens=given)
        assert llm.engine.config.max_num_batched_tokens == expected
        llm.shutdown()
