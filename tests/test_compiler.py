"""Trace once, split, piecewise builds and dispatch: counters and numerics on tiny models.

The counting tests use the eager compiler adaptor (same tracing, splitting, dedupe and
dispatch; no code generation) to stay fast; the Inductor path has its own numerics test
here and the cache tests in test_compile_cache.py.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import hf_greedy, random_prompts
from kiln import LLM, SamplingParams
from kiln.attention.backend import AttentionMetadata
from kiln.attention.forward_context import ForwardContext, set_forward_context
from kiln.compiler.build import use_regions
from kiln.compiler.counter import compilation_counter
from kiln.compiler.piecewise import PiecewiseBackend, Range
from kiln.config.compilation import CompilationConfig

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    path = tmp_path_factory.mktemp("l4") / "llama4"
    import transformers
    from conftest import TINY

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 4})
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(path)
    return path, model


def test_one_trace_2l_plus_1_pieces_identical_layers_once(four_layers, tmp_path):
    path, hf = four_layers
    comp = {"backend": "eager", "compile_sizes": [1, 8], "compile_ranges_endpoints": [16],
            "cache_dir": str(tmp_path)}
    # 4 layers: 9 pieces, 5 compiled; first/middle/last are the 3 distinct graphs, built
    # for 4 shapes each (sizes 1 and 8, ranges 1-16 and 17-64).
    with compilation_counter.expect(num_models_seen=1, num_graphs_seen=1,
                                    num_piecewise_graphs_seen=9,
                                    num_piecewise_capturable_graphs_seen=5,
                                    num_unique_graphs=3, num_backend_compilations=12,
                                    num_eager_compiles=12, num_inductor_compiles=0):
        llm = LLM(str(path), optimization_level=1, progress=False, dtype="float32",
                  attention_backend="torch", max_model_len=128,
                  max_num_batched_tokens=64, compilation=comp)
    prompts = random_prompts(5, [3, 8, 21, 1, 40])
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=0):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


def test_whole_graph_when_splitting_ops_is_empty(four_layers, tmp_path):
    with compilation_counter.expect(num_piecewise_graphs_seen=1,
                                    num_piecewise_capturable_graphs_seen=1,
                                    num_backend_compilations=1):
        LLM(str(four_layers[0]), optimization_level=1, progress=False, dtype="float32",
            attention_backend="torch", max_model_len=128,
            max_num_batched_tokens=32,
            compilation={"backend": "eager", "splitting_ops": [], "cache_dir": str(tmp_path)})


def _region_bodies(llm) -> tuple[int, int]:
    """(calls of a compiled region, distinct region bodies) in the traced graph."""
    piece = llm.engine.runner.compile_backend.split_gm._modules["submod_0"]
    calls = [n for n in piece.graph.nodes if "invoke_subgraph" in str(n.target)]
    return len(calls), len({n.args[0].target for n in calls})


@pytest.mark.parametrize("regions", [True, False])
def test_layers_share_one_compiled_region_on_the_native_attention_path(
        four_layers, tmp_path, cpu_kernels_loaded, regions):
    path, hf = four_layers
    llm = LLM(str(path), optimization_level=2, progress=False, dtype="float32",
              attention_backend="cpu", max_model_len=128, max_num_batched_tokens=64,
              compilation={"backend": "eager", "cache_dir": str(tmp_path),
                           "compile_regions": regions})
    calls, bodies = _region_bodies(llm)
    # Every layer calls the one traced body (compiled once); unrolled, no region at all.
    assert (calls, bodies) == ((4, 1) if regions else (0, 0))
    prompts = random_prompts(4, [3, 21, 1, 40])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


def test_regions_only_where_the_graph_is_one_piece_with_python_glue():
    on = CompilationConfig(compile_regions=True, splitting_ops=["kiln::unified_attention"])
    assert use_regions(on, native_attention=True)
    assert not use_regions(on, native_attention=False)  # split, or an int layer index
    assert not use_regions(dataclasses.replace(on, compile_regions=False), True)
    assert not use_regions(dataclasses.replace(on, inductor_options={"cpp_wrapper": True}),
                           True)
    for ops in (["kiln_cpu::unified_attention"], ["kiln::all_reduce"]):
        assert not use_regions(dataclasses.replace(on, splitting_ops=ops), True)
    assert use_regions(dataclasses.replace(on, splitting_ops=[]), True)


def test_dispatch_exact_size_wins_then_range_else_error():
    def tagged(tag):
        return lambda *args: tag

    piece = PiecewiseBackend("p", {Range(8, 8): tagged("size8"), Range(1, 16): tagged("low"),
                                   Range(17, 64): tagged("high")}, ("int", 0), False)
    assert piece(8) == "size8" and piece(7) == "low" and piece(17) == "high"
    with pytest.raises(RuntimeError, match="1-16, 17-64"):
        piece(65)


def test_explicit_compilation_mode_survives_o0(four_layers, tmp_path):
    llm = LLM(str(four_layers[0]), optimization_level=0, progress=False, dtype="float32",
              attention_backend="torch", max_model_len=64,
              max_num_batched_tokens=16,
              compilation={"mode": 1, "backend": "eager", "cache_dir": str(tmp_path)})
    assert llm.engine.runner.compile_backend is not None


def _prefill_metadata(n: int, block_size: int) -> AttentionMetadata:
    blocks = -(-n // block_size)
    table = torch.arange(1, blocks + 1, dtype=torch.int32).unsqueeze(0)
    return AttentionMetadata(
        num_actual_tokens=n, num_reqs=1, query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), block_table=table,
        slot_mapping=torch.arange(n) + block_size, query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n], max_query_len=n, max_seq_len=n, block_size=block_size)


def test_inductor_pieces_match_eager_logits(tiny_models, tmp_path):
    path, hf = tiny_models["qwen3"]
    llm = LLM(str(path), optimization_level=1, progress=False, dtype="float32",
              attention_backend="torch", max_model_len=128,
              max_num_batched_tokens=64, compilation={"cache_dir": str(tmp_path)})
    runner = llm.engine.runner
    for n in (1, 7, 40):
        ids, pos = torch.randint(3, 512, (n,)), torch.arange(n)
        outs = []
        for fn in (runner.forward, runner.model):
            ctx = ForwardContext([_prefill_metadata(n, 16)], runner.kv_caches,
                                 runner.attn_backends)
            with torch.inference_mode(), set_forward_context(ctx):
                outs.append(runner.model.compute_logits(fn(ids, pos)))
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    prompts = random_prompts(3, [4, 30, 9])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]
