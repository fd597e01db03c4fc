"""The `kiln` command as a person runs it, on the embedded default model."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def kiln(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.entrypoints.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_chat_is_multi_turn(smollm2_dir):
    res = kiln("chat", "--max-tokens", "24", stdin="My name is Ada.\nWhat is my name?\n\n")
    assert res.returncode == 0, res.stderr
    # input() echoes its "you> " prompt without a newline when stdin is a pipe.
    replies = [line.split("kiln> ", 1)[1] for line in res.stdout.splitlines()
               if "kiln> " in line]
    assert len(replies) == 2 and all(r.strip() for r in replies)
    # (a 135M model does not reliably recall the name, so the history itself is checked in
    # test_llm_api.py through LLM.chat)


def test_bad_flag_is_a_clear_error():
    res = kiln("generate", "hi", "--dtype", "float8")
    assert res.returncode == 2
    assert "dtype='float8'" in res.stderr and "bfloat16" in res.stderr


def test_generate_streams_at_o1_and_cache_commands(smollm2_dir, tmp_path):
    # One process for streaming, the chat template and -O1 (each costs a model load).
    # float32: in bfloat16 the first token is a near-tie that flips to "L" (see
    # ../shared/reference/this-machine.md)
    res = kiln("generate", "--chat", "What is the capital of France?", "--max-tokens", "16",
               "-O1", "--dtype", "float32", "--stream", "--stop", "\n\n")
    assert res.returncode == 0, res.stderr
    assert ">>> What is the capital of France?" in res.stdout and "Paris" in res.stdout
    assert "tok/s" in res.stdout.splitlines()[-1]
    listing = kiln("cache", "verify")
    assert listing.returncode == 0, listing.stdout
    assert "LlamaForCausalLM L=30" in listing.stdout and " ok " in listing.stdout
    empty = kiln("cache", "ls", "--cache-dir", str(tmp_path))
    assert "no compile cache entries" in empty.stdout
