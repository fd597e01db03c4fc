"""kiln's C++ CPU kernels (kiln/ops/csrc) against PyTorch references.

Every path is exercised on hosts that can build the kernels: the AMX tiles and, with AMX
switched off for the test, the register-tiled kernel at every row count, in the build for
this host's ISA class (`vdpbf16ps` with AVX512-BF16, fp32 FMAs with plain AVX512 and with
AVX2; build another class with KILN_CPU_ISA=avx512 or avx2 on a better host). Without
AMX the tile variants run against emulated tiles (tests/test_amx_emulated.py).
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from attention_batches import make_batch, random_shapes, run_backend
from kiln.attention.backend import AttentionLayerSpec
from kiln.attention.backends.cpu_paged import CpuPagedBackend
from kiln.attention.backends.torch_paged import TorchPagedBackend
from kiln.attention.selector import select_backend
from kiln.models.layers import Linear, RotaryEmbedding
from kiln.models.packing import pack_linears
from kiln.ops import cpu_kernels, cpu_paths
from kiln.ops.linear import linear, linear_rope, linear_silu, pack
from kiln.platforms.cpu import host_isa, isa_class

pytestmark = pytest.mark.usefixtures("cpu_kernels_loaded")


@pytest.fixture(params=["amx", "no-amx"])
def amx(request, cpu_kernels_loaded):
    """Run a test with the AMX path, where the loaded kernels have it (an AMX host, or
    the emulated tiles: tests/test_amx_emulated.py), and without it."""
    on = request.param == "amx"
    if on and not cpu_paths.amx_active():
        pytest.skip("this CPU has no AMX")
    torch.ops.kiln_cpu.set_amx(on, 1)  # tiles at every row count
    yield on
    cpu_paths.set_amx_from(cpu_paths.amx_from())


def test_pack_layout_matches_its_definition():
    w = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).to(torch.bfloat16)
    wp = pack(w)
    assert wp.shape == (2, 2, 16, 32)
    for nb, kc, r, n, i in [(0, 0, 0, 0, 0), (1, 0, 3, 5, 1), (1, 1, 15, 15, 1), (0, 1, 7, 2, 0)]:
        assert wp[nb, kc, r, 2 * n + i] == w[16 * nb + n, 32 * kc + 2 * r + i]


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 33, 70])  # 5-8: tall tiles
# (32, 4096): x rows of 16 KiB, so the AVX2 panel kernel splits 33 and 70 rows into
# several row blocks; 33 and 70 also leave partial 6-row tiles.
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (80, 64), (832, 576), (32, 4096)])
def test_linear_packed_matches_fp32_reference(m, n, k, amx):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    for bias in (None, b):
        got = linear(x, w, bias, pack(w))
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        # bf16 output rounding (2^-8 relative) plus fp32 summation-order noise
        err = (got.float() - ref).abs().max() / ref.abs().max()
        assert err < 1e-2, f"relative error {err}"


# 3: one partial row tile; 6: the tall tiles (two steps); 17, 70: a partial second tile
@pytest.mark.parametrize("m", [1, 3, 6, 17, 70, 300])
@pytest.mark.parametrize("inter,k", [(48, 96), (1536, 576)])  # 48: three blocks a half
def test_fused_gate_up_activation_is_the_same_bits_as_two_steps(m, inter, k, amx):
    """linear_silu (SwiGLU's activation in the GEMM's epilogue, on tiles and in the
    register tiles) equals the packed linear followed by silu_and_mul exactly, and a
    Linear's silu_and_mul takes it only where the layer is the packed GEMM alone."""
    g = torch.Generator().manual_seed(m * 7 + inter + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(2 * inter, k, generator=g).to(torch.bfloat16)
    want = torch.ops.kiln_cpu.silu_and_mul(linear(x, w, None, pack(w)))
    got = linear_silu(x.view(1, m, k), w, pack(w)).view(m, inter)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    layer = Linear(k, 2 * inter, bias=False).to(torch.bfloat16)
    layer.weight.data.copy_(w)
    with torch.no_grad():  # unpacked: F.linear, then the activation
        assert torch.equal(layer.silu_and_mul(x),
                           torch.ops.kiln_cpu.silu_and_mul(F.linear(x, w)))
        layer.packed_weight = pack(w)
        assert torch.equal(layer.silu_and_mul(x), want)


@pytest.mark.parametrize("m", [1, 17, 70, 300])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (2, 1, 32)])
def test_qkv_gemm_with_rope_is_the_same_bits_as_two_steps(m, heads, kv_heads, head_dim, amx):
    """linear_rope (RoPE on q's and k's columns in the QKV GEMM's epilogue on tiles) equals
    the packed linear, bias included, followed by rotary_embedding exactly, V untouched; a
    position outside the cos / sin caches is refused on either path."""
    g = torch.Generator().manual_seed(m + heads * head_dim)
    n, k = (heads + 2 * kv_heads) * head_dim, 576
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    positions = torch.randint(0, 4096, (m,), generator=g)
    y = linear(x, w, b, pack(w))
    q, kk, v = y.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q, want_k = rope(positions, q.reshape(m, heads, head_dim),
                          kk.reshape(m, kv_heads, head_dim))
    got = linear_rope(x, w, b, pack(w), 0, positions, rope.cos, rope.sin,
                      (heads + kv_heads) * head_dim)
    got_q, got_k, got_v = got.split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    assert torch.equal(got_q.reshape(want_q.shape), want_q)
    assert torch.equal(got_k.reshape(want_k.shape), want_k)
    assert torch.equal(got_v, v)
    with pytest.raises(RuntimeError, match="position 4096 outside the cache of 4096"):
        linear_rope(x, w, b, pack(w), 0, torch.full((m,), 4096), rope.cos, rope.sin,
                    (heads + kv_heads) * head_dim)


