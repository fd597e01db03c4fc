"""Shared setup of the micro-benchmarks: shapes of the default model (SmolLM2-135M).

Run with `make bench` or `pytest benchmarks --benchmark-only`; `make test` never collects
this folder (it runs `pytest tests`).
"""
from __future__ import annotations

import pytest
import torch

@pytest.fixture(autouse=True)
def _no_grad():
    with torch.inference_mode():
        yield
