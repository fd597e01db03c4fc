"""Multi-LoRA: token parity with transformers + peft (float32), batches mixing adapters
and the base model, slots and the CPU cache under eviction, no recompiles at -O2,
separate prefix caches per adapter, and every failure fails alone.

Cost: the tiny engines at -O0 start in about a second; the one -O2 engine compiles the
tiny model once (about 30 s cold); SmolLM2 runs at -O0 with the session's reference model.
"""
from __future__ import annotations

import pytest
import torch
import transformers
from conftest import TINY, random_prompts
from lora_utils import ALL, make_adapter, peft_greedy

from kiln import LLM, LoRARequest, SamplingParams
from kiln.compiler.counter import compilation_counter

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory) -> dict[str, tuple[LoRARequest, object]]:
    """Three adapters on the tiny Llama: partial and full targets, rsLoRA, an
    alpha_pattern that gives q and k different scalings inside the fused qkv, a .bin."""
    _, base = tiny_models["llama"]
    root = tmp_path_factory.mktemp("lora")
    specs = {
        "a1": dict(r=4, targets=["q_proj", "v_proj", "down_proj"], seed=1),
        "a2": dict(r=8, targets=ALL, seed=2, use_rslora=True),
        "a3": dict(r=2, targets=["q_proj", "k_proj", "gate_proj", "up_proj"], seed=3,
                   alpha_pattern={"k_proj": 7}, safetensors=False),
    }
    out = {}
    for i, (name, spec) in enumerate(specs.items(), start=1):
        spec = dict(spec)
        r, targets, seed = spec.pop("r"), spec.pop("targets"), spec.pop("seed")
        model = make_adapter(base, root / name, r, targets, seed, **spec)
        out[name] = (LoRARequest(name, i, str(root / name)), model)
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    shared = random_prompts(1, [20], seed=7)[0]  # one shared prefix: prefix-cache hits
    return [shared + p for p in random_prompts(4, [3, 9, 14, 5], seed=8)]


@pytest.fixture(scope="module")
def references(tiny_models, adapters, prompts) -> dict[str | None, list[list[int]]]:
    refs = {None: peft_greedy(tiny_models["llama"][1], prompts, GREEDY.max_tokens)}
    for name, (_, model) in adapters.items():
        refs[name] = peft_greedy(model, prompts, GREEDY.max_tokens)
    return refs


def tiny_llm(tiny_models, level: int = 0, **kw) -> LLM:
    args = dict(dtype="float32", optimization_level=level, progress=False,
                enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=8)
    return LLM(str(tiny_models["llama"][0]), **{**args, **kw})


def run(llm: LLM, prompts: list[list[int]], loras: list) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                        lora_request=loras, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs]


# ---- the op --------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["torch", "cpu_kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_op_matches_a_per_token_loop(impl, dtype, request):
    """Mixed slots, base rows (-1) and a rank padded with zeros, in every code path: one
    slot for every token, the mix, none; and for kiln's C++ op the per-token loops (few
    rows) and the per-slot GEMMs (600 rows)."""
    op = torch.ops.kiln.lora_add_
    if impl == "cpu_kernel":
        request.getfixturevalue("cpu_kernels_loaded")
        op = torch.ops.kiln_cpu.lora_add_
    g = torch.Generator().manual_seed(0)
    S, NR, d_in, d_out = 3, 6, 40, 72  # 72 columns: one 64-wide block and a ragged one
    a = torch.randn(S * NR, d_in, generator=g)
    b = torch.randn(S * NR, d_out, generator=g)  # B^T
    a[NR - 2:NR] = 0  # slot 0 has rank 4 of 6
    scaling = torch.tensor([0.5, 2.0, 1.5])
    mixed = [2, -1, 0, 0, 1, -1, 2, 2, 1]
    for T, idx in ((9, mixed), (9, [1] * 9), (9, [-1] * 9), (600, mixed * 66 + [1] * 6)):
        x, y = torch.randn(T, d_in, generator=g), torch.randn(T, d_out, generator=g)
        indices = torch.tensor(idx + [-1, -1])  # entries past T are never read
        want = y.clone()
        for t, s in enumerate(idx):
            if s >= 0:
                A, Bt = a[s * NR:(s + 1) * NR], b[s * NR:(s + 1) * NR]
                want[t] += scaling[s] * (Bt.t() @ (A @ x[t]))
        got = y.to(dtype)
        op(got, x.to(dtype), a.to(dtype), b.to(dtype), scaling, indices)
        # bf16: a few roundings of values up to max|want| (h, the update, the sum)
        atol = 1e-4 if dtype == torch.float32 else 2e-2 * want.abs().max().item()
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=1e-4)