@pytest.mark.parametrize("kind", ["plain", "silu", "rope"])
def test_each_rows_bits_do_not_depend_on_how_the_gemm_splits_its_work(kind, amx):
    """From 256 rows a thread the tiles' GEMM gives each thread a share of the rows (its x
    rows in its own L2) instead of a share of the columns (linear_bf16_amx.h,
    kRowSplitRows). 600 rows on two threads: shares of 300, so each ends in a partial
    32-row block; every row must have the bits the column split gives it, 100 rows at a
    time, for each epilogue."""
    g = torch.Generator().manual_seed(11)
    m, k, n = 600, 576, 960
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (m,), generator=g)
    rope = RotaryEmbedding(64, 4096, 10000.0, None)

    def run(rows: slice) -> torch.Tensor:
        if kind == "silu":
            return linear_silu(x[rows], w, pack(w))
        if kind == "rope":
            return linear_rope(x[rows], w, b, pack(w), 0, positions[rows], rope.cos, rope.sin,
                               12 * 64)
        return linear(x[rows], w, b, pack(w))

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        whole = run(slice(0, m))
        parts = torch.cat([run(slice(i, i + 100)) for i in range(0, m, 100)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, parts)


def test_linear_tiles_run_from_the_amx_threshold():
    """`amx_from` reaches the kernel, `linear_tiles_off` lifts it out of reach for a while,
    and the result hardly depends on the path: tiles and registers both accumulate pair
    by pair in fp32 (so the bits cannot show the path; the kernel's state does)."""
    if not cpu_paths.amx_active():
        pytest.skip("no AMX tiles on this host or build")
    g = torch.Generator().manual_seed(7)
    w = torch.randn(832, 1536, generator=g).to(torch.bfloat16)
    wp, x = pack(w), torch.randn(4, 1536, generator=g).to(torch.bfloat16)
    before = cpu_paths.amx_from()
    try:
        results = {}
        for rows in (1, 3):
            cpu_paths.set_amx_from(rows)
            assert torch.ops.kiln_cpu.amx_rows() == rows
            results[rows] = [linear(x[:m], w, None, wp) for m in (1, 2, 3, 4)]
            with cpu_paths.linear_tiles_off():
                assert torch.ops.kiln_cpu.amx_rows() > 4
                regs = [linear(x[:m], w, None, wp) for m in (1, 2, 3, 4)]
            assert torch.ops.kiln_cpu.amx_rows() == rows
            for a, b in zip(results[rows], regs):  # at most a rounding step apart
                torch.testing.assert_close(a, b, atol=0, rtol=2 ** -7)
        ref = F.linear(x.float(), w.float())
        for m, got in enumerate(results[3], 1):
            assert (got.float() - ref[:m]).abs().max() / ref.abs().max() < 1e-2
    finally:
        cpu_paths.set_amx_from(before)


def test_linear_packed_handles_leading_dims_and_empty_batches():
    w = torch.randn(32, 64).to(torch.bfloat16)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    out = linear(x, w, None, pack(w))
    assert out.shape == (2, 3, 32)
    assert torch.allclose(out.float(), F.linear(x.float(), w.float()), atol=0.1, rtol=0.02)
    assert linear(x[:0, 0], w, None, pack(w)).shape == (0, 32)


def test_pack_linears_frees_untied_weights_and_keeps_outputs(tiny_models):
    from kiln.models.loader import build_model
    from kiln.models.model_config import ModelConfig

    path, _ = tiny_models["llama-tied"]
    mc = ModelConfig.from_pretrained(path)
    model = build_model(mc, torch.bfloat16, torch.device("cpu"), progress=False)
    x = torch.randn(4, mc.hidden_size).to(torch.bfloat16)
    before = model.compute_logits(x)
    qkv_rows = model.model.layers[0].self_attn.qkv_proj.weight.shape[0]
    assert pack_linears(model) == 4 * mc.num_layers + 1
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.numel() == 0  # released: only the packed copy
    assert layer.self_attn.qkv_proj.packed_weight.shape[0] * 16 == qkv_rows
    # The tied lm_head keeps the embedding (which the embedding lookup still reads).
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.numel() == mc.vocab_size * mc.hidden_size
    after = model.compute_logits(x)
    assert (after.float() - before.float()).abs().max() <= 0.02 * before.float().abs().max()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_size,block_size",
                         [(4, 2, 16, 16), (9, 3, 64, 16), (8, 1, 128, 32), (16, 16, 32, 16),
                          (4, 2, 48, 16)])  # 48: a chunk count the kernel is not unrolled for
