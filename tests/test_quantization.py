"""Quantized weights: the kernel formats against their dequantized reference, GGUF blocks
repacked bit for bit, config resolution and its errors, and end-to-end greedy parity of
int8 and GGUF models (tiny, float32) eager and compiled."""
from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import random_prompts
from kiln.compiler.counter import compilation_counter
from kiln.ops import cpu_kernels
from kiln.ops.linear import linear_quant, linear_quant_silu
from kiln.ops.quant_packing import (FP8, INT8, Q4, Q8, dequantize, int8_activations, pack_q4,
                                    pack_q4_bytes, pack_q8, quantize_fp8, quantize_int8,
                                    quantize_int8_groups, unpack_codes)
from kiln.quantization.gguf_weights import decode
from kiln.quantization.plan import DIRECT, PANEL, layer_panel_from, panel_from_times
from kiln.quantization.resolve import resolve_quantization
from test_gguf_convert import _tiny_model, write_tiny_gguf


def _random_weights(n: int, k: int, g: torch.Generator):
    return {
        INT8: quantize_int8(torch.randn(n, k, generator=g)),
        Q8: pack_q8(torch.randint(-127, 128, (n, k), generator=g),
                    torch.rand(n, k // 32, generator=g) * 0.1),
        Q4: pack_q4(torch.randint(0, 16, (n, k), generator=g),
                    torch.rand(n, k // 32, generator=g) * 0.1,
                    torch.randn(n, k // 32, generator=g) * 0.1),
    }


def _int8_activation_kernel(fmt: int, dtype: torch.dtype, panel: bool) -> bool:
    """Whether this build's kernel quantizes x to int8 (bf16 x, direct kernel: Q4 on the
    AVX512-BF16 and AVX2 classes, Q8 on the VNNI ones)."""
    on = {Q4: cpu_kernels.q4_int8_activations(), Q8: cpu_kernels.q8_int8_activations()}
    return dtype == torch.bfloat16 and not panel and on.get(fmt, False)


@pytest.mark.usefixtures("cpu_kernels_loaded")
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (80, 64), (832, 576)])
def test_kernel_matches_dequantize_then_matmul(n, k):
    """Every format, both kernels (direct, panel), fp32 and bf16 activations, row
    counts and partial tiles, with and without bias. Where the kernel quantizes x to
    int8, the reference takes the same activations (`int8_activations`)."""
    g = torch.Generator().manual_seed(n + k)
    for fmt, w in _random_weights(n, k, g).items():
        ref_w = dequantize(w)
        for m in (1, 3, 5, 6, 8, 17, 33):  # 5..8: the tall direct tile
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, generator=g).to(dtype)
                bias = torch.randn(n, generator=g)
                for b, panel_from in itertools.product((None, bias), (0, 1)):
                    xr = (int8_activations(x) if _int8_activation_kernel(fmt, dtype, panel_from > 0)
                          else x.float())
                    ref = F.linear(xr, ref_w, b)
                    out = linear_quant(x, w.codes, w.scales, w.mins, b, fmt, panel_from)
                    assert out.dtype == dtype and out.shape == (m, n)
                    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    # fp32: summation order only; bf16: the output's rounding
                    assert err < (2e-6 if dtype == torch.float32 else 1e-2), \
                        (fmt, m, dtype, panel_from, err)


@pytest.mark.usefixtures("cpu_kernels_loaded")
@pytest.mark.parametrize("inter,k", [(48, 96), (1536, 576)])  # 48: three gate blocks
def test_fused_gate_up_activation_is_the_same_bits_as_two_steps(inter, k):
    """linear_quant_silu (the activation in the native-bf16 panel's epilogue, on tiles
    or in registers; the two steps elsewhere) equals linear_quant followed by
    silu_and_mul exactly, for every format, on both kernels and at partial row tiles."""
    g = torch.Generator().manual_seed(inter + k)
    for fmt, w in _random_weights(2 * inter, k, g).items():
        for m, panel_from in itertools.product((1, 17, 70, 300), (0, 1)):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            want = torch.ops.kiln_cpu.silu_and_mul(
                linear_quant(x, w.codes, w.scales, w.mins, None, fmt, panel_from))
            got = linear_quant_silu(x, w.codes, w.scales, w.mins, fmt, panel_from)
            assert torch.equal(got, want), (fmt, m, panel_from)


def test_prefill_rows_keep_exact_activations_where_the_direct_kernel_quantizes_them():
    """A tuning table that finds the direct kernel fastest at every row count gives
    panel_from 0; on the VNNI classes Q4 and Q8_0 layers still take the panel (exact bf16
    activations) from 64 rows, and the table's choice stands below that and elsewhere."""
    times = {rows: {DIRECT: 1.0, PANEL: 2.0} for rows in (1, 8, 32, 128)}
    assert panel_from_times(times) == 0
    for isa in ("avx512_bf16", "amx"):
        assert layer_panel_from(Q4, 0, isa) == layer_panel_from(Q8, 0, isa) == 64
        assert layer_panel_from(Q4, 128, isa) == 64
        assert layer_panel_from(Q8, 16, isa) == 16
        assert layer_panel_from(INT8, 0, isa) == 0  # exact fp32 FMAs: nothing to keep
    assert layer_panel_from(Q4, 0, "avx2") == 0  # AVX2's measured choice
    assert layer_panel_from(Q4, None, "avx512_bf16") == 64
    assert layer_panel_from(Q4, None, "amx") == layer_panel_from(Q8, None, "amx") == 32
    assert layer_panel_from(INT8, None, "amx") == 8
    times[128] = {DIRECT: 3.0, PANEL: 2.0}  # the panel wins at the top only
    assert panel_from_times(times) == 128


def test_int8_quantization_error_is_at_most_half_a_step():
    # Seeded: a value within fp32 rounding of a half step can land a few 1e-7 past the
    # bound below, and an unseeded draw inherits whatever RNG state the worker left.
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.linspace(0.01, 3, 64)[:, None]
    w[3] = 0  # an all-zero row keeps a usable scale
    q = quantize_int8(w)
    assert (dequantize(q) - w).abs().le(q.scales[:, None] / 2 + 1e-7).all()
    assert unpack_codes(q).abs().max() == 127
    assert dequantize(q)[3].eq(0).all()
    g = quantize_int8_groups(w)  # a scale per 32 columns: at most half of each group's step
    step = (w.view(64, 3, 32).abs().amax(-1) / 127).repeat_interleave(32, dim=1)
    assert (dequantize(g) - w).abs().le(step * 0.51 + 1e-7).all()
    assert (dequantize(g) - w).abs().mean() < (dequantize(q) - w).abs().mean()
    f = quantize_fp8(w)  # e4m3: 3 mantissa bits, so within 2^-4 of each value's magnitude
    assert (dequantize(f) - w).abs().le(w.abs() / 16 + f.scales[:, None] * 2 ** -9).all()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_repack_bit_for_bit(qtype):
    """kiln's repacked weight dequantizes to exactly what gguf's reference gives."""
    rng = np.random.default_rng(0)
    array = rng.standard_normal((48, 96)).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    blocks = gguf.quants.quantize(array, t)
    tensor = SimpleNamespace(tensor_type=t, data=blocks)
    codes, d, m = decode(tensor)
    q, dt = torch.from_numpy(codes), torch.from_numpy(d)
    w = pack_q8(q, dt) if m is None else pack_q4(q, dt, torch.from_numpy(m))
    expected = gguf.quants.dequantize(blocks, t).reshape(48, 96)
    np.testing.assert_array_equal(dequantize(w).numpy(), expected)
    if m is not None:  # the load's path: the file's bytes repacked without unpacking
        qs, _, _ = decode(tensor, q4_bytes=True)
        direct = pack_q4_bytes(torch.from_numpy(qs), dt, torch.from_numpy(m))
        assert all(torch.equal(a, b) for a, b in ((direct.codes, w.codes),
                                                  (direct.scales, w.scales),
                                                  (direct.mins, w.mins)))


def test_resolution_and_conflicts(tmp_path: Path, tiny_models):
    path, _ = tiny_models["llama"]
    assert resolve_quantization(None, path, None).method is None
    assert resolve_quantization("int8", path, None).method == "int8"
    with pytest.raises(ValueError, match="quantization='gguf' needs a quantized .gguf"):
        resolve_quantization("gguf", path, None)
    gguf_file = write_tiny_gguf(_tiny_model(tied=True, rope={"rope_theta": 1e4,
                                                             "rope_type": "default"}),
                                tmp_path / "q.gguf", tokenizer=False,
                                types={"attn_q": "Q4_1"})
    qc = resolve_quantization(None, path, gguf_file)
    assert (qc.method, qc.gguf_types["Q4_1"]) == ("gguf", 2)
    assert resolve_quantization("none", path, gguf_file).method is None
    with pytest.raises(ValueError, match=r"quantization='int8' conflicts with the GGUF file "
                                         r"q\.gguf .*already gguf-quantized"):
        resolve_quantization("int8", path, gguf_file)
    bad = tmp_path / "awq"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"quantization_config":
                                                 {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match="quant_method='awq' .* is not supported"):
        resolve_quantization(None, bad, None)
    from kiln import LLM

    with pytest.raises(ValueError, match="quantization='fp8' does not run on cpu"):
        LLM(str(path), quantization="fp8", optimization_level=0, progress=False)
    with pytest.raises(ValueError, match="quantization='fp4' must be one of"):
        from kiln.config.engine import EngineConfig

        EngineConfig(quantization="fp4")


def _greedy(llm, prompts, n=12):
    from kiln import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p}
                                                          for p in prompts], params,
                                                         use_tqdm=False)]


