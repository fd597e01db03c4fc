"""Sliding-window and hybrid KV caches: specs, groups and managers; every attention
backend honouring windows and softcaps; Gemma 2 / Gemma 3 and windowed Mistral / Qwen2
token-exact with transformers (float32, -O0 and -O2, with chunked prefill, prefix-cache
hits and preemption); the memory a 5:1 model holds at 4k context."""
from __future__ import annotations

import pytest
import torch
import transformers

from attention_batches import (dense_reference, make_batch, poison_out_of_window,
                               random_shapes, run_backend, windowed)
from conftest import TINY, assert_exact_under_pressure, hf_greedy, random_prompts
from kiln import LLM, SamplingParams
from kiln.attention import selector
from kiln.attention.backend import AttentionLayerSpec
from kiln.attention.backends.cpu_paged import CpuPagedBackend
from kiln.attention.backends.torch_paged import TorchPagedBackend
from kiln.attention.backends.triton_paged import TritonPagedBackend
from kiln.bench.hybrid_kv import measure_kv_blocks
from kiln.kv_cache.block_hash import BlockHasher
from kiln.kv_cache.kv_cache_manager import KVCacheManager
from kiln.kv_cache.kv_cache_spec import (FullAttentionSpec, KVCacheGroupSpec, KVCacheSpec,
                                         SlidingWindowSpec, group_layers)
from kiln.kv_cache.single_type_manager import SlidingWindowManager, group_hash, manager_class
from kiln.ops.triton_runtime import interpreter_reason
from kiln.platforms.cpu import CpuPlatform
from kiln.request import Request
from kiln.sampling.params import SamplingParams as Params

F32 = torch.float32


