"""Every optimization level against transformers on SmolLM2 (fp32, greedy), with request
counts that need padding: 3 -> 4, 5 -> 8 and 13 -> 16 tokens per decode step.

-O2 and -O3 run the CPU test graph (the config's documented `graph_backend="cpu_test"`),
so their decode steps really are padded and replayed through PIECEWISE graphs; -O0 and -O1
run as users get them on a CPU (no graphs). The compiled levels load the artifacts that
`make test`'s `kiln warmup -O2` stored. -O3 on the CPU also turns on Inductor's
`cpp_wrapper` (the same kernels, C++ glue): here -O3 runs with -O2's Inductor options, so
it checks -O3's graph modes on the warm artifacts, and the cpp_wrapper build is held to
transformers on a tiny model in test_parity_tiny.py (a cold SmolLM2 cpp_wrapper compile
would cost the suite about 150 s).
"""
from __future__ import annotations

import pytest

from conftest import hf_greedy_batch
from kiln import LLM, SamplingParams
from kiln.config.compilation import CUDAGraphMode

pytestmark = pytest.mark.slow

TOPICS = ["water", "the sea", "colors", "a CPU", "French", "numbers", "cooking",
          "Shakespeare", "kilns", "rivers", "bread", "the moon", "trains"]
MAX_NEW = 18
SIZES = [1, 2, 4, 8, 16]


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    texts = [tok.apply_chat_template([{"role": "user", "content": f"Tell me about {t}."}],
                                     tokenize=False, add_generation_prompt=True)
             for t in TOPICS]
    return [tok.encode(text, add_special_tokens=False) for text in texts]


@pytest.fixture(scope="module")
def references(smollm2_hf, prompts):
    return hf_greedy_batch(smollm2_hf, prompts, MAX_NEW)


@pytest.mark.parametrize("level,graph_backend", [(0, "auto"), (1, "auto"), (2, "cpu_test"),
                                                 (3, "cpu_test")])
def test_every_level_matches_transformers_with_padded_batches(smollm2_dir, prompts,
                                                              references, level,
                                                              graph_backend):
    compilation = {"graph_backend": graph_backend, "cudagraph_capture_sizes": SIZES}
    if level == 3:
        compilation["inductor_options"] = {}  # -O2's code (see the module docstring)
    llm = LLM(str(smollm2_dir), dtype="float32", optimization_level=level, progress=False,
              max_model_len=512, compilation=compilation)
    runner = llm.engine.runner
    for n in (3, 5, 13):
        # Staggered lengths: the batch shrinks one request at a time, n -> 1.
        params = [SamplingParams(temperature=0, max_tokens=MAX_NEW - n + 1 + i,
                                 ignore_eos=True) for i in range(n)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:n]], params,
                            use_tqdm=False)
        for out, ref, sp in zip(outs, references, params):
            assert out.outputs[0].token_ids == ref[: sp.max_tokens], (level, n)
    if graph_backend == "cpu_test":
        assert runner.dispatcher.mode is CUDAGraphMode.PIECEWISE
        assert [runner.dispatcher.padded[n] for n in (3, 5, 13)] == [4, 8, 16]
        assert all(w.num_replays > 0 for w in runner.graph_wrappers)
    else:
        assert not runner.dispatcher.mode
