"""The ground truth: SmolLM2-135M-Instruct in fp32, kiln vs transformers, token for token."""
from __future__ import annotations

import pytest

from conftest import hf_greedy_batch
from kiln import LLM, SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the boiling point of water in Celsius?",
    "Write a short poem about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one paragraph.",
    "Translate 'good morning' into French.",
    "What is 12 times 7?",
    "Give me a tip for learning to cook.",
    "Who wrote Romeo and Juliet?",
]
MAX_NEW = 64


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(str(smollm2_dir), dtype="float32", progress=False, optimization_level=0)


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def references(smollm2_hf, prompts):
    return hf_greedy_batch(smollm2_hf, [p["prompt_token_ids"] for p in prompts], MAX_NEW,
                           stop_at_eos=True)


def test_batch_of_8_chat_prompts_matches_transformers(llm, prompts, references):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW),
                        use_tqdm=False)
    for out, ref in zip(outs, references):
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == ("stop" if ref[-1] == 2 else "length")
        tok = llm.get_tokenizer()
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)


def test_tiny_budget_and_preemption_keep_parity(smollm2_dir, prompts, references):
    # 32 tokens per step forces chunked prefill of every prompt; 20 blocks of 16 tokens
    # cannot hold 8 requests of ~100 tokens at once, so requests are preempted.
    llm = LLM(str(smollm2_dir), dtype="float32", progress=False, optimization_level=0, max_num_batched_tokens=32,
              num_kv_blocks=20, max_model_len=256)
    # Half the new tokens (greedy answers are prefixes of the longer ones): the prefills
    # and their preemptions are the point, and eager float32 decode steps are slow.
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW // 2),
                        use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [r[:MAX_NEW // 2] for r in references]


def test_o1_compiled_matches_transformers(smollm2_dir, prompts, references):
    """-O1: traced once, split at attention, Inductor pieces (warm from `make test`'s
    `kiln warmup -O1` when KILN_CACHE_DIR points at it)."""
    from kiln.compiler.counter import compilation_counter

    llm = LLM(str(smollm2_dir), dtype="float32", optimization_level=1, progress=False)
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=0):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW),
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == references


def test_prefix_caching_keeps_parity_on_a_shared_system_prompt(smollm2_dir):
    system = ("You are a careful assistant for a pottery studio. You answer briefly, you "
              "never invent facts, and when you do not know something you say so. Kilns, "
              "glazes, clay bodies and firing schedules are your specialty. ") * 2
    cached = LLM(str(smollm2_dir), dtype="float32", progress=False, optimization_level=0)
    plain = LLM(str(smollm2_dir), dtype="float32", progress=False, optimization_level=0, enable_prefix_caching=False)
    prompts = [cached.apply_chat_template([{"role": "system", "content": system},
                                           {"role": "user", "content": q}])
               for q in QUESTIONS[:4]]
    params = SamplingParams(temperature=0, max_tokens=32)
    cached.generate(prompts[:1], params, use_tqdm=False)  # warm the prefix
    hit = [o.outputs[0].token_ids for o in cached.generate(prompts, params, use_tqdm=False)]
    assert cached.engine.get_stats().prefix_cache_hits > 3 * 64
    assert hit == [o.outputs[0].token_ids for o in plain.generate(prompts, params,
                                                                   use_tqdm=False)]