def test_scheduler_runs_no_more_adapters_than_slots():
    """Two slots, requests for adapters 1, 2, 3 and the base model: adapter 3 waits (the
    base request behind it still starts), and runs once adapter 1's request finishes."""
    from test_scheduler import fake_run, make_scheduler

    from kiln.request import Request

    sched = make_scheduler()
    sched.max_loras = 2
    loras = [LoRARequest(f"a{i}", i, "/unused") for i in (1, 2, 3)]
    for rid, lora, n in (("r1", loras[0], 1), ("r2", loras[1], 6), ("r3", loras[2], 6),
                         ("base", None, 6)):
        sched.add_request(Request(rid, [5] * 4, SamplingParams(temperature=0, max_tokens=n),
                                  lora_request=lora))
    so = sched.schedule()
    assert [r.req_id for r in so.scheduled_new_reqs] == ["r1", "r2", "base"]
    assert [r.lora_request for r in so.scheduled_new_reqs] == [loras[0], loras[1], None]
    fake_run(sched, so)  # r1 reaches max_tokens=1 and finishes
    so = sched.schedule()
    assert [r.req_id for r in so.scheduled_new_reqs] == ["r3"]


# ---- parity, mixing, slots --------------------------------------------------------------
def test_mixed_batch_matches_peft_under_eviction_and_preemption(tiny_models, adapters,
                                                               prompts, references):
    """Three adapters and the base model in one generate call with two slots and a CPU
    cache of two: the scheduler holds back the third adapter, slots and cached adapters
    are evicted and reloaded, a small KV cache preempts; every output equals transformers
    + peft, and each adapter really changes the tokens."""
    llm = tiny_llm(tiny_models, num_kv_blocks=10, max_model_len=64)
    names = [None, "a1", "a2", "a3"]
    batch = [(p, n) for n in names for p in prompts]
    got = run(llm, [p for p, _ in batch], [adapters[n][0] if n else None for _, n in batch])
    want = [references[n][prompts.index(p)] for p, n in batch]
    assert got == want
    for n in names[1:]:
        assert references[n] != references[None], n
    report = llm.engine.executor.collective_rpc("lora_report")[0]
    assert report["slot_writes"] >= 3 and len(report["slots"]) <= 2
    assert llm.engine.get_stats().num_preemptions > 0
    assert dict(llm.engine.loras.request_counts) == {"a1": 4, "a2": 4, "a3": 4}


def test_each_adapter_alone_equals_its_place_in_a_mix(tiny_models, adapters, prompts,
                                                       references):
    """One request per adapter at a time (slots reused), then all four sharing a step
    (four slots): identical tokens. Two adapters on one prompt never share KV: the second
    finds no prefix-cache hit, a repeat of the first does."""
    llm = tiny_llm(tiny_models, max_loras=4, max_cpu_loras=4)
    p = prompts[2]
    stats = llm.engine.get_stats
    for name in ("a1", "a2", "a3"):
        hits = stats().prefix_cache_hits
        assert run(llm, [p], [adapters[name][0]]) == [references[name][2]]
        assert stats().prefix_cache_hits == hits, f"{name} reused another adapter's KV"
    hits = stats().prefix_cache_hits
    assert run(llm, [p], [adapters["a1"][0]]) == [references["a1"][2]]
    assert stats().prefix_cache_hits > hits
    mixed = run(llm, [p] * 4, [None] + [adapters[n][0] for n in ("a1", "a2", "a3")])
    assert mixed == [references[n][2] for n in (None, "a1", "a2", "a3")]
    # Unloaded, a1's id still means a1 (its KV stays cached under that id) ...
    assert llm.engine.remove_lora(1)
    a2 = adapters["a2"][0]
    out = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("a2", 1, a2.lora_path))
    assert "already names adapter 'a1'" in out[0].error
    # ... and a1 itself comes back from disk.
    assert run(llm, [p], [adapters["a1"][0]]) == [references["a1"][2]]


