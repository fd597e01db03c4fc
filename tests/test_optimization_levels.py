"""-O0..-O3: each level's defaults, explicit settings winning, the CPU lowering, shared
cache keys, and the CLI spellings. No model is built here: milliseconds."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from kiln.cli.main import build_parser
from kiln.compiler.build import cache_factors
from kiln.config.compilation import CompilationMode as C, CUDAGraphMode as M
from kiln.config.engine import EngineConfig
from kiln.platforms.cuda import CudaPlatform

LADDER_64 = [1, 2, 4, *range(8, 129, 8)]  # max_num_seqs=64: up to 2 * 64


def cfg(level: int, **comp) -> EngineConfig:
    return EngineConfig(optimization_level=level, compilation=comp or None)


@pytest.mark.parametrize("level,mode,graphs", [
    (0, C.NONE, M.NONE), (1, C.PIECEWISE, M.PIECEWISE), (2, C.PIECEWISE, M.FULL_AND_PIECEWISE),
    (3, C.PIECEWISE, M.FULL_AND_PIECEWISE)])
def test_level_defaults_on_cpu(level, mode, graphs):
    # With graphs opted into (the CPU test graph) the level's graph mode shows through.
    c = cfg(level, graph_backend="cpu_test").compilation
    assert (c.mode, c.cudagraph_mode) == (mode, graphs)
    assert c.cudagraph_capture_sizes == (LADDER_64 if graphs else [])
    options = {"cpp_wrapper": True} if level == 3 else {}
    assert (c.compile_sizes, c.compile_ranges_endpoints, c.inductor_options) == ([], [],
                                                                                options)
    # Without it, CUDA graphs do not exist here: NONE, compiled code unchanged.
    plain = cfg(level).compilation
    assert (plain.mode, plain.cudagraph_mode, plain.cudagraph_capture_sizes) == (mode, M.NONE, [])


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("kiln.config.levels.platform_for", lambda device: CudaPlatform())


@pytest.mark.parametrize("level,graphs,sizes,options", [
    (0, M.NONE, [], {}), (1, M.PIECEWISE, [], {}), (2, M.FULL_AND_PIECEWISE, [], {}),
    (3, M.FULL_AND_PIECEWISE, [1, 2, 4, 8],
     {"max_autotune": True, "coordinate_descent_tuning": True})])
def test_level_defaults_on_cuda(fake_cuda, level, graphs, sizes, options):
    c = EngineConfig(optimization_level=level, device="cuda").compilation
    assert (c.cudagraph_mode, c.compile_sizes, c.inductor_options) == (graphs, sizes, options)
    assert c.cudagraph_capture_sizes == (LADDER_64 if graphs else [])


def test_explicit_settings_win(fake_cuda):
    assert cfg(0, mode=1).compilation.mode == C.PIECEWISE  # -O0 yet compiling
    c = EngineConfig(optimization_level=3, device="cuda",
                     compilation={"inductor_options": {}, "compile_sizes": [],
                                  "cudagraph_mode": "piecewise",
                                  "cudagraph_capture_sizes": [8, 1, 4]}).compilation
    assert (c.inductor_options, c.compile_sizes, c.cudagraph_mode) == ({}, [], M.PIECEWISE)
    assert c.cudagraph_capture_sizes == [1, 4, 8]
    # O3's static sizes follow the user's capture sizes, so padding never skips them.
    c = EngineConfig(optimization_level=3, device="cuda",
                     compilation={"cudagraph_capture_sizes": [2, 6, 32]}).compilation
    assert c.compile_sizes == [2, 6]
    # FULL needs no compilation; PIECEWISE without compiled pieces lowers to NONE.
    assert cfg(0, cudagraph_mode="full", graph_backend="cpu_test").compilation.cudagraph_mode \
        is M.FULL
    assert cfg(0, cudagraph_mode="piecewise", graph_backend="cpu_test") \
        .compilation.cudagraph_mode is M.NONE


@pytest.mark.parametrize("comp,match", [
    ({"cudagraph_mode": "fastest"}, "cudagraph_mode"),
    ({"graph_backend": "tpu"}, "graph_backend"),
    ({"cudagraph_capture_sizes": [0, 4], "graph_backend": "cpu_test"},
     "cudagraph_capture_sizes"),
    ({"inductor_options": "max_autotune"}, "inductor_options")])
def test_bad_graph_settings_fail_at_start_up(comp, match):
    with pytest.raises(ValueError, match=match):
        cfg(2, **comp)


@dataclasses.dataclass
class _Cfg:
    hidden: int = 8


class _Model(nn.Module):
    config = _Cfg()


def test_levels_differing_only_in_graphs_share_a_cache_key():
    def key(level, **comp):
        c = cfg(level, **comp).compilation
        return cache_factors(_Model(), c, torch.float32, torch.device("cpu"), [], "h")
    assert key(1) == key(2) == key(2, graph_backend="cpu_test") \
        == key(3, cudagraph_capture_sizes=[1, 2], inductor_options={})
    assert key(2, compile_regions=False) != key(2)  # regions change the compiled code
    assert key(1) != key(1, compile_sizes=[4])
    # -O3's cpp_wrapper changes the generated code, so it is a separate entry on the CPU.
    assert key(3) != key(2)


@pytest.mark.parametrize("argv,level", [
    ([], 2), (["-O0"], 0), (["-O3"], 3), (["-O", "2"], 2), (["-O1"], 1),
    (["--optimization-level", "1"], 1), (["--optimization-level=3"], 3)])
def test_cli_spellings(argv, level):
    assert build_parser().parse_args(["generate", "hi", *argv]).optimization_level == level


def test_cli_rejects_unknown_levels(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "-O4"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("threads,serial", [(1, True), (2, True), (3, False)])
def test_fused_kernels_run_single_threaded_on_small_cpu_hosts(threads, serial):
    from kiln.compiler.adaptors import InductorAdaptor
    from kiln.compiler.build import host_inductor_options

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        options = host_inductor_options({"cpp_wrapper": True}, torch.device("cpu"))
        explicit = host_inductor_options({"cpp.threads": 2}, torch.device("cpu"))
        on_cuda = host_inductor_options({}, torch.device("cuda"))
    finally:
        torch.set_num_threads(before)
    assert options == ({"cpp_wrapper": True, "cpp.threads": 1} if serial
                       else {"cpp_wrapper": True})
    assert explicit == {"cpp.threads": 2} and on_cuda == {}
    # The choice changes the generated code, so it is part of the compile-cache key.
    assert (InductorAdaptor(options).compute_hash()
            != InductorAdaptor({"cpp_wrapper": True, "cpp.threads": -1}).compute_hash())