def test_cpu_backend_matches_torch_backend(dtype, tol, heads, kv_heads, head_size,
                                           block_size):
    """Mixed prefills, chunks with context and decodes (contexts past 16 keys, so the
    sixteen-key blocks and their tails both run, and past 128, so the decode kernel
    merges its key chunks' partials), padding rows; outputs and caches."""
    spec = AttentionLayerSpec(heads, kv_heads, head_size, head_size ** -0.5)
    for seed, max_context in enumerate((90, 90, 400)):
        shapes = random_shapes(seed, 7, max_context=max_context)
        batch = make_batch(shapes, heads, kv_heads, head_size, block_size, pad=3, seed=seed,
                           dtype=dtype)
        out_cpu, cache_cpu = run_backend(CpuPagedBackend, batch, spec)
        out_ref, cache_ref = run_backend(TorchPagedBackend, batch, spec)
        n = batch.metadata.num_actual_tokens
        torch.testing.assert_close(out_cpu[:n], out_ref[:n], atol=tol, rtol=tol)
        assert torch.equal(cache_cpu, cache_ref)  # same slots written, padding skipped
        assert out_cpu[n:].isnan().all()  # padding rows untouched


def test_cpu_backend_is_the_cpu_default_and_falls_back(monkeypatch, caplog):
    cpu = torch.device("cpu")
    assert select_backend(None, 64, torch.bfloat16, cpu) is CpuPagedBackend
    assert select_backend(None, 64, torch.float16, cpu) is TorchPagedBackend
    monkeypatch.setitem(cpu_kernels._state, "signature", None)
    monkeypatch.setitem(cpu_kernels._state, "reason", "disabled by KILN_CPU_KERNELS=0")
    with caplog.at_level("WARNING"):
        assert select_backend(None, 64, torch.bfloat16, cpu) is TorchPagedBackend
    assert "KILN_CPU_KERNELS=0" in caplog.text
    with pytest.raises(ValueError, match="attention_backend='cpu'.*KILN_CPU_KERNELS"):
        select_backend("cpu", 64, torch.bfloat16, cpu)


