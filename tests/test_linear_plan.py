"""Per-layer linear kernel plans: the tuning table's winners applied at start-up."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.models.packing import pack_linears, plan_signature
from kiln.ops.linear import linear, pack
from kiln.ops.linear_plan import (AMX_FROM_DEFAULT, DEFAULT, LinearPlan, amx_from_times,
                                  plan_from_times, plans_from_table)


def times(**rows_to_winner: str) -> dict[int, dict[str, float]]:
    """{rows: {candidate: us}} where the named candidate is the faster one."""
    out = {}
    for rows, win in rows_to_winner.items():
        us = {"kiln-packed": 2.0, "F.linear": 2.0, "onednn-prepacked": 0.1}
        us[win] = 1.0
        out[int(rows.removeprefix("r"))] = us
    return out


def test_plan_from_times_switches_where_dense_keeps_winning():
    assert plan_from_times({}) == DEFAULT
    assert plan_from_times(times(r1="kiln-packed", r512="kiln-packed")) == LinearPlan(True, 0)
    assert plan_from_times(times(r1="F.linear", r64="F.linear")) == LinearPlan(pack=False)
    # F.linear wins from 128 rows on: the plain weight takes over there.
    plan = plan_from_times(times(r1="kiln-packed", r32="F.linear", r64="kiln-packed",
                                 r128="F.linear", r512="F.linear"))
    assert plan == LinearPlan(True, 128)
    # Candidates the engine cannot run never decide (onednn-prepacked is fastest above).
    assert "F.linear" in plan.describe() and "128" in plan.describe()


def test_plans_from_table_reads_linear_entries_per_shape_and_dtype():
    def entry(packed_us: float, dense_us: float) -> dict:
        return {"best": "?", "config": None,
                "us": {"kiln-packed": packed_us, "F.linear": dense_us}}

    entries = {"rows=1,n=64,k=32,dtype=bfloat16": entry(1, 5),
               "rows=256,n=64,k=32,dtype=bfloat16": entry(9, 5),
               "rows=1,n=96,k=64,dtype=bfloat16": entry(1, 5),
               "rows=1,n=64,k=32,dtype=float32": entry(9, 1),
               "garbage": entry(1, 1)}
    plans = plans_from_table(entries, torch.bfloat16)
    assert plans == {(64, 32): LinearPlan(True, 256), (96, 64): LinearPlan(True, 0)}


def test_amx_from_is_where_tiles_stop_losing_over_all_shapes():
    def us(tiles: float, regs: float) -> dict[str, float]:
        return {"kiln-packed": tiles, "kiln-packed-regs": regs, "F.linear": 0.1}

    assert amx_from_times({}) == AMX_FROM_DEFAULT
    assert amx_from_times({(64, 32): {1: {"kiln-packed": 1.0}}}) == AMX_FROM_DEFAULT
    # Summed over shapes: at 2 rows the second shape's loss outweighs the first's gain.
    times = {(64, 32): {1: us(12, 10), 2: us(10, 12), 4: us(5, 20), 16: us(5, 50)},
             (96, 64): {1: us(30, 20), 2: us(40, 20), 4: us(8, 30), 16: us(9, 90)}}
    assert amx_from_times(times) == 4
    # A loss above a win pushes the switch above it; registers winning at the top: never.
    times[(96, 64)][16] = us(900, 90)
    assert amx_from_times(times) == 17


@pytest.mark.usefixtures("cpu_kernels_loaded")
def test_dense_from_switches_kernel_by_row_count():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(48, generator=g).to(torch.bfloat16)
    for m in (1, 7, 8, 20):
        x = torch.randn(m, 64, generator=g).to(torch.bfloat16)
        got = linear(x, w, b, pack(w), dense_from=8)
        if m >= 8:  # exactly PyTorch's GEMM on the plain weight
            assert torch.equal(got, F.linear(x, w, b))
        else:
            ref = F.linear(x.float(), w.float(), b.float())
            assert (got.float() - ref).abs().max() / ref.abs().max() < 1e-2


@pytest.mark.usefixtures("cpu_kernels_loaded")
def test_pack_linears_applies_plans_and_keys_them(tiny_models):
    from kiln.models.loader import build_model
    from kiln.models.model_config import ModelConfig

    path, _ = tiny_models["llama"]
    mc = ModelConfig.from_pretrained(path)

    def built(plans):
        model = build_model(mc, torch.bfloat16, torch.device("cpu"), progress=False)
        pack_linears(model, plans)
        return model

    qkv_shape = ((mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim, mc.hidden_size)
    default = built(None)
    attn = default.model.layers[0].self_attn
    plans = {qkv_shape: LinearPlan(True, 16),
             (mc.hidden_size, mc.num_heads * mc.head_dim): LinearPlan(pack=False)}
    planned = built(plans)
    qkv = planned.model.layers[0].self_attn.qkv_proj
    assert qkv.packed_weight is not None and qkv.dense_from == 16
    assert qkv.weight.shape == qkv_shape  # kept: F.linear runs on it from 16 rows
    o = planned.model.layers[0].self_attn.o_proj
    assert o.packed_weight is None and o.weight.numel() > 0
    assert attn.qkv_proj.weight.numel() == 0  # the default plan frees the plain copy
    sigs = {plan_signature(default), plan_signature(planned)}
    assert len(sigs) == 2 and None not in sigs
    # Same checkpoint, other kernels: the same outputs up to bf16 rounding.
    x = torch.randn(20, mc.hidden_size).to(torch.bfloat16)
    for name in ("qkv_proj", "o_proj"):
        a = getattr(default.model.layers[0].self_attn, name)(x).float()
        b = getattr(planned.model.layers[0].self_attn, name)(x).float()
        assert (a - b).abs().max() / a.abs().max() < 2e-2, name