# ---- specs, groups, registry -------------------------------------------------------------
def _full(bs: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(bs, 2, 16, F32)


def _sliding(window: int, bs: int = 4) -> SlidingWindowSpec:
    return SlidingWindowSpec(bs, 2, 16, F32, window)


def test_group_layers_gives_equal_size_groups_per_spec():
    sw, full = _sliding(8), _full()
    gemma3 = group_layers([sw] * 5 + [full] + [sw] * 5 + [full])  # 10:2 -> groups of 2
    assert [g.layers for g in gemma3] == [(0, 1), (2, 3), (4, 6), (5, 11), (7, 8), (9, 10)]
    assert [type(g.spec) for g in gemma3].count(FullAttentionSpec) == 1
    assert [g.layers for g in group_layers([sw, full] * 2)] == [(0, 2), (1, 3)]
    (one,) = group_layers([full] * 3)
    assert one.layers == (0, 1, 2)
    with pytest.raises(ValueError, match="page sizes"):
        group_layers([full, FullAttentionSpec(4, 1, 16, F32)])


def test_manager_registry_walks_the_mro():
    class Chunked(SlidingWindowSpec):
        pass

    class Unknown(KVCacheSpec):
        pass

    assert manager_class(Chunked(4, 2, 16, F32, 8)) is SlidingWindowManager
    with pytest.raises(ValueError, match="no KV-cache manager is registered for Unknown"):
        manager_class(Unknown(4))


def _request(rid: str, tokens: list[int], block_size: int = 4) -> Request:
    return Request(rid, tokens, Params(temperature=0, max_tokens=8),
                   block_hasher=BlockHasher(block_size))


def test_sliding_window_frees_blocks_out_of_reach():
    kv = KVCacheManager([KVCacheGroupSpec(_sliding(6), (0,))], num_blocks=20)
    req = _request("a", list(range(40)))
    free = kv.block_pool.get_num_free_blocks()
    for step in range(10):  # four tokens a step
        assert kv.allocate_slots(req, 4) is not None
        req.num_computed_tokens += 4
    # The next query sits at 40 and sees 35..40: blocks 0..7 (tokens 0..31) are freed.
    blocks = kv.managers[0].req_to_blocks["a"]
    assert [b.is_null for b in blocks] == [True] * 7 + [False] * 3
    assert free - kv.block_pool.get_num_free_blocks() == 3
    kv.free(req)
    assert kv.block_pool.get_num_free_blocks() == free


def test_prefix_hits_are_computed_per_group():
    """The hit must hold in every group: a full-attention prefix needs every block, a
    sliding window only the blocks its window reaches (the rest come back null)."""
    kv = KVCacheManager([KVCacheGroupSpec(_full(), (0,)), KVCacheGroupSpec(_sliding(6), (1,))],
                        num_blocks=64, enable_caching=True)
    tokens = list(range(24))
    first = _request("a", tokens + [99])
    kv.allocate_slots(first, len(first.all_token_ids))
    kv.free(first)  # cached blocks stay cached while free
    hits, n = kv.get_computed_blocks(_request("b", tokens + [7]))
    assert n == 24 and [len(h) for h in hits] == [6, 6]
    assert not any(b.is_null for b in hits[0])
    # The query at 24 sees 19..24: blocks 4 and 5; the ones before need no KV.
    assert [b.is_null for b in hits[1]] == [True] * 4 + [False] * 2
    # Evict the sliding group's block 4 (positions 16..19): a hit at 24 needs it (the
    # query at 24 sees 19..24), so the longest hit shrinks to where both groups agree.
    pool, hashes = kv.block_pool, first.block_hashes
    pool._evict(pool.get_cached_block(group_hash(hashes[4], 1)))
    hits, n = kv.get_computed_blocks(_request("c", tokens + [7]))
    assert n == 16 and [len(h) for h in hits] == [4, 4]
    # Sliding window alone: a run of cached blocks late in the prompt is enough.
    sw = SlidingWindowManager(_sliding(6), pool, 1)
    found = sw.find_hit(hashes, 6)
    assert len(found) == 4 and not found[3].is_null


# ---- backends: windows and softcaps ----------------------------------------------------
BACKENDS = {"torch": TorchPagedBackend, "cpu": CpuPagedBackend, "triton": TritonPagedBackend}


@pytest.mark.parametrize("window,softcap", [(20, None), (None, 5.0), (9, 3.0)])
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backends_honour_window_and_softcap(request, name, window, softcap):
    """Mixed prefills, chunks with context and decodes longer than the window; blocks
    wholly before a row's window are NaN, so reading one would show."""
    if name == "cpu":
        request.getfixturevalue("cpu_kernels_loaded")
    if name == "triton" and interpreter_reason() is not None:
        pytest.skip(interpreter_reason())
    backend = BACKENDS[name]
    heads, kv_heads, hd, bs = 4, 2, 64, 16
    spec = windowed(AttentionLayerSpec(heads, kv_heads, hd, hd ** -0.5), window, softcap)
    for seed in range(2):
        shapes = random_shapes(seed + 5, 6, max_context=70)
        batch = make_batch(shapes, heads, kv_heads, hd, bs, pad=2, seed=seed)
        ref = dense_reference(batch, spec)
        if window is not None:
            batch = poison_out_of_window(batch, window)
        out, _ = run_backend(backend, batch, spec)
        n = batch.metadata.num_actual_tokens
        torch.testing.assert_close(out[:n], ref, atol=3e-5, rtol=3e-5)


class _NoWindowBackend(TorchPagedBackend):
    name = "no-window"

    @classmethod
    def supports_layer(cls, spec: AttentionLayerSpec) -> str | None:
        return "no sliding window" if spec.sliding_window else None


def test_a_backend_that_cannot_honour_a_window_falls_back_or_raises(monkeypatch, caplog):
    cpu = torch.device("cpu")
    monkeypatch.setitem(selector.BACKENDS, "no-window", _NoWindowBackend)
    monkeypatch.setattr(CpuPlatform, "attention_backends", ("no-window", "torch"))
    layers = [AttentionLayerSpec(4, 2, 64, 0.125, sliding_window=32)]
    with caplog.at_level("WARNING"):
        assert selector.select_backend(None, 64, F32, cpu, layers) is TorchPagedBackend
    assert caplog.text.count("no sliding window") == 1
    with pytest.raises(ValueError, match="attention_backend='no-window'.*no sliding window"):
        selector.select_backend("no-window", 64, F32, cpu, layers)


# ---- families: parity with transformers ------------------------------------------------
WINDOW = 24
CONFIGS = {
    "gemma2": lambda: transformers.Gemma2Config(
        **dict(TINY, num_hidden_layers=4), head_dim=32, sliding_window=WINDOW,
        query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **dict(TINY, num_hidden_layers=6), head_dim=32, sliding_window=WINDOW,
        query_pre_attn_scalar=24, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=WINDOW),
    "qwen2": lambda: transformers.Qwen2Config(**dict(TINY, num_hidden_layers=4),
                                              use_sliding_window=True, sliding_window=WINDOW,
                                              max_window_layers=2),
}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SHARED = random_prompts(1, [40], seed=21)[0]
PROMPTS = [SHARED + t for t in random_prompts(3, [5, 30, 12], seed=22)] \
    + random_prompts(1, [70], seed=23)
# Blocks for the four prompts to preempt each other (16 tokens a block, 86-token requests).
BLOCKS = {"gemma2": 18, "gemma3": 50, "mistral": 12, "qwen2": 18}
# (family, level, backend): every family at -O0 on the default backend; the softcapped
# and the 5:1 families compiled too; the torch backend's softcap path once.
RUNS = [("gemma2", 0, None), ("gemma2", 2, None), ("gemma3", 0, None), ("gemma3", 2, None),
        ("mistral", 0, None), ("qwen2", 0, None), ("gemma2", 0, "torch")]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    out = {}
    for kind, make in CONFIGS.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(make()).float().eval()
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path)
        out[kind] = path, [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]
    return out