def test_swapping_adapters_at_o2_never_recompiles(tiny_models, adapters, prompts,
                                                  references):
    """One slot at -O2: every adapter change rewrites the slot in place. After start-up
    the compile counters do not move, and outputs keep parity. Dynamo's one trace, the
    split graph and its direct caller are what is under test, so the pieces run through
    the eager adaptor (a whole-model Inductor build costs 30 s of the suite); Inductor's
    side of the op is test_lora_op_under_inductor_follows_slots_in_place."""
    llm = tiny_llm(tiny_models, level=2, max_loras=1, max_cpu_loras=1,
                   compilation={"backend": "eager"})
    before = compilation_counter.clone()
    for name in ("a1", "a2", None, "a3", "a1"):
        lora = adapters[name][0] if name else None
        assert run(llm, prompts[:2], [lora, lora]) == references[name][:2], name
    assert not any(compilation_counter.delta(before).values())
    report = llm.engine.executor.collective_rpc("lora_report")[0]
    assert report["loads"] == 4  # a1 was evicted from the CPU cache of one and reloaded


@pytest.mark.parametrize("impl", ["kiln", "kiln_cpu"])
def test_lora_op_under_inductor_follows_slots_in_place(impl, request):
    """A linear plus the in-place LoRA op, compiled by Inductor with the slots and indices
    as buffers: Inductor functionalizes the mutation of the GEMM's output and re-inplaces
    it. Rewriting a slot and the indices in place changes the next call's result with no
    new trace, and it always equals eager."""
    if impl == "kiln_cpu":
        request.getfixturevalue("cpu_kernels_loaded")
    op = getattr(torch.ops, impl).lora_add_
    g = torch.Generator().manual_seed(1)

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("w", torch.randn(24, 16, generator=g))
            self.register_buffer("a", torch.randn(2 * 4, 16, generator=g))
            self.register_buffer("b", torch.randn(2 * 4, 24, generator=g))
            self.register_buffer("scaling", torch.tensor([0.5, 2.0]))
            self.register_buffer("indices", torch.full((64,), -1, dtype=torch.int64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x @ self.w.t()
            op(y, x, self.a, self.b, self.scaling, self.indices)
            return torch.relu(y)

    layer = Layer()
    compiled = torch.compile(layer, backend="inductor", fullgraph=True, dynamic=True)
    torch._dynamo.utils.counters.clear()
    for step, slots in enumerate(([-1] * 5, [0, 1, -1, 1, 0], [1] * 5)):
        layer.indices[:5] = torch.tensor(slots)
        layer.a[4:].copy_(torch.randn(4, 16, generator=g))  # slot 1 gets a new adapter
        x = torch.randn(5, 16, generator=g)
        torch.testing.assert_close(compiled(x), layer(x), atol=1e-5, rtol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_smollm2_with_an_adapter_matches_peft(smollm2_dir, smollm2_hf, tmp_path):
    adapter = make_adapter(smollm2_hf, tmp_path / "smol", 8,
                           ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"], seed=4,
                           b_scale=0.05)
    prompt = smollm2_hf.config.bos_token_id, 504, 3458, 282, 260, 2336, 314
    want = peft_greedy(adapter, [list(prompt)], 12)
    llm = LLM(str(smollm2_dir), dtype="float32", optimization_level=0, progress=False,
              enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": list(prompt)}] * 2, params, use_tqdm=False,
                       lora_request=[LoRARequest("smol", 1, str(tmp_path / "smol")), None])
    assert out[0].outputs[0].token_ids == want[0]
    assert out[1].outputs[0].token_ids != want[0]  # the base model differs


# ---- failures -----------------------------------------------------------------------------
def test_bad_adapters_fail_alone(tiny_models, adapters, prompts, references, tmp_path):
    """Each bad adapter fails its own request with a message naming the cause; the good
    request beside them runs."""
    _, base = tiny_models["llama"]
    make_adapter(base, tmp_path / "big", 16, ["q_proj"], seed=5)
    make_adapter(base, tmp_path / "head", 2, ["lm_head"], seed=5)
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**TINY, "intermediate_size": 96})).eval()
    make_adapter(other, tmp_path / "shape", 2, ["down_proj"], seed=5)
    bad = {"big": "over max_lora_rank=8", "head": "lacks or cannot adapt",
           "shape": "trained for another model", "missing": "missing adapter_config.json"}
    llm = tiny_llm(tiny_models)
    loras = [LoRARequest(n, i, str(tmp_path / n)) for i, n in enumerate(bad, start=10)]
    loras += [adapters["a1"][0], LoRARequest("a1-again", 1, "/elsewhere")]
    outs = llm.generate([{"prompt_token_ids": prompts[0]}] * len(loras), GREEDY,
                        lora_request=loras, use_tqdm=False)
    for out, fragment in zip(outs, bad.values()):
        assert out.error is not None and fragment in out.error, out.error
    assert outs[4].outputs[0].token_ids == references["a1"][0]
    assert "already names adapter 'a1'" in outs[5].error


