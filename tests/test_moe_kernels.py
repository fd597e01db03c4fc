"""The fused-MoE op's kernels: kiln's packed CPU path (and the tuning table's plan for
it) and the Triton kernel for CUDA (in Triton's interpreter), each against the grouped
loop over the plain weights."""
from __future__ import annotations

import pytest
import torch
import transformers

from conftest import TINY
from kiln.models.packing import plan_signature
from kiln.moe.cpu_plan import moe_key, pack_expert_weights, pack_experts, plans_from_table
from kiln.moe.op import fused_moe, grouped_experts, route
from kiln.ops.linear_plan import LinearPlan

BF16_TOL = 2e-2  # relative to the output's largest magnitude


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    config = transformers.MixtralConfig(**dict(TINY, intermediate_size=96),
                                        num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def moe_inputs(T: int, E: int, H: int, inter: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g).to(dtype)
    logits[:, 0] = -30.0  # expert 0 never chosen: its run is empty
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) * inter ** -0.5).to(dtype)
    return x, logits, w13, w2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.usefixtures("cpu_kernels_loaded")
@pytest.mark.parametrize("T", [1, 7, 40])
def test_packed_experts_match_the_plain_weights_and_dense_from_switches(T):
    x, logits, w13, w2 = moe_inputs(T, 6, 64, 96, torch.bfloat16, seed=T)
    p13, p2 = pack_expert_weights(w13), pack_expert_weights(w2)
    plain = fused_moe(x, logits, w13, w2, 2, True)
    exact = fused_moe(x.float(), logits.float(), w13.float(), w2.float(), 2, True)
    assert rel_err(fused_moe(x, logits, w13, w2, 2, True, p13, p2, 0), exact) < BF16_TOL
    # From dense_from tokens on the plain weights run: exactly the plain path.
    switched = fused_moe(x, logits, w13, w2, 2, True, p13, p2, 7)
    if T >= 7:
        assert torch.equal(switched, plain)
    else:
        assert rel_err(switched, exact) < BF16_TOL


@pytest.mark.usefixtures("cpu_kernels_loaded")
def test_packed_experts_compile_into_one_graph():
    x, logits, w13, w2 = moe_inputs(9, 4, 32, 64, torch.bfloat16)
    p13, p2 = pack_expert_weights(w13), pack_expert_weights(w2)
    empty = w13.new_empty(0)  # released plain weights, as pack_experts leaves them
    # aot_eager: the fake's shapes with the packed arguments; the engine test below
    # compiles them with Inductor.
    f = torch.compile(lambda a, b: fused_moe(a * 2, b, empty, empty, 2, True, p13, p2, 0),
                      fullgraph=True, backend="aot_eager", dynamic=True)
    want = fused_moe(x * 2, logits, w13, w2, 2, True, p13, p2, 0)
    assert torch.equal(f(x, logits), want)


def test_moe_plans_from_table_read_fused_moe_entries_per_shape_and_dtype():
    def entry(packed_us: float, dense_us: float) -> dict:
        return {"best": "?", "config": None,
                "us": {"kiln-packed": packed_us, "F.linear": dense_us}}

    shape = (8, 2, 64, 96)
    entries = {moe_key(1, shape, torch.bfloat16): entry(1, 5),
               moe_key(64, shape, torch.bfloat16): entry(9, 5),
               moe_key(1, (4, 2, 64, 32), torch.bfloat16): entry(5, 1),
               moe_key(1, shape, torch.float32): entry(9, 1), "garbage": entry(1, 1)}
    assert plans_from_table(entries, torch.bfloat16) == {
        shape: LinearPlan(True, 64), (4, 2, 64, 32): LinearPlan(pack=False)}