def _write_dequantized(src: Path, dst: Path, quantize, skip: str | None = None) -> None:
    """The same checkpoint with every linear weight replaced by dequant(quantize(w)),
    but those whose names contain `skip` (what kiln leaves in float)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    state = load_file(str(src / "model.safetensors"))
    for name, t in state.items():
        if t.dim() == 2 and "embed_tokens" not in name and (skip is None or skip not in name):
            state[name] = dequantize(quantize(t))
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.usefixtures("cpu_kernels_loaded")
@pytest.mark.parametrize("method,quantize,fmt,levels", [
    ("int8", quantize_int8_groups, Q8, (0, 2)), ("int8-channel", quantize_int8, INT8, (0,))])
def test_int8_matches_dequantized_int8_weights(tiny_models, tmp_path, method, quantize, fmt,
                                               levels):
    from kiln import LLM

    path, _ = tiny_models["qwen2"]  # qkv bias: the kernel adds it
    ref_dir = tmp_path / "dequantized"
    _write_dequantized(path, ref_dir, quantize)
    prompts = random_prompts(3, [5, 19, 40], seed=3)
    kw = dict(dtype="float32", progress=False, max_model_len=128)
    want = _greedy(LLM(str(ref_dir), optimization_level=0, **kw), prompts)
    llm = LLM(str(path), optimization_level=0, quantization=method, **kw)
    assert llm.engine.quantization.method == method
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.qfmt == fmt and qkv.qcodes.dtype == torch.int8 and qkv.weight.numel() == 0
    assert _greedy(llm, prompts) == want
    if 2 not in levels:
        return
    llm = LLM(str(path), optimization_level=2, quantization=method, **kw)
    before = compilation_counter.clone()
    assert _greedy(llm, prompts) == want
    assert compilation_counter.delta(before)["num_graphs_seen"] == 0  # nothing recompiled


@pytest.mark.usefixtures("cpu_kernels_loaded")
def test_gguf_native_matches_dequantized_file_eager_and_compiled(tmp_path, monkeypatch,
                                                                 caplog):
    """A tiny GGUF with Q4_1, Q4_0 and Q8_0 linears (and an lm_head whose 268 rows the
    kernel cannot tile, stated with a warning) runs natively == dequantized at load."""
    from kiln import LLM

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    model = _tiny_model(tied=True, rope={"rope_theta": 1e4, "rope_type": "default"})
    types = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_0",
             "ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q4_1", "token_embd": "Q8_0"}
    path = write_tiny_gguf(model, tmp_path / "tiny.gguf", tokenizer=False, types=types)
    prompts = random_prompts(3, [4, 17, 33], vocab=268, seed=5)
    kw = dict(dtype="float32", progress=False, max_model_len=128)
    want = _greedy(LLM(str(path), optimization_level=0, quantization="none", **kw), prompts)
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(path), optimization_level=0, **kw)
    assert "shape (268, 64)" in caplog.text  # the lm_head's stated fallback
    layers = llm.engine.runner.model.model.layers[0]
    assert (layers.self_attn.qkv_proj.qfmt, layers.self_attn.o_proj.qfmt,
            layers.mlp.gate_up_proj.qfmt) == (Q4, Q4, Q8)
    assert _greedy(llm, prompts) == want
    assert _greedy(LLM(str(path), optimization_level=2, **kw), prompts) == want


def test_triton_dequant_gemm_matches_reference_in_the_interpreter():
    """The CUDA kernel, run by Triton's interpreter on CPU tensors: every format, FP8
    (float8 e4m3, CUDA only) included."""
    from kiln.ops.triton_runtime import interpreter_reason

    reason = interpreter_reason()
    if reason is not None:
        pytest.skip(reason)
    from kiln.ops.triton_quant import linear_quant_cuda

    g = torch.Generator().manual_seed(7)
    weights = _random_weights(48, 96, g)
    weights[FP8] = quantize_fp8(torch.randn(48, 96, generator=g))
    for fmt, w in weights.items():
        x = torch.randn(5, 96, generator=g)
        bias = torch.randn(48, generator=g)
        out = linear_quant_cuda(x, w.codes, w.scales, w.mins, bias, fmt)
        ref = F.linear(x, dequantize(w), bias)
        assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4), (fmt, (out - ref).abs().max())


W8A16 = {"quant_method": "compressed-tensors", "format": "int-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                       "weights": {"num_bits": 8, "type": "int",
                                                   "symmetric": True, "strategy": "channel"}}},
         "ignore": ["lm_head"]}


@pytest.mark.usefixtures("cpu_kernels_loaded")
def test_prequantized_w8a16_checkpoint_loads_as_int8(tiny_models, tmp_path):
    """A compressed-tensors W8A16 checkpoint (int8 weights + per-channel weight_scale,
    lm_head left float) runs as int8-channel == its dequantized float twin, and
    `--quantization none` dequantizes it at load."""
    from safetensors.torch import load_file, save_file

    from kiln import LLM

    src, _ = tiny_models["llama"]
    pre, twin = tmp_path / "w8a16", tmp_path / "twin"
    for d in (pre, twin):
        d.mkdir()
        for f in src.iterdir():
            if f.suffix != ".safetensors":
                (d / f.name).write_bytes(f.read_bytes())
    state = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, t in state.items():
        if t.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name:
            q = quantize_int8(t)
            codes = unpack_codes(q).to(torch.int8)
            quantized[name], quantized[name + "_scale"] = codes, q.scales[:, None]
            dequantized[name] = dequantize(q)
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, str(pre / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(twin / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((pre / "config.json").read_text())
    (pre / "config.json").write_text(json.dumps({**config, "quantization_config": W8A16}))
    prompts = random_prompts(2, [6, 21], seed=11)
    kw = dict(dtype="float32", progress=False, max_model_len=128, optimization_level=0)
    want = _greedy(LLM(str(twin), **kw), prompts)
    llm = LLM(str(pre), **kw)
    assert llm.engine.quantization.method == "int8-channel"
    model = llm.engine.runner.model
    assert model.model.layers[1].mlp.down_proj.qfmt == INT8
    assert not model.lm_head.quant_method.quantized  # the checkpoint's ignore list holds
    assert _greedy(llm, prompts) == want
    assert _greedy(LLM(str(pre), quantization="none", **kw), prompts) == want
    with pytest.raises(ValueError, match="quantization='int8' conflicts with .*config.json"):
        LLM(str(pre), quantization="int8", **kw)