def test_an_adapter_whose_files_vanish_after_it_was_added_fails_only_its_requests(
        tiny_models, adapters, prompts, references, tmp_path):
    """The engine checks an adapter's files when a request first names it; the worker
    reads them again when it makes the adapter resident. Gone by then, they fail that
    adapter's requests alone: the batch's other requests finish exactly, the engine
    serves on, and the next request naming the adapter is refused when it is added.
    The KV the failed rows wrote (without their adapter) reaches neither the prefix
    cache nor the disk tier, though a1 has the same files and so the same block keys."""
    import shutil

    from kiln.lora.request import LoRAError

    shutil.copytree(adapters["a1"][0].lora_path, tmp_path / "a1")
    doomed = LoRARequest("a1-copy", 9, str(tmp_path / "a1"))
    tier = {"kv_connector": "disk", "kv_role": "kv_both",
            "kv_connector_extra_config": {"path": str(tmp_path / "tier")}}
    llm = tiny_llm(tiny_models, kv_transfer_config=tier)
    engine = llm.engine
    engine.add_request("doomed", {"prompt_token_ids": prompts[0]}, GREEDY,
                       lora_request=doomed)
    engine.add_request("base", {"prompt_token_ids": prompts[1]}, GREEDY)
    engine.add_request("a2", {"prompt_token_ids": prompts[2]}, GREEDY,
                       lora_request=adapters["a2"][0])
    shutil.rmtree(tmp_path / "a1")
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert "LoRA adapter 9 could not be loaded" in finals["doomed"].error
    assert finals["base"].outputs[0].token_ids == references[None][1]
    assert finals["a2"].outputs[0].token_ids == references["a2"][2]
    with pytest.raises(LoRAError, match="missing adapter_config.json"):
        engine.add_request("again", {"prompt_token_ids": prompts[0]}, GREEDY,
                           lora_request=doomed)
    assert run(llm, prompts[:2], [adapters["a1"][0], None]) == \
        [references["a1"][0], references[None][1]]
    llm.engine.flush_kv_saves()
    llm.shutdown()
    fresh = tiny_llm(tiny_models, kv_transfer_config=tier)
    assert run(fresh, prompts[:1], [adapters["a1"][0]]) == [references["a1"][0]]
    assert fresh.engine.get_stats().kv_transfer.blocks_loaded > 0


def test_a_persistent_kv_tier_keys_blocks_by_the_adapters_files_not_their_ids(
        tiny_models, adapters, prompts, references, tmp_path):
    """A restarted engine may give an id to another adapter. The disk tier outlives the
    engine, so blocks are keyed by what an adapter's files hold: a2 under a1's old id
    reads none of a1's blocks, and a1 under a new id finds its own."""
    tier = {"kv_connector": "disk", "kv_role": "kv_both",
            "kv_connector_extra_config": {"path": str(tmp_path / "tier")}}
    a1, a2 = adapters["a1"][0], adapters["a2"][0]
    first = tiny_llm(tiny_models, kv_transfer_config=tier)
    assert run(first, prompts, [a1] * len(prompts)) == references["a1"]
    first.engine.flush_kv_saves()
    assert first.engine.get_stats().kv_transfer.blocks_saved > 0
    first.shutdown()
    again = tiny_llm(tiny_models, kv_transfer_config=tier)
    swapped = LoRARequest("a2", a1.lora_int_id, a2.lora_path)
    assert run(again, prompts, [swapped] * len(prompts)) == references["a2"]
    assert again.engine.get_stats().kv_transfer.blocks_loaded == 0
    moved = LoRARequest("a1", 7, a1.lora_path)
    assert run(again, prompts, [moved] * len(prompts)) == references["a1"]
    assert again.engine.get_stats().kv_transfer.blocks_loaded > 0


def test_lora_misconfiguration(tiny_models, adapters):
    path = str(tiny_models["llama"][0])
    with pytest.raises(ValueError, match="max_loras"):
        LLM(path, enable_lora=True, max_loras=0, progress=False)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(path, enable_lora=True, max_loras=2, max_cpu_loras=1, progress=False)
    with pytest.raises(ValueError, match="LoRARequest.lora_int_id"):
        LoRARequest("x", 0, "/p")
    llm = LLM(path, dtype="float32", optimization_level=0, progress=False)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False,
                       lora_request=adapters["a1"][0])
    assert "enable_lora=True" in out[0].error