@pytest.mark.usefixtures("cpu_kernels_loaded")
def test_pack_experts_applies_plans_and_keys_them(mixtral):
    from kiln.models.loader import build_model
    from kiln.models.model_config import ModelConfig

    mc = ModelConfig.from_pretrained(mixtral)
    shape = (4, 2, mc.hidden_size, 96)

    def built(plans):
        model = build_model(mc, torch.bfloat16, torch.device("cpu"), progress=False)
        torch.manual_seed(0)
        for p in model.parameters():
            p.data.normal_(0, 0.1)
        reference = [b.mlp.experts.w13.detach().clone() for b in model.model.layers]
        return model, reference, pack_experts(model, plans)

    packed, ref, log = built(None)
    ex = packed.model.layers[0].mlp.experts
    assert len(log) == mc.num_layers and ex.w13_packed is not None
    assert ex.w13.numel() == 0 and ex.dense_from == 0  # the plain copy is released
    kept, _, _ = built({shape: LinearPlan(True, 32)})
    assert kept.model.layers[0].mlp.experts.w13.shape == ref[0].shape
    plain, _, log = built({shape: LinearPlan(pack=False)})
    assert log == [] and plain.model.layers[0].mlp.experts.w13_packed is None
    sigs = [plan_signature(m) for m in (packed, kept, plain)]
    assert len(set(sigs)) == 3
    x = torch.randn(20, mc.hidden_size).to(torch.bfloat16)
    outs = [m.model.layers[0].mlp(x) for m in (packed, kept, plain)]
    assert rel_err(outs[0], outs[2]) < BF16_TOL and rel_err(outs[1], outs[2]) < BF16_TOL


@pytest.mark.usefixtures("cpu_kernels_loaded")
def test_engine_packs_bf16_experts_and_compiles_them_once(mixtral, tmp_path, monkeypatch):
    """bf16 on a CPU: the runner packs the experts (no tuning table: the default) before
    tracing, and -O2's Inductor graph calls the packed path for every step's size."""
    from kiln import LLM, SamplingParams
    from kiln.compiler.counter import compilation_counter

    monkeypatch.setenv("KILN_TUNING_FILE", str(tmp_path / "none.json"))  # the default plan
    llm = LLM(str(mixtral), dtype="bfloat16", progress=False, optimization_level=2,
              max_model_len=128)
    ex = llm.engine.runner.model.model.layers[0].mlp.experts
    assert ex.w13_packed is not None and ex.w13.numel() == 0
    before = compilation_counter.clone()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 19)],
                        params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    assert not any(compilation_counter.delta(before).values())


@pytest.mark.parametrize("T,E,k", [(37, 6, 2), (1, 8, 2), (5, 4, 3)])
def test_triton_expert_kernel_matches_the_grouped_loop(T, E, k):
    """The CUDA path's kernel, in Triton's interpreter: odd sizes, experts without
    tokens, one decode token; the alignment pads every expert's run."""
    from kiln.moe.triton_moe import align_pairs, fused_experts_triton
    from kiln.ops.triton_runtime import interpreter_reason

    if interpreter_reason() is not None:
        pytest.skip(interpreter_reason())
    g = torch.Generator().manual_seed(T + E)
    H, inter = 24, 40
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    logits[:, 0] = -30.0  # expert 0 never chosen: its run is empty
    w13 = torch.randn(E, 2 * inter, H, generator=g) * 0.2
    w2 = torch.randn(E, H, inter, generator=g) * 0.2
    weights, experts = route(logits, k, True)
    pairs, block_experts = align_pairs(experts, E)
    real = pairs[pairs < T * k]
    assert sorted(real.tolist()) == list(range(T * k))  # every pair exactly once
    flat = experts.reshape(-1)
    for b, e in enumerate(block_experts.tolist()):  # a block's pairs share its expert
        rows = pairs[b * 16:(b + 1) * 16]
        assert (flat[rows[rows < T * k].long()] == e).all()
    got = fused_experts_triton(x, weights, experts, w13, w2)
    torch.testing.assert_close(got, grouped_experts(x, weights, experts, w13, w2),
                               rtol=1e-5, atol=1e-5)
