"""A pipeline stage's side of the hidden-state hand-off between stages.

Each stage runs the same step (every rank gets the same SchedulerOutput, so the dispatcher
pads every stage to the same token count): a stage after the first receives the previous
stage's hidden states into the model's `pp_in` buffer before its forward, and a stage
before the last sends its output to the next one. The send is asynchronous: the stage
goes on to the engine's next micro-batch while the bytes travel, and waits for it only
before the next send (torch.distributed p2p keeps the order per pair of ranks, and the
tensor stays referenced until then). Transfers run on the PP group's device group (gloo on
a CPU, NCCL on CUDA), apart from the TP group's collectives.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from kiln.distributed.parallel_state import get_pp_group

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineIO:
    """Fills `model.model.pp_in` (allocated here, before tracing: a graph input) and
    wraps the runner's forward with the receive and the send."""

    def __init__(self, model: nn.Module, max_tokens: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        stage = getattr(model, "stage", None)
        if stage is None:
            raise ValueError(f"pipeline_parallel_size > 1: {type(model).__name__} does not "
                             "split into pipeline stages (it has no `stage`; kiln's Llama "
                             "and Gemma families do); use -pp 1")
        self.stage, group = stage, get_pp_group()
        self.group = group.device_group
        self.prev = None if stage.first else group.ranks[group.rank - 1]
        self.next = None if stage.last else group.ranks[group.rank + 1]
        self.buffer: torch.Tensor | None = None
        if self.prev is not None:
            self.buffer = torch.zeros(max_tokens, model.config.hidden_size, dtype=dtype,
                                      device=device)
            model.model.pp_in = self.buffer
        self._sending: tuple[dist.Work, torch.Tensor] | None = None
        self._copy = False
        self.stats = {"recv_wait_s": 0.0, "send_s": 0.0, "bytes_sent": 0, "steps": 0}

    def wrap(self, forward: Forward, replays_graphs: bool = False) -> Forward:
        """`replays_graphs`: the forward's output is a captured graph's buffer, which the
        next replay rewrites, so what is sent is a copy."""
        self._copy = replays_graphs

        def staged(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            n = input_ids.shape[0]
            if self.buffer is not None:
                start = time.perf_counter()
                dist.recv(self.buffer[:n], src=self.prev, group=self.group)
                self.stats["recv_wait_s"] += time.perf_counter() - start
            hidden = forward(input_ids, positions)
            if self.next is not None:
                self._send(hidden[:n])
            self.stats["steps"] += 1
            return hidden
        return staged

    def _send(self, hidden: torch.Tensor) -> None:
        start = time.perf_counter()
        self.wait_sent()
        out = hidden.clone() if self._copy else hidden.contiguous()
        self._sending = (dist.isend(out, dst=self.next, group=self.group), out)
        self.stats["send_s"] += time.perf_counter() - start
        self.stats["bytes_sent"] += out.numel() * out.element_size()

    def wait_sent(self) -> None:
        if self._sending is not None:
            self._sending[0].wait()
            self._sending = None


def pipeline_io(model: nn.Module, max_tokens: int, dtype: torch.dtype,
                device: torch.device) -> PipelineIO | None:
    """The stage's hand-off under pipeline parallelism, else None."""
    if get_pp_group().world_size == 1:
        return None
    return PipelineIO(model, max_tokens, dtype, device)
