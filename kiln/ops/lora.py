"""The batched LoRA op: every token adds its own adapter's low-rank update.

Layout (one LoRA-able linear, S slots, N shards of rank R each, NR = N * R):
- `lora_a` [S * NR, in]: slot s owns rows [s * NR, (s + 1) * NR); shard j of a fused
  layer (q|k|v, gate|up) owns the R rows from j * R inside them.
- `lora_b` [S * NR, out], B transposed: slot s owns rows [s * NR, (s + 1) * NR),
  block-diagonal per shard (shard j's R rows reach only shard j's output columns; the
  rest are zero). Transposed so that the expand runs FMAs along contiguous output columns
  (kiln/ops/csrc/lora.cpp).
- `lora_scaling` [S] float32: alpha / r (or alpha / sqrt(r), rsLoRA) per slot.
- `lora_indices` [max_tokens] int64: the slot of each token, -1 for none (the base model,
  padding). Only the first T = x.shape[0] entries are read.
An adapter of rank r < R leaves its unused rows and columns zero, which adds exact zeros.

`kiln::lora_add_(y, x, a, b, scaling, indices)` adds, per token and in place,
`scaling[s] * (x @ A_s^T) @ B_s^T` to y, in the order PEFT computes it. In place because
y is the GEMM's fresh output: a functional op would copy [T, out] per linear per step
even when no token has an adapter (Inductor functionalizes the mutation and re-inplaces
it). The op is opaque to the compiler (its fake returns nothing), and every value that
changes per step or per adapter is a tensor the runner or the slot manager writes in
place: swapping adapters never recompiles.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("kiln::lora_add_", mutates_args=("y",))
def lora_add_(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
              lora_b: torch.Tensor, scaling: torch.Tensor, indices: torch.Tensor) -> None:
    """PyTorch on any device: nothing when no token has an adapter, one GEMM pair when
    the tokens share one slot, else every slot at once under a one-hot mask (no per-slot
    loop, no data-dependent shapes)."""
    T = x.shape[0]
    if T == 0:
        return
    idx = indices[:T]
    lo, hi = (int(v) for v in torch.aminmax(idx))
    if hi < 0:
        return
    slots = scaling.shape[0]
    nr = lora_a.shape[0] // slots
    if lo == hi:
        a, bt = lora_a[lo * nr:(lo + 1) * nr], lora_b[lo * nr:(lo + 1) * nr]
        y.add_(((x @ a.t()) @ bt).mul_(float(scaling[lo])))  # PEFT's scalar product
        return
    h = (x @ lora_a.t()).view(T, slots, nr)  # [T, S, NR]: every slot's shrink
    onehot = idx.unsqueeze(1) == torch.arange(slots, device=idx.device)  # [T, S]
    h.mul_(onehot.unsqueeze(2).to(h.dtype))  # exact: other slots become 0
    delta = h.view(T, slots * nr) @ lora_b
    scale = torch.where(idx >= 0, scaling[idx.clamp(min=0)], 0.0).to(y.dtype)
    y.add_(delta.mul_(scale.unsqueeze(1)))


@lora_add_.register_fake
def _(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
      scaling: torch.Tensor, indices: torch.Tensor) -> None:
    return None


def lora_apply(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
               lora_b: torch.Tensor, scaling: torch.Tensor,
               indices: torch.Tensor) -> torch.Tensor:
    """The functional form (tests, references): a new tensor, y untouched."""
    out = y.clone()
    torch.ops.kiln.lora_add_(out, x, lora_a, lora_b, scaling, indices)
    return out


def add_lora(layer: torch.nn.Module, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The hook a LoRA-able linear calls after its GEMM (a no-op without slots). On a CPU
    with kiln's kernels the graph calls `kiln_cpu::lora_add_` (kiln/ops/csrc/lora.cpp:
    the same contract without Python on the hot path); decided at trace time."""
    if layer.lora_a is not None:
        op = torch.ops.kiln.lora_add_
        if y.device.type == "cpu" and y.dtype in (torch.float32, torch.bfloat16):
            from kiln.ops import cpu_kernels

            if cpu_kernels.planned():
                op = torch.ops.kiln_cpu.lora_add_
        op(y, x, layer.lora_a, layer.lora_b, layer.lora_scaling, layer.lora_indices)
    return y


# CUDA tensors take the Triton kernels: kiln/ops/triton_lora.py registers them on import.
# Only where torch has CUDA and Triton is installed (elsewhere the PyTorch body above serves
# every device); that module imports Triton at its first launch, never at import, like
# kiln/ops/triton_quant.py, so `import kiln` stays Triton-free on any host.
import importlib.util  # noqa: E402

if torch.backends.cuda.is_built() and importlib.util.find_spec("triton") is not None:
    from kiln.ops import triton_lora  # noqa: E402,F401  (registration is the side effect)
