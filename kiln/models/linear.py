"""The linear-layer family a model names: replicated, column-parallel (fused shards) and
row-parallel, plus the checkpoint view their loaders read.

One design serves tensor parallelism, quantization and LoRA:
- the *layout* (which slice of each checkpoint tensor this rank holds) lives in the
  layer's `weight_loader`, which reads only that slice from the file;
- the *GEMM* is the layer's `quant_method` (kiln.quantization.methods: prepacked bf16 or
  F.linear, or a quantized weight made after loading the local slice);
- the *collective* after a row-parallel GEMM (all-reduce) and the gather after the
  vocab-parallel lm_head are custom ops (`kiln.distributed.collectives`), so the graph stays whole.
- the *adapter* (kiln.lora) adds each token's LoRA update after the GEMM, on the same
  local shapes (a row-parallel layer adds it to its partial sum).

With one rank every class here computes exactly what a plain `Linear` does, and the
traced graph holds no collective.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kiln.distributed.collectives import tp_all_reduce
from kiln.distributed.parallel_state import tp_rank, tp_size
from kiln.models.layers import Linear
from kiln.ops.lora import add_lora


class CheckpointTensor:
    """One tensor of a safetensors file, read lazily: `narrow` reads only its slice (a
    rank loads its shard, never the whole tensor), `full` reads everything."""

    def __init__(self, handle: object, name: str, dtype: torch.dtype) -> None:
        self._slice = handle.get_slice(name)  # type: ignore[attr-defined]
        self.shape = tuple(self._slice.get_shape())
        self.dtype = dtype

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)].to(self.dtype)

    def full(self) -> torch.Tensor:
        return self._slice[:].to(self.dtype)


def copy_checked(param: torch.Tensor, weight: torch.Tensor) -> None:
    if param.shape != weight.shape:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match parameter "
                         f"shape {tuple(param.shape)}")
    param.data.copy_(weight)


@dataclass(frozen=True, slots=True)
class Shard:
    """Where one checkpoint projection lands: rows [offset, offset + rows) of the local
    weight take rows [src_start, src_start + rows) of the checkpoint tensor."""

    offset: int
    rows: int
    src_start: int
    src_rows: int  # the checkpoint tensor's row count (checked at load)


class ColumnParallelLinear(Linear):
    """Output features split across ranks; one GEMM for several projections stacked by
    rows (q|k|v, gate|up). `shards` maps a shard id to (checkpoint rows, rows per rank,
    first checkpoint row of this rank)."""

    def __init__(self, in_features: int, shards: dict[str, tuple[int, int, int]],
                 bias: bool) -> None:
        self.shards: dict[str, Shard] = {}
        offset = 0
        for name, (src_rows, rows, src_start) in shards.items():
            self.shards[name] = Shard(offset, rows, src_start, src_rows)
            offset += rows
        super().__init__(in_features, offset, bias=bias)

    @classmethod
    def even(cls, in_features: int, shards: dict[str, int], bias: bool
             ) -> ColumnParallelLinear:
        """Each projection split evenly over the ranks (gate|up)."""
        tp, r = tp_size(), tp_rank()
        return cls(in_features, {n: (rows, rows // tp, r * (rows // tp))
                                 for n, rows in shards.items()}, bias)

    def weight_loader(self, param: nn.Parameter, weight: CheckpointTensor,
                      shard: str | None) -> None:
        if shard is None:
            if len(self.shards) != 1:
                raise ValueError(f"a fused layer's weight needs a shard id, one of "
                                 f"{sorted(self.shards)}")
            shard = next(iter(self.shards))
        s = self.shards[shard]
        if weight.shape[0] != s.src_rows:
            raise ValueError(f"shard {shard!r} has {weight.shape[0]} rows, expected "
                             f"{s.src_rows}")
        copy_checked(param.data[s.offset: s.offset + s.rows],
                     weight.narrow(0, s.src_start, s.rows))


def qkv_parallel_linear(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                        bias: bool) -> ColumnParallelLinear:
    """Q, K and V fused and split by heads. With more ranks than KV heads each KV head is
    replicated on tp / num_kv_heads ranks (rank r holds KV head r // replicas)."""
    tp, r = tp_size(), tp_rank()
    q_heads = num_heads // tp
    kv_heads = max(1, num_kv_heads // tp)
    kv_first = (r * num_kv_heads // tp) if tp <= num_kv_heads else r // (tp // num_kv_heads)
    kv = (num_kv_heads * head_dim, kv_heads * head_dim, kv_first * head_dim)
    return ColumnParallelLinear(hidden, {
        "q": (num_heads * head_dim, q_heads * head_dim, r * q_heads * head_dim),
        "k": kv, "v": kv}, bias)


class RowParallelLinear(Linear):
    """Input features split across ranks: each rank's GEMM gives a partial sum, the
    all-reduce makes it whole, then the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features // tp_size(), out_features, bias=bias)
        self.full_in = in_features

    def weight_loader(self, param: nn.Parameter, weight: CheckpointTensor,
                      shard: str | None) -> None:
        if param.dim() == 1:  # the bias is whole on every rank
            copy_checked(param, weight.full())
            return
        if tuple(weight.shape) != (self.out_features, self.full_in):
            raise ValueError(f"weight shape {tuple(weight.shape)} does not match "
                             f"{(self.out_features, self.full_in)}")
        k = self.in_features
        copy_checked(param, weight.narrow(1, tp_rank() * k, k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return super().forward(x)
        # LoRA on the partial sum is exact: x_r A_r^T summed over ranks is x A^T.
        out = tp_all_reduce(add_lora(self, self.quant_method.apply(self, x, None), x))
        return out if self.bias is None else out + self.bias
