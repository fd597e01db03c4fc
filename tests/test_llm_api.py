"""The vLLM-shaped Python API on the real default model."""
from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(progress=False, optimization_level=0)  # model=None: the embedded default


def test_default_model_answers_and_outputs_have_vllm_fields(llm):
    # The default dtype here is bfloat16, where "capital of France" starts with a near-tie
    # (see ../shared/reference/this-machine.md); Germany's answer is not close.
    out = llm.chat([{"role": "user", "content": "What is the capital of Germany?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert out.finished and out.error is None
    assert out.prompt.startswith("<|im_start|>") and out.prompt_token_ids[0] == 1
    completion = out.outputs[0]
    assert "Berlin" in completion.text
    assert completion.finish_reason == "stop" and completion.token_ids[-1] == 2
    assert completion.index == 0


def test_chat_template_carries_the_history(llm):
    history = [{"role": "user", "content": "My name is Ada."},
               {"role": "assistant", "content": "Nice to meet you, Ada!"},
               {"role": "user", "content": "What is my name?"}]
    prompt = llm.apply_chat_template(history)
    assert "Nice to meet you, Ada!" in prompt["prompt"]
    assert prompt["prompt"].endswith("<|im_start|>assistant\n")
    out = llm.chat(history, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt["prompt_token_ids"]


def test_outputs_in_input_order_with_per_prompt_params(llm):
    prompts = ["The sky is", "One, two, three,", "Water boils at"]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (3, 5, 7)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 7]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(prompts, params[:2])
