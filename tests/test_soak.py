"""`kiln bench soak` in brief: a real `kiln serve` (tiny model with SmolLM2's tokenizer,
-O0) with a LoRA adapter, n-gram speculation and the disk KV tier on together, under four
`openai` clients sending every request kind for 14 s. The 30-minute run on the default
model is the one docs/serving.md reports; memory growth needs that length to mean
anything, so here it is reported, not checked."""
from __future__ import annotations

import pytest

from kiln.bench.soak import format_soak, run_soak
from kiln.bench.soak_requests import KINDS
from server_utils import make_tiny_chat_model


@pytest.mark.slow
def test_a_short_soak_with_lora_ngram_and_the_disk_tier_loses_nothing(tmp_path, smollm2_dir):
    model = make_tiny_chat_model(tmp_path / "m", smollm2_dir)
    r = run_soak(str(model), duration_s=14, clients=4, rss_interval_s=1.0,
                 serve_args=["-O0", "--max-num-seqs", "16"])
    print(format_soak(r))
    assert set(r["kinds"]) == set(KINDS)  # every kind ran, the adapter's included
    checks = {k: v for k, v in r["checks"].items() if not k.startswith("memory")}
    assert all(checks.values()), (checks, r["errors"])
    assert r["kinds"]["hostile"]["refused_as_meant"] == r["kinds"]["hostile"]["sent"]