@pytest.mark.parametrize("kind,level,backend", RUNS)
def test_sliding_window_families_match_transformers(family_models, kind, level, backend):
    path, refs = family_models[kind]
    llm = LLM(str(path), dtype="float32", progress=False, optimization_level=level,
              max_model_len=128, num_kv_blocks=BLOCKS[kind], long_prefill_token_threshold=32,
              attention_backend=backend)
    assert_exact_under_pressure(llm, PROMPTS, GREEDY, refs, compiled=level == 2)


def test_full_graphs_replay_windows_and_softcaps(family_models):
    """The Triton backend (interpreter) under FULL decode graphs (the CPU stand-in): each
    group's block tables and slot mappings are buffers refreshed in place, so replays
    keep Gemma 2's windows and softcaps exact. The two shortest prompts longer than the
    window, 6 tokens each (the interpreter is slow; hits and preemption are covered
    above)."""
    if interpreter_reason() is not None:
        pytest.skip(interpreter_reason())
    from kiln.config.compilation import CUDAGraphMode

    path, refs = family_models["gemma2"]
    llm = LLM(str(path), dtype="float32", progress=False, optimization_level=2,
              max_model_len=128, long_prefill_token_threshold=32, attention_backend="triton",
              compilation={"backend": "eager", "graph_backend": "cpu_test",
                           "cudagraph_capture_sizes": [1, 2]})
    runner = llm.engine.runner
    assert runner.dispatcher.mode is CUDAGraphMode.FULL_AND_PIECEWISE
    picks = sorted((i for i, p in enumerate(PROMPTS) if len(p) > WINDOW),
                   key=lambda i: len(PROMPTS[i]))[:2]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in picks], params,
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [refs[i][:6] for i in picks]
    assert runner.graph_wrappers[-1].num_replays > 0  # decode steps ran as FULL graphs


def test_hybrid_features_without_support_are_start_up_errors(family_models):
    path = str(family_models["gemma2"][0])
    with pytest.raises(ValueError, match="kv_transfer_config"):
        LLM(path, progress=False, optimization_level=0,
            kv_transfer_config={"kv_connector": "disk", "kv_role": "kv_both",
                                "kv_connector_extra_config": {"path": "/tmp/unused"}})
    with pytest.raises(ValueError, match="speculative_config.method='draft_model'"):
        LLM(path, progress=False, optimization_level=0,
            speculative_config={"method": "draft_model", "model": path,
                                "num_speculative_tokens": 2})


def test_gemma3_style_cache_holds_under_30_percent_at_4k():
    """A 5:1 local:global model with a 512-token window at 4,096 tokens of context holds
    at most 30% of the blocks a full-attention cache would (both measured)."""
    result = measure_kv_blocks(context=4096, window=512, pattern=6, num_layers=6)
    print(f"\n5:1 model at 4k: hybrid {result['hybrid_layer_blocks']} layer-blocks, full "
          f"attention {result['full_layer_blocks']} ({result['ratio']:.1%})")
    assert result["ratio"] <= 0.30
