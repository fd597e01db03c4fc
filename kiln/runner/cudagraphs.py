"""Graph set-up for the runner: resolve the mode against the attention backend, build the
dispatcher, and wrap the compiled pieces (PIECEWISE) and the whole forward (FULL)."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np
import torch
from torch import fx
from tqdm import tqdm

from kiln.attention.backend import AttentionCGSupport
from kiln.attention.forward_context import BatchDescriptor, set_forward_context
from kiln.compiler.piecewise import PiecewiseBackend
from kiln.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
from kiln.graphs.dispatcher import GraphDispatcher
from kiln.graphs.graph import CpuTestGraph, CudaGraph, global_graph_pool
from kiln.graphs.mode import lower_for_attention
from kiln.graphs.wrapper import CUDAGraphWrapper, GraphFactory, capture_phase
from kiln.platforms import platform_for

logger = logging.getLogger(__name__)


def resolve_dispatcher(cc: CompilationConfig | None, backend_cls: Any,
                       max_num_seqs: int, spec_query_len: int = 1) -> GraphDispatcher:
    """Lower the configured mode to what the attention backend allows (one log line when
    it changes) and build the dispatcher; rejects compile sizes that padding would skip."""
    if cc is None or not cc.cudagraph_mode:
        return GraphDispatcher(CUDAGraphMode.NONE, [], max_num_seqs)
    requested = CUDAGraphMode.parse(cc.cudagraph_mode)
    piecewise = cc.mode == CompilationMode.PIECEWISE and bool(cc.splitting_ops)
    mode = lower_for_attention(requested, backend_cls.cg_support, piecewise)
    if mode is not requested:
        why = (f"attention backend {backend_cls.name!r} supports "
               f"{backend_cls.cg_support.name}")
        if not piecewise and requested.has_piecewise_cudagraphs():
            why += "; the model is not compiled in pieces split at attention"
        logger.info("cudagraph_mode %s lowered to %s: %s", requested, mode, why)
    # Decode rows of 1 + k tokens (draft verification) get FULL keys only from a backend
    # whose captured launch handles uniform multi-token rows.

    lens = (1, spec_query_len) if backend_cls.cg_support >= AttentionCGSupport.UNIFORM_BATCH \
        else (1,)
    return GraphDispatcher(mode, cc.cudagraph_capture_sizes or [], max_num_seqs,
                           cc.compile_sizes or [], uniform_query_lens=lens)


def graph_factory(graph_backend: str) -> GraphFactory:
    if graph_backend == "cpu_test":
        return CpuTestGraph
    pool = global_graph_pool()
    check = logger.isEnabledFor(logging.DEBUG)  # address checks cost a little per replay
    return lambda name: CudaGraph(pool, name, check)


def wrap_pieces(split_gm: fx.GraphModule, factory: GraphFactory) -> list[CUDAGraphWrapper]:
    """One PIECEWISE wrapper per piece position, in call order.

    Identical pieces share one compiled `PiecewiseBackend`, but each position captures its
    own graphs (its inputs live at other addresses). Only the last piece's output may be
    weakly referenced inside its capture: every other output is read by the next graph.
    """
    calls = [n.target for n in split_gm.graph.nodes if n.op == "call_module"
             and isinstance(split_gm.__dict__.get(n.target), PiecewiseBackend)]
    wrappers = []
    for i, name in enumerate(calls):
        wrapper = CUDAGraphWrapper(split_gm.__dict__[name], CUDAGraphMode.PIECEWISE, factory,
                                   name=name, weak_ref_output=i == len(calls) - 1)
        split_gm.__dict__[name] = wrapper
        wrappers.append(wrapper)
    return wrappers


def wrap_full(forward: Callable[..., Any], factory: GraphFactory) -> CUDAGraphWrapper:
    return CUDAGraphWrapper(forward, CUDAGraphMode.FULL, factory, name="model")


@torch.inference_mode()
def capture_all(runner: Any, progress: bool = False) -> int:
    """Capture every key the dispatcher hands out, largest first per mode, before the
    first request; serving never captures."""
    start = time.perf_counter()
    warmups = platform_for(runner.device).graph_warmups
    count = 0
    with capture_phase():
        for mode, descs in runner.dispatcher.capture_descriptors():
            for desc in tqdm(descs, desc=f"capturing {mode} graphs", unit="graph",
                             disable=not progress):
                for _ in range(warmups):
                    dummy_run(runner, desc, CUDAGraphMode.NONE)
                dummy_run(runner, desc, mode)
                count += 1
    runner.graph_capture_s = time.perf_counter() - start
    logger.info("captured graphs for %d descriptors (%s, sizes %s) in %.1f s", count,
                runner.dispatcher.mode, runner.dispatcher.capture_sizes,
                runner.graph_capture_s)
    return count


def dummy_run(runner: Any, desc: BatchDescriptor, mode: CUDAGraphMode) -> None:
    """A batch of padding only, shaped like `desc`: every slot is -1 (nothing is
    written) and every block-table row is the null block."""
    n = desc.num_tokens
    num_reqs = desc.num_reqs or 1
    runner.input_ids.np[:n] = 0
    runner.positions.np[:n] = 0
    for slots in runner.slot_mappings:
        slots.np[:n] = -1
    runner.is_padding.np[:n] = True
    runner.lora_indices.np[:n] = -1
    runner.query_start_loc.np[0] = 0
    if desc.uniform:  # uniform decode: every request takes n / R tokens
        per = n // num_reqs
        runner.query_start_loc.np[1: num_reqs + 1] = np.arange(1, num_reqs + 1) * per
    else:  # requests 0..R-2 take one token each, the last takes the rest
        runner.query_start_loc.np[1:num_reqs] = np.arange(1, num_reqs)
        runner.query_start_loc.np[num_reqs] = n
    lens = np.diff(runner.query_start_loc.np[: num_reqs + 1])
    runner.seq_lens.np[:num_reqs] = lens
    for table in runner.block_tables:
        table.np[:num_reqs] = 0
    metadata = runner.build_metadata(n, num_reqs, n, int(lens.max()))
    ctx = runner.context(metadata, desc, runner.is_padding.device[:n], mode)
    with set_forward_context(ctx):
        runner.forward(runner.input_ids.device[:n], runner.positions.device[:n])
