"""Incremental detokenization on the real SmolLM2 tokenizer."""
from __future__ import annotations

import pytest

from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.startup import load_tokenizer

TEXTS = ["Hello, world! Ceci n'est pas une pipe.", "温度是摄氏25度。", "emoji: 🔥🏺 done",
         "  leading spaces\nand\ttabs"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_rebuilds_the_text(tokenizer, text):
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.update([t]) for t in ids]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)  # never half a character
