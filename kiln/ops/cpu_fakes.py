"""Shape functions (fakes) of every `kiln_cpu` op, so compiled graphs can call them:
registered once the library defining the ops is loaded (kiln.ops.cpu_kernels)."""
from __future__ import annotations

import torch


def register_fakes() -> None:
    """Register the fakes; call once, after `torch.ops.load_library`."""

    @torch.library.register_fake("kiln_cpu::linear_packed")
    def _linear_packed_fake(x: torch.Tensor, wp: torch.Tensor, bias: torch.Tensor | None,
                            dense: torch.Tensor | None = None,
                            dense_from: int = 0) -> torch.Tensor:
        return x.new_empty((x.shape[0], wp.shape[0] * 16))

    @torch.library.register_fake("kiln_cpu::linear_quant")
    def _linear_quant_fake(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                           mins: torch.Tensor | None, bias: torch.Tensor | None, fmt: int,
                           panel_from: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], codes.shape[0] * 16))

    @torch.library.register_fake("kiln_cpu::lora_add_")
    def _lora_add_fake(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                       lora_b: torch.Tensor, scaling: torch.Tensor,
                       indices: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("kiln_cpu::apply_token_bitmask_")
    def _apply_token_bitmask_fake(logits: torch.Tensor, rows: torch.Tensor,
                                  bitmask: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("kiln_cpu::greedy_argmax")
    def _greedy_argmax_fake(logits: torch.Tensor) -> torch.Tensor:
        return logits.new_empty((logits.shape[0],), dtype=torch.long)