def test_native_attention_is_a_noop_without_a_batch():
    q = torch.randn(3, 4, 16)
    out = torch.full_like(q, 7.0)
    torch.ops.kiln_cpu.unified_attention(q, q[:, :2], q[:, :2], out, torch.tensor(0))
    assert (out == 7.0).all()


def test_isa_class_caps_by_environment(monkeypatch):
    host = host_isa()
    monkeypatch.delenv("KILN_AMX_EMULATE", raising=False)
    monkeypatch.setenv("KILN_CPU_ISA", "none")
    assert isa_class() == "none"
    assert "no AVX2" in cpu_kernels.host_supports()
    monkeypatch.setenv("KILN_CPU_ISA", "amx")  # a cap never raises the host's class
    assert isa_class() == host
    monkeypatch.setenv("KILN_CPU_ISA", "avx9000")
    with pytest.raises(ValueError, match="KILN_CPU_ISA"):
        isa_class()


def test_emulated_tiles_are_asked_for_by_name_and_only_where_they_can_run(monkeypatch):
    """KILN_AMX_EMULATE=1 runs the amx class on an AVX512-BF16 host (its own build and
    tuning entries: the device name says so); below that class, beside a lower cap or
    with a bad value it is a ValueError naming the variables."""
    from kiln.platforms import device_name
    from kiln.platforms.cpu import amx_emulated

    host = host_isa()
    monkeypatch.delenv("KILN_CPU_ISA", raising=False)
    monkeypatch.setenv("KILN_AMX_EMULATE", "0")
    plain_flags, plain_name = cpu_kernels.cflags(isa_class()), device_name("cpu")
    monkeypatch.setenv("KILN_AMX_EMULATE", "yes")
    with pytest.raises(ValueError, match="KILN_AMX_EMULATE='yes'"):
        isa_class()
    monkeypatch.setenv("KILN_AMX_EMULATE", "1")
    if host not in ("amx", "avx512_bf16"):
        with pytest.raises(ValueError, match="KILN_AMX_EMULATE=1 needs an AVX512-BF16 host"):
            isa_class()
        return
    assert isa_class() == "amx" and amx_emulated()
    assert "-DKILN_AMX_EMULATE" in cpu_kernels.cflags("amx")
    assert "-mamx-tile" not in cpu_kernels.cflags("amx")
    assert cpu_kernels.cflags("amx") != plain_flags
    assert device_name("cpu").endswith("[amx, emulated]") and device_name("cpu") != plain_name
    monkeypatch.setenv("KILN_CPU_ISA", "avx512_bf16")
    with pytest.raises(ValueError, match="KILN_CPU_ISA='avx512_bf16' caps it lower"):
        isa_class()


def test_prefill_path_variable_is_checked_at_start_up(monkeypatch):
    """KILN_CPU_PREFILL picks the cpu backend's bf16 prefill path (A/B runs); a value
    that names neither is a ValueError from the start-up check, naming the variable."""
    monkeypatch.setenv("KILN_CPU_PREFILL", "SDPA ")
    assert cpu_kernels.envs.KILN_CPU_PREFILL == "sdpa"
    monkeypatch.setenv("KILN_CPU_PREFILL", "flash")
    with pytest.raises(ValueError, match="KILN_CPU_PREFILL='flash'"):
        cpu_kernels.host_supports()


