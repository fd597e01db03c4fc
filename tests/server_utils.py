"""A real `kiln serve` subprocess for the server tests, on a free 127.0.0.1 port.

The model is a tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer and chat
template: start-up and steps cost little, while tokenization, chat templating and
detokenization are the real thing. Greedy references come from an in-process `LLM` on the
same directory.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
import transformers

from kiln.bench.server_proc import stop_process, wait_healthy
from kiln.distributed.hosts import free_port  # noqa: F401  (the tests import it from here)

API_KEY = "test-key"
MODEL_NAME = "tiny-chat"
# Shared by the server and the in-process reference, so both engines are configured alike.
ENGINE_FLAGS = ["-O0", "--num-kv-blocks", "1024", "--max-num-seqs", "64"]
ENGINE_KWARGS = dict(optimization_level=0, num_kv_blocks=1024, max_num_seqs=64)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja")


def make_tiny_chat_model(path: Path, tokenizer_dir: Path) -> Path:
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2,  # wide init: logits far apart, so greedy has no near-ties
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(path)
    for name in _TOKENIZER_FILES:  # copied, not re-saved: no tokenizer load in the test
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples by name; labelled ones as name{labels}."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once nothing runs or waits and no KV block is held."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["kiln:num_requests_running"] == m["kiln:num_requests_waiting"] == 0
                    and m["kiln:kv_cache_usage_perc"] == 0):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {m}")
            time.sleep(0.1)


def start_server(model_dir: Path, log_path: Path, *extra: str) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "kiln.cli.main", "serve", str(model_dir),
           *ENGINE_FLAGS, "--port", str(port), "--api-key", API_KEY,
           "--served-model-name", MODEL_NAME, *extra]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    return Server(proc, f"http://127.0.0.1:{port}", log_path)


def wait_ready(server: Server, timeout: float = 180.0) -> None:
    wait_healthy(server.proc, server.base_url, server.log_path, timeout)


def stop_server(server: Server) -> None:
    stop_process(server.proc, 20.0)


@dataclass
class LoadResult:
    requests: int
    completed: int
    tokens: int
    wall_s: float
    ttft_s: list[float]

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s

    def ttft_pct(self, q: float) -> float:
        xs = sorted(self.ttft_s)
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]

    def summary(self) -> str:
        return (f"{self.completed}/{self.requests} streams complete, {self.tokens} tokens in "
                f"{self.wall_s:.2f} s = {self.throughput:.1f} tok/s; TTFT p50 "
                f"{self.ttft_pct(0.5) * 1e3:.0f} ms, p99 {self.ttft_pct(0.99) * 1e3:.0f} ms")


async def run_load(base_url: str, api_key: str, model: str, num_requests: int = 64,
                   max_tokens: int = 32, temperature: float = 0.0) -> LoadResult:
    """`num_requests` concurrent streaming completions, each asked for exactly `max_tokens`
    tokens (ignore_eos); half share a long prefix (prefix-cache hits). TTFT is measured at
    the client: request sent to first text chunk."""
    import asyncio

    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                timeout=600)
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 4

    async def one(i: int) -> tuple[int, float | None]:
        prompt = (shared if i % 2 else "") + f"Request {i}: tell me about the number {i}."
        start = time.perf_counter()
        ttft, tokens = None, 0
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, seed=i,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].text:
                ttft = time.perf_counter() - start
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens, ttft

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(num_requests)))
    wall = time.perf_counter() - start
    await client.close()
    done = [r for r in results if r[0] == max_tokens]
    return LoadResult(num_requests, len(done), sum(r[0] for r in results), wall,
                      [r[1] for r in results if r[1] is not None])


if __name__ == "__main__":  # load a running server by hand: BASE_URL [MODEL] [N] [MAX_TOKENS]
    import asyncio

    url = sys.argv[1]
    model = sys.argv[2] if len(sys.argv) > 2 else "SmolLM2-135M-Instruct"
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 32
    key = os.environ.get("KILN_API_KEY", "none")
    print(asyncio.run(run_load(url, key, model, n, max_tokens)).summary())
