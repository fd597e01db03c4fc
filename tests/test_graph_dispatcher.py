"""The graph dispatcher: capture sizes, padding table, keys per mode, dispatch priority,
and the lowering of modes to what attention allows. Pure Python: milliseconds."""
from __future__ import annotations

import pytest

from kiln.attention.backend import AttentionCGSupport as S
from kiln.attention.forward_context import BatchDescriptor as BD
from kiln.config.compilation import (CUDAGraphMode as M, default_capture_sizes,
                                     validate_capture_sizes)
from kiln.graphs.dispatcher import GraphDispatcher
from kiln.graphs.mode import lower_for_attention

SIZES = [1, 2, 4, 8, 16]


def test_default_ladder_is_capped_by_seqs_and_tokens():
    assert default_capture_sizes(64, 2048) == [1, 2, 4, *range(8, 129, 8)]
    assert default_capture_sizes(64, 20) == [1, 2, 4, 8, 16]
    big = default_capture_sizes(1024, 8192)
    assert big[-1] == 512 and 248 in big and 256 in big and 264 not in big and 272 in big


def test_user_sizes_are_validated_sorted_and_deduplicated():
    assert validate_capture_sizes([8, 1, 8, 4], 64) == [1, 4, 8]
    for bad in ([0], [65], [2.5]):
        with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
            validate_capture_sizes(bad, 64)


@pytest.mark.parametrize("mode,piecewise,full", [
    (M.NONE, 0, 0), (M.PIECEWISE, 5, 0), (M.FULL, 0, 5), (M.FULL_DECODE_ONLY, 0, 4),
    (M.FULL_AND_PIECEWISE, 5, 4)])
def test_key_counts_per_mode(mode, piecewise, full):
    d = GraphDispatcher(mode, SIZES, max_num_seqs=8)
    assert (len(d.keys[M.PIECEWISE]), len(d.keys[M.FULL])) == (piecewise, full)


def test_full_keys_are_exact_piecewise_keys_relaxed():
    d = GraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, max_num_seqs=8)
    assert d.keys[M.PIECEWISE] == {BD(s) for s in SIZES}  # num_reqs None, not uniform
    assert d.keys[M.FULL] == {BD(s, s, True) for s in (1, 2, 4, 8)}  # <= max_num_seqs
    assert d.dispatch(3, uniform_decode=True) == (M.FULL, BD(4, 4, True))
    assert d.dispatch(3, uniform_decode=False) == (M.PIECEWISE, BD(4))
    # 13 decoding requests pad to 16 > max_num_seqs: no FULL key, PIECEWISE instead.
    assert d.dispatch(13, uniform_decode=True) == (M.PIECEWISE, BD(16))
    full = GraphDispatcher(M.FULL, SIZES, max_num_seqs=8)
    assert full.dispatch(10) == (M.FULL, BD(16, 8, False))
    assert full.dispatch(3, uniform_decode=True) == (M.FULL, BD(4, 4, False))


def test_uniform_keys_for_draft_verification():
    """Speculation (k = 3): uniform decode also comes as 4 tokens per request; the request
    count pads to a capture size, and a non-multiple falls back to the mixed keys."""
    d = GraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, max_num_seqs=8,
                        uniform_query_lens=(1, 4))
    assert d.keys[M.FULL] == {BD(q * s, s, True) for s in (1, 2, 4, 8) for q in (1, 4)}
    assert d.dispatch(12, uniform_decode=True, query_len=4) == (M.FULL, BD(16, 4, True))
    assert d.dispatch(8, uniform_decode=True, query_len=4) == (M.FULL, BD(8, 2, True))
    assert d.dispatch(3, uniform_decode=True) == (M.FULL, BD(4, 4, True))
    assert d.dispatch(10, uniform_decode=True, query_len=5) == (M.PIECEWISE, BD(16))
    # 9 requests of 4 tokens: past the largest capture size, eager.
    assert d.dispatch(36, uniform_decode=True, query_len=4) == (M.NONE, BD(36))


def test_padding_table_and_none_above_the_largest_size():
    d = GraphDispatcher(M.PIECEWISE, SIZES, max_num_seqs=8)
    assert [d.padded[n] for n in (1, 3, 5, 13, 16)] == [1, 4, 8, 16, 16]
    assert d.dispatch(17) == (M.NONE, BD(17))
    assert d.dispatch(0) == (M.NONE, BD(0))
    assert GraphDispatcher(M.NONE, SIZES, 8).dispatch(3, True) == (M.NONE, BD(3))


def test_capture_order_is_largest_first_per_mode():
    d = GraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, max_num_seqs=8)
    order = d.capture_descriptors()
    assert [mode for mode, _ in order] == [M.PIECEWISE, M.FULL]
    assert [x.num_tokens for x in order[0][1]] == [16, 8, 4, 2, 1]
    assert [x.num_tokens for x in order[1][1]] == [8, 4, 2, 1]


def test_compile_sizes_that_padding_would_change_are_rejected():
    with pytest.raises(ValueError, match="compile_sizes entry 3 is never run.*into 4"):
        GraphDispatcher(M.PIECEWISE, SIZES, 8, compile_sizes=[3])
    GraphDispatcher(M.PIECEWISE, SIZES, 8, compile_sizes=[4, 32])  # 32: never padded
    GraphDispatcher(M.NONE, SIZES, 8, compile_sizes=[3])  # no graphs, no padding


@pytest.mark.parametrize("mode,support,piecewise,expected", [
    (M.FULL_AND_PIECEWISE, S.NEVER, True, M.PIECEWISE),
    (M.FULL_AND_PIECEWISE, S.UNIFORM_SINGLE_TOKEN_DECODE, True, M.FULL_AND_PIECEWISE),
    (M.FULL_AND_PIECEWISE, S.ALWAYS, False, M.FULL_DECODE_ONLY),
    (M.FULL, S.UNIFORM_BATCH, True, M.FULL_AND_PIECEWISE),
    (M.FULL, S.UNIFORM_BATCH, False, M.FULL_DECODE_ONLY),
    (M.FULL, S.NEVER, False, M.NONE),
    (M.FULL, S.ALWAYS, False, M.FULL),
    (M.FULL_DECODE_ONLY, S.NEVER, True, M.PIECEWISE),
    (M.PIECEWISE, S.NEVER, False, M.NONE),
])
def test_modes_lower_to_what_attention_allows(mode, support, piecewise, expected):
    assert lower_for_attention(mode, support, piecewise) is expected


def test_mode_helpers():
    assert M.FULL_AND_PIECEWISE.decode_mode() is M.FULL
    assert M.FULL_AND_PIECEWISE.mixed_mode() is M.PIECEWISE
    assert M.FULL_DECODE_ONLY.mixed_mode() is M.NONE
    assert M.PIECEWISE.decode_mode() is M.PIECEWISE and not M.NONE
    assert M.parse("full_and_piecewise") is M.FULL_AND_PIECEWISE
    with pytest.raises(ValueError, match="cudagraph_mode"):
        M.parse("fast")
