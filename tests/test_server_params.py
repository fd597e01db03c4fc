"""The server's pure pieces, without a server: request → SamplingParams, error shapes,
and the cumulative → delta conversion of the async engine."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from kiln.entrypoints.openai.errors import APIError, from_validation_error
from kiln.entrypoints.openai.params import to_sampling_params
from kiln.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

CHAT = [{"role": "user", "content": "hi"}]


def test_max_tokens_defaults_to_what_fits():
    params = to_sampling_params(CompletionRequest(prompt="x"), prompt_len=10, max_model_len=64)
    assert params.max_tokens == 54
    assert to_sampling_params(CompletionRequest(prompt="x", max_tokens=54), 10, 64).max_tokens \
        == 54


@pytest.mark.parametrize("req, param, code", [
    (CompletionRequest(prompt="x", max_tokens=55), "max_tokens", "context_length_exceeded"),
    (CompletionRequest(prompt="x", max_tokens=0), "max_tokens", None),
    (ChatCompletionRequest(messages=CHAT, max_completion_tokens=-1), "max_completion_tokens",
     None),
    (CompletionRequest(prompt="x", temperature=-0.5), "temperature", None),
    (CompletionRequest(prompt="x", logit_bias={"a": 1.0}), "logit_bias", None),
    (ChatCompletionRequest(messages=CHAT, top_logprobs=2), "top_logprobs", None),
])
def test_bad_values_name_the_request_field(req, param, code):
    with pytest.raises(APIError) as info:
        to_sampling_params(req, prompt_len=10, max_model_len=64)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.code == code


def test_prompt_that_does_not_fit():
    with pytest.raises(APIError, match="max_model_len is 64") as info:
        to_sampling_params(CompletionRequest(prompt="x"), prompt_len=64, max_model_len=64)
    assert info.value.code == "context_length_exceeded"


def test_strict_types_and_unknown_fields():
    def error(body: str) -> APIError:
        with pytest.raises(ValidationError) as info:
            CompletionRequest.model_validate_json(body)
        return from_validation_error(info.value)

    assert error('{"prompt": "x", "max_tokens": "5"}').param == "max_tokens"
    assert "unknown parameter 'best_guess'" in error('{"prompt": "x", "best_guess": 1}').message
    assert "not valid JSON" in error('{"prompt": ').message
    assert error('{"prompt": 5}').param == "prompt"


@pytest.mark.parametrize("argv, words", [
    (["serve", "a", "--model", "b"], "model given twice"),
    (["serve", "--port", "70000"], "port=70000"),
    (["serve", "--max-request-body-bytes", "lots"], "max_request_body_bytes='lots'"),
])
def test_serve_flags_fail_before_loading(argv, words, capsys):
    from kiln.cli.main import main

    assert main(argv) == 2
    assert words in capsys.readouterr().err