def test_prefill_path_is_the_faster_one_in_the_tuning_table(tmp_path, monkeypatch):
    """KILN_CPU_PREFILL=auto (the default) runs bf16 prefill rows on the path `kiln bench
    kernels --ops attention` measured faster here (`cpu`: kiln's kernel, `cpu-sdpa`),
    summed over the bf16 prefill shapes; without entries the kernel; an explicit value
    wins. The choice reaches the op: its output is then SDPA's, bit for bit."""
    from kiln.bench.tuning import merge_into
    from kiln.ops.tuning import CPU_SDPA, prefill_kernel_wins, shape_key
    from kiln.platforms import device_name

    table = tmp_path / "tuning.json"
    monkeypatch.setenv("KILN_TUNING_FILE", str(table))
    monkeypatch.delenv("KILN_CPU_PREFILL", raising=False)
    assert prefill_kernel_wins() is None and cpu_paths._prefill_choice() is True

    def key(phase: str, dtype: torch.dtype, **dims: int) -> str:
        return shape_key(phase=phase, **dims, heads=4, kv_heads=2, head_size=32, dtype=dtype)

    def entry(kernel: float, sdpa: float) -> dict:
        return {"best": "cpu", "config": None, "us": {"cpu": kernel, CPU_SDPA: sdpa}}

    merge_into(table, device_name("cpu"), {"attention": {
        key("prefill", torch.bfloat16, tokens=512): entry(10, 30),
        key("prefill", torch.bfloat16, tokens=2000): entry(200, 100),  # 210 vs 130 in all
        key("decode", torch.bfloat16, batch=1, context=64): entry(1, 1000),  # not prefill
        key("prefill", torch.float32, tokens=512): entry(1, 1000)}})  # fp32 keeps SDPA
    assert prefill_kernel_wins() is False and cpu_paths._prefill_choice() is False
    monkeypatch.setenv("KILN_CPU_PREFILL", "kernel")
    assert cpu_paths._prefill_choice() is True
    monkeypatch.setenv("KILN_CPU_PREFILL", "auto")

    spec = AttentionLayerSpec(4, 2, 32, 32 ** -0.5)
    batch = make_batch([(0, 40), (20, 30)], 4, 2, 32, 16, pad=0, seed=3,
                       dtype=torch.bfloat16)
    kernel = run_backend(CpuPagedBackend, batch, spec)[0]
    try:
        cpu_paths.choose(isa_class() == "amx")
        chosen = run_backend(CpuPagedBackend, batch, spec)[0]
        with cpu_paths.prefill_sdpa():  # the same path again: the choice is restored after
            assert torch.equal(run_backend(CpuPagedBackend, batch, spec)[0], chosen)
        assert not torch.equal(chosen, kernel)
        assert torch.equal(run_backend(CpuPagedBackend, batch, spec)[0], chosen)
    finally:
        monkeypatch.setenv("KILN_TUNING_FILE", str(tmp_path / "none.json"))
        cpu_paths.choose(isa_class() == "amx")
    assert torch.equal(run_backend(CpuPagedBackend, batch, spec)[0], kernel)


def test_the_unity_build_compiles_every_source_once():
    from kiln.ops.cpu_kernels import SOURCES, UNITY_GROUPS

    names = [name for group in UNITY_GROUPS for name in group]
    assert sorted(names) == sorted(src.name for src in SOURCES)
    # Their AVX2 panels share file-local names: one unit each.
    assert not any({"linear_bf16.cpp", "linear_quant.cpp"} <= set(g) for g in UNITY_GROUPS)


def _failing_build(monkeypatch, calls, until=None):
    """The build fails (once `until` is set, if given); this process starts unloaded."""
    def failing_load(root, progress):
        calls.append(root)
        if until is not None:
            until.wait(timeout=60)
        raise RuntimeError("g++ exploded")

    monkeypatch.setattr(cpu_kernels, "_load", failing_load)
    monkeypatch.setattr(cpu_kernels, "_builder", [])
    for key in ("signature", "failed", "building"):
        monkeypatch.setitem(cpu_kernels._state, key, None)
    monkeypatch.setattr(cpu_kernels, "host_supports", lambda: None)


