"""SamplingParams validation: every bad value names its field."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kiln import SamplingParams
from kiln.sampling.params import MAX_LOGPROBS

BAD = [
    ({"n": 0}, "n="), ({"n": 1.5}, "n="), ({"temperature": -0.1}, "temperature="),
    ({"top_p": 0}, "top_p="), ({"top_p": 1.5}, "top_p="), ({"top_k": -2}, "top_k="),
    ({"min_p": 1.5}, "min_p="), ({"repetition_penalty": 0}, "repetition_penalty="),
    ({"presence_penalty": 3}, "presence_penalty="),
    ({"frequency_penalty": -2.5}, "frequency_penalty="), ({"max_tokens": 0}, "max_tokens="),
    ({"max_tokens": -3}, "max_tokens="), ({"min_tokens": -1}, "min_tokens="),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens="),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs="), ({"logprobs": -1}, "logprobs="),
    ({"prompt_logprobs": 100}, "prompt_logprobs="), ({"stop": ""}, "stop"),
    ({"stop": [1, 2]}, "stop="), ({"stop_token_ids": [-1]}, "stop_token_ids="),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"), ({"logit_bias": {3: 1000}}, "logit_bias"),
    ({"seed": "abc"}, "seed="), ({"temperature": "hot"}, "temperature="),
]


@pytest.mark.parametrize("kwargs,field", BAD)
def test_bad_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_good_values_are_normalised():
    p = SamplingParams(top_k=-1, stop="###", logit_bias={"7": 2}, temperature=1)
    assert p.top_k == 0 and p.stop == ["###"] and p.logit_bias == {7: 2.0}
    assert p.stop_buffer_length == 2
    assert SamplingParams(stop=["ab", "xyz"], include_stop_str_in_output=True
                          ).stop_buffer_length == 0
    child = SamplingParams(n=3, seed=10).for_child(2)
    assert child.n == 1 and child.seed == 12


def test_cli_prints_the_message_not_a_traceback():
    res = subprocess.run([sys.executable, "-m", "kiln.cli.main", "generate", "hi",
                          "--top-p", "0"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "top_p=0.0 must be in (0.0, 1.0]" in res.stderr
    assert "Traceback" not in res.stderr
