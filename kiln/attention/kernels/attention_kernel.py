"""One Triton kernel for paged causal attention over a mixed batch.

Prefill chunks (with or without cached context) and single-token decodes share one launch.
Program (i, h) owns up to BLOCK_Q query tokens of one sequence and every query head that
reads KV head h (GQA: `num_queries_per_kv` heads, so a K/V tile is loaded once for all of
them); its BLOCK_M = BLOCK_Q * num_queries_per_kv (+ masked spare) rows attend with an online
softmax over the sequence's keys, read through the block table TILE_N keys at a time.

Graph safety (AttentionCGSupport.ALWAYS): the grid and every scalar argument come from tensor
shapes (padded token count, number of block-table rows), never from host copies of lengths.
Programs find their sequence by a binary search over `query_start_loc` on the device, and
programs past a sequence's queries (or past the last sequence: padding rows) exit at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.ops.triton_runtime import interpreter_requested


@dataclass(frozen=True, slots=True)
class UnifiedAttentionConfig:
    """Meta-parameters of one launch; a tuning harness sweeps these on CUDA.

    block_m: query rows per program (tokens x heads of one KV head); a power of two >= 16
        (tl.dot's minimum) and >= num_queries_per_kv.
    tile_n: keys per inner-loop step; a power of two >= 16, independent of the KV block size.
    num_warps / num_stages: passed to the launch (the interpreter ignores them).
    """

    block_m: int = 16
    tile_n: int = 32
    num_warps: int = 4
    num_stages: int = 2

    def validate(self, num_queries_per_kv: int) -> None:
        for name in ("block_m", "tile_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        if self.block_m < num_queries_per_kv:
            raise ValueError(f"block_m={self.block_m} must be >= num_queries_per_kv="
                             f"{num_queries_per_kv} (one token's heads share a program)")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps={self.num_warps} must be a power of two")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")


def default_config(head_size: int, num_queries_per_kv: int,
                   dtype: torch.dtype) -> UnifiedAttentionConfig:
    """A sane untuned default: 16 rows unless one token's heads need more, wider key tiles
    for small heads (registers hold Q, a K/V tile and the accumulator)."""
    block_m = max(16, _next_pow2(num_queries_per_kv))
    tile_n = 64 if head_size <= 64 and dtype != torch.float32 else 32
    return UnifiedAttentionConfig(block_m=block_m, tile_n=tile_n,
                                  num_warps=8 if head_size >= 128 else 4, num_stages=2)


def sweep_space(num_queries_per_kv: int) -> list[UnifiedAttentionConfig]:
    """Every valid config a tuning harness should try for one GQA ratio (CUDA only: the
    interpreter ignores warps and stages)."""
    return [UnifiedAttentionConfig(block_m, tile_n, warps, stages)
            for block_m in (16, 32, 64) if block_m >= num_queries_per_kv
            for tile_n in (16, 32, 64, 128) for warps in (2, 4, 8) for stages in (1, 2, 3)]


def unified_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      output: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, scale: float,
                      config: UnifiedAttentionConfig | None = None,
                      sliding_window: int | None = None,
                      logits_soft_cap: float | None = None) -> None:
    """Causal attention of every query row against its sequence's paged keys.

    query/output: [T, num_heads, head_size] (T may include padding rows past the last
    sequence; they are neither read meaningfully nor written).
    key_cache/value_cache: [num_blocks, block_size, num_kv_heads, head_size], already holding
    this step's keys. block_table: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] (context
    + new tokens); query_start_loc: [num_seqs + 1] int32, non-decreasing (empty sequences are
    allowed: graph padding). Query row j of sequence s sits at position
    seq_lens[s] - q_len[s] + j and sees keys 0..that position (with `sliding_window`, only
    the last `sliding_window` of them: the tiles before are not read at all). With
    `logits_soft_cap`, scores become cap * tanh(scores / cap) before the softmax. Both
    are compile-time constants: one kernel variant per layer type, fixed before any
    graph is captured.
    """
    num_tokens, num_heads, head_size = query.shape
    for name, tensor in (("query", query), ("output", output), ("key_cache", key_cache),
                         ("value_cache", value_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_size) dimension")
    _, block_size, num_kv_heads, _ = key_cache.shape
    qpk = num_heads // num_kv_heads
    cfg = config or default_config(head_size, qpk, query.dtype)
    cfg.validate(qpk)
    block_q = cfg.block_m // qpk
    num_seqs = seq_lens.shape[0]
    # Sequence s gets programs [qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s + 1): at least
    # ceil(q_len / BLOCK_Q) of them, so T // BLOCK_Q + num_seqs always covers the batch.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    if grid[0] == 0:
        return
    # Triton's interpreter computes bf16 tl.dot wrongly (garbage, triton 3.9): interpreted
    # bf16 runs multiply in fp32 instead. Compiled kernels keep bf16 tensor-core dots.
    upcast = query.dtype == torch.bfloat16 and interpreter_requested()
    _unified_attention_kernel[grid](
        query, key_cache, value_cache, output, block_table, seq_lens, query_start_loc,
        # log2(e): the kernel uses exp2 (after the cap, when there is one).
        scale if logits_soft_cap else scale * 1.4426950408889634,
        num_seqs,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        NUM_QUERIES_PER_KV=qpk, HEAD_SIZE=head_size, HEAD_PAD=_next_pow2(max(head_size, 16)),
        PAGE_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=cfg.block_m, TILE_N=cfg.tile_n,
        IEEE_DOT=query.dtype == torch.float32 or upcast, UPCAST=upcast,
        SLIDING_WINDOW=sliding_window or 0, SOFTCAP=float(logits_soft_cap or 0.0),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# num_seqs changes every step; specializing on it (== 1, % 16) would JIT new variants
# mid-serving. Strides and constexprs are fixed per model, so one compile per layer shape.
@triton.jit(do_not_specialize=["num_seqs"])
def _unified_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr,
        qk_scale, num_seqs,
        q_stride_t, q_stride_h, o_stride_t, o_stride_h,
        k_stride_b, k_stride_s, k_stride_h, v_stride_b, v_stride_s, v_stride_h,
        bt_stride,
        NUM_QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr, IEEE_DOT: tl.constexpr, UPCAST: tl.constexpr,
        SLIDING_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Largest s with qsl[s] // BLOCK_Q + s <= pid: the sequence this program serves.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:  # spare program (also: padding past the last sequence)
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_pos = q_block * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # [BLOCK_M] within the chunk
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_ok = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_pos < q_len)
    d_ok = offs_d < HEAD_SIZE
    token = (q_start + q_pos).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h
                + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    query_abs = context_len + q_pos  # [BLOCK_M] absolute position: sees keys <= it
    # Keys this program can see: up to its last query row's position (causal).
    num_keys = context_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    # The first key this program's first query row sees. Keys before it are not loaded
    # (their table entries may name blocks already freed and reused), whole tiles of
    # them not even visited.
    first_key = 0
    if SLIDING_WINDOW > 0:
        first_key = tl.maximum(context_len + q_block * BLOCK_Q - SLIDING_WINDOW + 1, 0)
    for tile in range(first_key // TILE_N, tl.cdiv(num_keys, TILE_N)):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        key_ok = (offs_n < num_keys) & (offs_n >= first_key)
        block = tl.load(block_table_ptr + seq * bt_stride + offs_n // PAGE_SIZE,
                        mask=key_ok, other=0).to(tl.int64)
        in_page = offs_n % PAGE_SIZE
        k_off = block * k_stride_b + in_page * k_stride_s + kv_head * k_stride_h  # [TILE_N]
        v_off = block * v_stride_b + in_page * v_stride_s + kv_head * v_stride_h
        k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None],
                    mask=d_ok[:, None] & key_ok[None, :], other=0.0)  # [HEAD_PAD, TILE_N]
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE_N, HEAD_PAD]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE_DOT:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale  # [BLOCK_M, TILE_N], log2 units (scaled, uncapped, with a cap)
        if SOFTCAP > 0:  # tanh(x) = 1 - 2 / (exp(2x) + 1), saturating cleanly at +-1
            t = 1.0 - 2.0 / (tl.exp(2.0 * (s / SOFTCAP)) + 1.0)
            s = (SOFTCAP * 1.4426950408889634) * t
        visible = (offs_n[None, :] <= query_abs[:, None]) & key_ok[None, :] & row_ok[:, None]
        if SLIDING_WINDOW > 0:
            visible = visible & (offs_n[None, :] > query_abs[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * o_stride_t + head[:, None] * o_stride_h
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