def test_a_failed_build_is_tried_once_and_a_background_start_only_when_due(
        monkeypatch, tmp_path):
    calls = []
    _failing_build(monkeypatch, calls)
    assert not cpu_kernels.ensure_loaded(tmp_path) and not cpu_kernels.ensure_loaded(tmp_path)
    assert len(calls) == 1 and "g++ exploded" in cpu_kernels.unavailable_reason()
    assert cpu_kernels.start_loading(tmp_path / "fresh") is None  # the toolchain failed
    monkeypatch.setitem(cpu_kernels._state, "failed", None)
    built = cpu_kernels._target(tmp_path / "built")  # nothing to overlap: just load it
    built.parent.mkdir(parents=True)
    built.touch()
    assert cpu_kernels.start_loading(tmp_path / "built") is None
    thread = cpu_kernels.start_loading(tmp_path / "fresh")
    assert cpu_kernels.start_loading(tmp_path / "fresh") is None  # one build at a time
    thread.join(timeout=30)
    assert not thread.is_alive() and calls[-1] == tmp_path / "fresh"
    # The plan does not see the failure (half a plan each way would be compiled and
    # cached under the kernels' key); whatever runs a kernel does, and the engine starts
    # again without them.
    assert cpu_kernels.planned()
    with pytest.raises(cpu_kernels.BuildFailed, match="g\\+\\+ exploded"):
        cpu_kernels.wait_planned()
    assert not cpu_kernels.planned() and cpu_kernels.planned_signature() is None
    cpu_kernels.wait_planned()  # reported once
    # The next process builds in line where this build failed: no restart at each start.
    monkeypatch.setitem(cpu_kernels._state, "failed", None)
    assert (cpu_kernels._target(tmp_path / "fresh").parent / cpu_kernels.FAILED).exists()
    assert cpu_kernels.start_loading(tmp_path / "fresh") is None


def test_a_build_that_failed_before_the_plan_costs_no_restart(monkeypatch, tmp_path):
    calls = []
    _failing_build(monkeypatch, calls)
    cpu_kernels.start_loading(tmp_path).join(timeout=30)
    assert not cpu_kernels.ensure_planned(tmp_path)  # settled, and not built again
    assert len(calls) == 1 and not cpu_kernels.planned()
    cpu_kernels.wait_planned()  # nothing planned on it: nothing to report


def test_a_build_that_fails_beside_start_up_restarts_the_engine_without_kernels(
        monkeypatch, tmp_path, tiny_models, caplog):
    """A first start loads weights, traces and compiles while the kernels build; if the
    build then fails (found when the compiled graph is about to run), the engine starts
    again on F.linear and SDPA (float32 for an `auto` dtype) and answers exactly as
    transformers does."""
    from conftest import hf_greedy
    from kiln import LLM, SamplingParams

    calls, needed = [], threading.Event()
    _failing_build(monkeypatch, calls, until=needed)
    wait = cpu_kernels.wait_planned

    def first_needed():  # the build fails just as the compiled graph needs it
        needed.set()
        wait()

    monkeypatch.setattr(cpu_kernels, "wait_planned", first_needed)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))  # no library here: a build is due
    path, hf = tiny_models["llama"]
    with caplog.at_level("WARNING"):
        # Dynamo and kiln's backend as at -O2, without Inductor's code generation.
        llm = LLM(str(path), progress=False, optimization_level=2, max_model_len=64,
                  compilation={"backend": "eager", "cache_dir": str(tmp_path)})
    assert len(calls) == 1 and "starting again without them" in caplog.text
    assert llm.engine.dtype == torch.float32 and not cpu_kernels.planned()
    prompt = [5, 17, 42, 7, 99]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8)
