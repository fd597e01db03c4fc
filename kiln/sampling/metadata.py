"""Per-step sampling inputs, one row per request that samples this step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.sampling.params import SamplingParams


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [R] float32; rows < eps are greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [R] int64, 0 = keep all
    top_p: torch.Tensor | None  # [R] float32, 1 = keep all
    generators: dict[int, torch.Generator]  # row -> per-request generator (seeded requests)

    @classmethod
    def build(cls, params: list[SamplingParams], generators: dict[int, torch.Generator],
              device: torch.device) -> SamplingMetadata:
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                   device=device)
        all_greedy = all(p.is_greedy for p in params)
        top_k = top_p = None
        if not all_greedy and any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
        if not all_greedy and any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        return cls(temperature, all_greedy, top_k, top_p, generators)
