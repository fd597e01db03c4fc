"""Pipeline parallelism on gloo (`mp` executor): greedy parity with transformers at pp=2
(-O0 and -O2, with a warm start), pp=3, tp=2 x pp=2, several families (GQA, tied and untied
embeddings, odd layer counts so the stages differ in size, a sliding-window hybrid), the
batch queue keeping two micro-batches in flight under chunked prefill, preemption and
prefix hits, and the start-up refusals.

Cost: each case is an engine with its worker processes (about 3 s at -O0); the one cold
compile (pp=2 at -O2, both stages in parallel) is about 15 s, and its warm start is the
next case."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import TINY, hf_greedy, random_prompts

from kiln import LLM
from kiln.distributed.pipeline import layer_partition

HERE = Path(__file__).parent
WORKER = HERE / "tp_worker.py"
sys.path.insert(0, str(HERE))
from tp_worker import PROMPTS  # noqa: E402

CONFIGS = {
    # 3 layers: stages of 2 and 1 (pp=2), of 1 each (pp=3).
    "llama3l": lambda: transformers.LlamaConfig(**dict(TINY, num_hidden_layers=3),
                                                tie_word_embeddings=False),
    # Tied: the last stage loads the embedding into its LM head.
    "qwen2-tied": lambda: transformers.Qwen2Config(**dict(TINY, num_hidden_layers=5),
                                                   tie_word_embeddings=True),
    # Alternating sliding-window and full layers: each stage holds the same mix.
    "gemma2": lambda: transformers.Gemma2Config(
        **dict(TINY, num_hidden_layers=4), head_dim=32, sliding_window=24,
        query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, transformers.PreTrainedModel]]:
    root = tmp_path_factory.mktemp("pp")
    out = {}
    for name, make in CONFIGS.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(make()).float().eval()
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    return out


def run_cases(cases: list[dict], timeout: float = 500) -> list[dict]:
    res = subprocess.run([sys.executable, str(WORKER), json.dumps(cases)],
                         capture_output=True, text=True, timeout=timeout,
                         env=os.environ.copy())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


def reference(model: transformers.PreTrainedModel, prompts=PROMPTS, n: int = 12
              ) -> list[list[int]]:
    return [hf_greedy(model, p, n) for p in prompts]


def test_pp_matches_transformers_across_families_levels_and_grids(models):
    """One engine process for every case: pp=2 at -O2 (then again: every stage loads its
    own cache entry and compiles nothing), pp=3 (a layer each: the middle stage receives
    and sends), and at -O0 tp=2 x pp=2 on a tied model, a sliding-window hybrid at pp=2,
    and int8 at pp=2 on an explicit partition."""
    llama, qwen, gemma = (str(models[k][0]) for k in ("llama3l", "qwen2-tied", "gemma2"))
    cases = [{"model": llama, "level": 2, "tp": 1, "pp": 2},
             {"model": llama, "level": 2, "tp": 1, "pp": 2},
             {"model": llama, "level": 0, "tp": 1, "pp": 3},
             {"model": qwen, "level": 0, "tp": 2, "pp": 2},
             {"model": gemma, "level": 0, "tp": 1, "pp": 2}]
    # int8 weights (quantized per stage), on an explicit split (1 + 2 layers where the
    # even one is 2 + 1), answer as at pp=1.
    int8 = {"model": llama, "level": 0, "tp": 1, "engine": {"quantization": "int8"}}
    results = run_cases(cases + [{**int8, "pp": 2, "env": {"KILN_PP_LAYER_PARTITION": "1,2"}},
                                 {**int8, "pp": 1}])
    for case, result in zip(cases, results):
        name = Path(case["model"]).name
        assert result["tokens"] == reference(models[name][1]), case
        assert len(result["counters"]) == case["tp"] * case["pp"]  # a report per rank
    # The process's first engine spawns its workers; the later ones fork them from the
    # zygote the second started (kiln.executor.zygote).
    assert results[0]["forked"] == [False, False] and results[1]["forked"] == [True, True]
    assert results[3]["forked"] == [True] * 4
    warm = results[1]["counters"]  # the case before compiled (or loaded) both stages
    assert [c["num_inductor_compiles"] for c in warm] == [0, 0]
    assert [c["num_compiled_artifacts_loaded"] for c in warm] == [1, 1]
    assert results[-2]["tokens"] == results[-1]["tokens"]


def test_pp_pipelines_micro_batches_under_chunking_preemption_and_prefix_hits(models):
    """Twelve requests, some sharing a 40-token prefix, through a 24-token budget
    (chunked prefill) and a cache too small for all of them at once (preemption): pp=2
    keeps two steps in flight and still answers every request as transformers does."""
    shared = random_prompts(1, [40], seed=3)[0]
    prompts = [shared + p for p in random_prompts(6, [3, 9, 20, 5, 14, 2], seed=4)] \
        + random_prompts(6, [30, 7, 50, 12, 3, 25], seed=5)
    case = {"model": str(models["llama3l"][0]), "level": 0, "tp": 1, "pp": 2,
            "prompts": prompts, "max_tokens": 10,
            "engine": {"num_kv_blocks": 24, "max_num_batched_tokens": 24,
                       "max_num_seqs": 8, "block_size": 16}}
    result = run_cases([case])[0]
    assert result["peak_in_flight"] == 2
    assert result["tokens"] == reference(models["llama3l"][1], prompts, 10)


def test_layer_partition_even_split_and_override():
    assert layer_partition(9, 2, "") == [5, 4]
    assert layer_partition(10, 3, "") == [3, 4, 3]  # the extra layer before the last
    assert layer_partition(11, 3, "") == [4, 4, 3]
    assert layer_partition(5, 2, "1,4") == [1, 4]
    for bad in ("1,2", "a,b", "5,0"):
        with pytest.raises(ValueError, match="KILN_PP_LAYER_PARTITION"):
            layer_partition(5, 2, bad)
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 exceeds"):
        layer_partition(3, 4, "")


@pytest.mark.parametrize("kwargs, message", [
    (dict(pipeline_parallel_size=4), "pipeline_parallel_size=4 exceeds the model's 3"),
    (dict(pipeline_parallel_size=2, distributed_executor_backend="uni"),
     "runs on the 'mp' or 'ray' executor"),
    (dict(pipeline_parallel_size=2, enable_lora=True), "enable_lora does not run with"),
    (dict(pipeline_parallel_size=2,
          speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative_config does not run with"),
    (dict(pipeline_parallel_size=2, tensor_parallel_size=10_000),
     "tensor_parallel_size x pipeline_parallel_size = 10000 x 2 = 20000 exceeds"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
])
def test_bad_pipeline_config_is_a_startup_value_error(models, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(models["llama3l"][0]), dtype="float32", optimization_level=0,
            progress=False, num_kv_blocks=16, **kwargs)


def test_an_idle_engine_outlives_the_step_bound(models, monkeypatch):
    """Workers wait for the engine's next message within the step bound like any other
    message: an engine idle for longer (a server without traffic) keeps them alive with
    keep-alives instead of reading as a hung peer. Then aborted requests with steps in
    flight are drained, and the engine answers as before."""
    import time

    from kiln import SamplingParams

    monkeypatch.setenv("KILN_DIST_TIMEOUT_S", "2")
    path, hf = models["llama3l"]
    llm = LLM(str(path), dtype="float32", optimization_level=0, progress=False,
              num_kv_blocks=32, pipeline_parallel_size=2)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for idle_s in (5, 0):
            out = llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy, use_tqdm=False)
            assert out[0].outputs[0].token_ids == hf_greedy(hf, PROMPTS[0], 12)
            time.sleep(idle_s)
        # Requests aborted with steps in flight: the engine still steps until it has
        # received them (an unread answer would leave the last stage waiting on it).
        engine = llm.engine
        for i in range(4):
            engine.add_request(f"r{i}", {"prompt_token_ids": [1, 2, 3 + i]},
                               SamplingParams(max_tokens=50, ignore_eos=True))
        for _ in range(5):
            engine.step()
        engine.abort_request([f"r{i}" for i in range(4)])
        assert engine.has_unfinished_requests() == bool(engine.batch_queue)
        while engine.has_unfinished_requests():
            engine.step()
        assert len(engine.batch_queue) == 0
        out = llm.generate({"prompt_token_ids": PROMPTS[1]}, greedy, use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy(hf, PROMPTS[1], 12)
    finally:
        llm.shutdown()
