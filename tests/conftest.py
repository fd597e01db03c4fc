"""Shared fixtures: tiny random checkpoints of every supported family, the real SmolLM2
directory, and a transformers greedy reference."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton kernels run on a CPU only in Triton's interpreter, which must be chosen before
# Triton is first imported (Inductor imports it during any compile): on a host without CUDA
# the whole session interprets, so tests/test_triton_attention.py can run anywhere in it.
# Nothing else uses Triton on a CPU (Inductor emits C++ there).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            # A wide init keeps logits far apart: greedy ties would make parity flaky.
            initializer_range=0.2, bos_token_id=1, eos_token_id=2)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

TINY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=False),
    "llama-tied": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=True),
    "llama3-rope": lambda: transformers.LlamaConfig(**TINY, rope_theta=500000.0,
                                                    rope_scaling=LLAMA3_ROPE),
    "qwen2": lambda: transformers.Qwen2Config(**TINY),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=32),
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=None),
}


def make_tiny_model(kind: str, path: Path, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(TINY_CONFIGS[kind]())
    model = model.float().eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def cpu_kernels_loaded() -> None:
    """kiln's C++ CPU kernels, built (once per cache) and loaded; skips where this host
    cannot have them (no AVX2 or no compiler), where the engine falls back too. A build
    that fails on a host that can have them fails the tests: the engine would fall back
    silently, and a skipped suite would hide it."""
    from kiln.compiler.cache import default_cache_root
    from kiln.ops import cpu_kernels

    if not cpu_kernels.ensure_loaded(default_cache_root()):
        reason = cpu_kernels.unavailable_reason()
        if cpu_kernels.host_supports() is None:
            pytest.fail(f"kiln's CPU kernels failed to build: {reason}")
        pytest.skip(f"kiln's CPU kernels are unavailable: {reason}")


@pytest.fixture(autouse=True)
def _kernel_threads(request: pytest.FixtureRequest):
    """`make test` runs each worker single-threaded (OMP_NUM_THREADS=1, see the Makefile);
    a test of kiln's C++ kernels runs at the host's thread count (two at least), as users
    run them, so the kernels' splits of work over threads stay covered."""
    if "cpu_kernels_loaded" not in request.fixturenames:
        yield
        return
    from kiln.platforms.cpu import cpu_threads_per_rank

    before = torch.get_num_threads()
    torch.set_num_threads(max(2, cpu_threads_per_rank(1)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory):
    """kind -> (directory, transformers model), built once per session."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: (root / kind, make_tiny_model(kind, root / kind)) for kind in TINY_CONFIGS}


def hf_greedy(model: transformers.PreTrainedModel, prompt_ids: list[int], max_new: int,
              stop_at_eos: bool = False) -> list[int]:
    """transformers' own greedy decode of one unpadded prompt: the ground truth."""
    gen = model.generation_config
    eos = gen.eos_token_id
    if not stop_at_eos:
        gen.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new,
                                 do_sample=False, pad_token_id=0)
    finally:
        gen.eos_token_id = eos
    return out[0, len(prompt_ids):].tolist()


def hf_greedy_batch(model: transformers.PreTrainedModel, prompts: list[list[int]],
                    max_new: int, stop_at_eos: bool = False) -> list[list[int]]:
    """`hf_greedy` for several prompts in one left-padded `generate` (about 3x faster
    for SmolLM2's 8 chat prompts: the suite's budget). The first prompt is also decoded
    alone and must agree, so padding can never quietly move the ground truth."""
    eos = model.generation_config.eos_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    gen = model.generation_config
    if not stop_at_eos:
        gen.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new,
                                 do_sample=False, pad_token_id=0)
    finally:
        gen.eos_token_id = eos
    rows = []
    for row in out[:, width:].tolist():
        if stop_at_eos and eos in row:
            row = row[:row.index(eos) + 1]  # what generate returns for the prompt alone
        rows.append(row)
    assert rows[0] == hf_greedy(model, prompts[0], max_new, stop_at_eos), \
        "a left-padded batch changed transformers' greedy output"
    return rows


def assert_exact_under_pressure(llm, prompts: list[list[int]], params, refs: list[list[int]],
                                compiled: bool) -> None:
    """Greedy outputs equal `refs` while prefix-cache hits and preemption happen (the
    caller sizes the cache and shares a prefix); a compiled engine compiles nothing
    while serving."""
    from kiln.compiler.counter import compilation_counter

    before = compilation_counter.clone()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    if compiled:
        assert not any(compilation_counter.delta(before).values())


def random_prompts(n: int, lengths: list[int], vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(n)]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from kiln.models.model_source import resolve_model

    return resolve_model(None, progress=False)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir,
                                                              dtype=torch.float32)
    # The reference is plain greedy, as the parity tests ask of kiln: the converted model's
    # generation_config.json carries kiln's chat default (a repetition penalty), which
    # transformers' generate() would otherwise apply.
    model.generation_config.repetition_penalty = 1.0
    return model.eval()

