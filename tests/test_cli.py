"""The `kiln` command as a person runs it, on the embedded default model."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def kiln(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli.main", *args], input=stdin,
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
    # ../shared/reference/this-machine.md). Dequantized float32 at -O1 is the graph
    # `make test`'s float32 warm-up stores (the parity tests' graph): this starts warm.
    res = kiln("generate", "--chat", "What is the capital of France?", "--max-tokens", "16",
               "-O1", "--dtype", "float32", "-q", "none", "--stream", "--stop", "\n\n")
    assert res.returncode == 0, res.stderr
    assert ">>> What is the capital of France?" in res.stdout and "Paris" in res.stdout
    assert "tok/s" in res.stdout.splitlines()[-1]
    listing = kiln("cache", "verify")
    assert listing.returncode == 0, listing.stdout
    assert "LlamaForCausalLM L=30" in listing.stdout and " ok " in listing.stdout
    empty = kiln("cache", "ls", "--cache-dir", str(tmp_path))
    assert "no compile cache entries" in empty.stdout


def test_generate_with_a_lora_adapter(smollm2_dir, tmp_path, capsys):
    """`--lora-path` runs the prompt with the adapter (LoRA turns on by itself); a bad
    adapter is a clear error before any prompt runs. In process on a tiny model: cheap."""
    import torch
    import transformers
    from lora_utils import make_adapter
    from server_utils import make_tiny_chat_model

    from kiln import LLM, LoRARequest, SamplingParams
    from kiln.cli.main import main

    model_dir = make_tiny_chat_model(tmp_path / "model", smollm2_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    make_adapter(base.eval(), tmp_path / "sql", 4, ["q_proj", "v_proj"], seed=3)
    flags = ["--model", str(model_dir), "-O0", "--dtype", "float32", "--num-kv-blocks", "64",
             "--max-tokens", "6", "--ignore-eos"]
    assert main(["generate", *flags, "--lora-path", str(tmp_path / "sql"), "Hello"]) == 0
    shown = capsys.readouterr().out.split(">>> Hello\n", 1)[1].splitlines()[0]
    ref = LLM(str(model_dir), progress=False, dtype="float32", optimization_level=0,
              num_kv_blocks=64, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with_adapter = ref.generate("Hello", params, use_tqdm=False,
                                lora_request=LoRARequest("sql", 1, str(tmp_path / "sql")))
    assert shown == with_adapter[0].outputs[0].text.strip()
    assert shown != ref.generate("Hello", params, use_tqdm=False)[0].outputs[0].text.strip()
    assert main(["generate", *flags, "--lora-path", str(tmp_path / "nope"), "Hello"]) == 2
    assert "missing adapter_config.json" in capsys.readouterr().err
