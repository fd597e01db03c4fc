"""The LoRA Triton kernels on CUDA: `kiln::lora_add_` dispatches to them, they match the
PyTorch op (run on the CPU as the reference), and a CUDA graph captured once follows new
indices, slot contents and scalings written in place."""
from __future__ import annotations

import pytest
import torch

from kiln.ops.lora import lora_apply
from test_lora_triton import compare, make_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Half an ulp of the dtype: the kernels accumulate in fp32 and round once, to nearest.
HALF_ULP = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}


def cuda(args: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [t.cuda() for t in args]


def check(out: torch.Tensor, args: tuple[torch.Tensor, ...]) -> None:
    """`out` (on CUDA) against the op on the CPU copies `args`, in their dtype and in fp32."""
    compare(out.cpu(), args, half_rtol=HALF_ULP.get(args[0].dtype, 0.0), fp32_tol=1e-4)


def test_the_op_dispatches_to_triton_on_cuda():
    from kiln.ops.triton_lora import lora_apply_triton

    assert torch._C._dispatch_has_kernel_for_dispatch_key("kiln::lora_add_", "CUDA")
    args = cuda(make_case(9, 3, 15, 64, 100, torch.bfloat16, [0, -1, 2, 1], seed=1))
    # Bit-equal: the PyTorch body rounds h and the delta to bf16, the kernels do not.
    assert torch.equal(lora_apply(*args), lora_apply_triton(*args))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("T,S,NR,d_in,d_out", [
    (1, 3, 15, 40, 70),        # NR = 3 shards x rank 5; out over two blocks, one partial
    (37, 3, 15, 24, 70),
    (37, 4, 48, 576, 1000),    # a SmolLM2-sized qkv: 3 x rank 16, in over 5 K blocks
    (300, 2, 16, 960, 2560),   # a prefill through an MLP-sized projection
])
def test_mixed_slots_with_base_rows(dtype, T, S, NR, d_in, d_out):
    slots = [1, -1, 0, S - 1, S - 1, -1, 0]
    args = make_case(T, S, NR, d_in, d_out, dtype, slots, seed=T + NR)
    check(lora_apply(*cuda(args)), args)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_one_slot_no_adapter_and_no_tokens(dtype):
    for slots in ([2], [-1]):
        args = make_case(5, 3, 15, 200, 24, dtype, slots, seed=3)
        check(lora_apply(*cuda(args)), args)
    args = make_case(0, 3, 15, 200, 24, dtype, [0], seed=3)
    assert lora_apply(*cuda(args)).shape == (0, 24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.inference_mode()
def test_cuda_graph_follows_indices_and_slots_written_in_place(dtype):
    """Captured while every token has no adapter, then replayed for adapter mixes with
    new slot contents, scalings and activations copied into the captured buffers: a
    grid or a branch fixed by the capture-time indices would show here."""
    T, S, NR, d_in, d_out = 24, 4, 15, 96, 200
    static = cuda(make_case(T, S, NR, d_in, d_out, dtype, [-1], seed=0))
    side = torch.cuda.Stream()  # warm-up (Triton's JIT) off the capture stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lora_apply(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lora_apply(*static)
    rounds = [[0, 1, 2, 3], [3, -1, 3, 0, -1, 2], [1], [-1, 2], [-1]]
    for i, slots in enumerate(rounds, start=1):
        args = make_case(T, S, NR, d_in, d_out, dtype, slots, seed=i)
        for buf, new in zip(static, args):
            buf.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        check(out, args)
