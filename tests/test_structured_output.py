"""Structured output in the engine: xgrammar constraints on a tiny random model with
SmolLM2's real tokenizer. Random weights make the unconstrained text nonsense, so any
output that matches its constraint does so because of the mask."""
from __future__ import annotations

import json
import re
from concurrent.futures import Future

import pytest
import torch
import xgrammar as xgr

from kiln import LLM, SamplingParams
from kiln.structured_output.apply import apply_bitmask_, unpack_bitmask
from kiln.structured_output.manager import StructuredOutputRequest
from kiln.structured_output.params import StructuredOutputsParams as SO
from server_utils import make_tiny_chat_model

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                         "tag": {"type": "string", "pattern": "^[a-z]{2,4}$"}}}
REGEX = r"[a-z]{3}-[0-9]{2}"


@pytest.fixture(scope="module")
def llm(tmp_path_factory, smollm2_dir):
    model_dir = make_tiny_chat_model(tmp_path_factory.mktemp("so") / "m", smollm2_dir)
    # Few KV blocks: 8 long requests preempt each other (block size 16).
    return LLM(str(model_dir), optimization_level=0, num_kv_blocks=40, max_num_seqs=8,
               progress=False)


def greedy(so: SO | None, max_tokens: int = 48, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so, **kw)


def test_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        SO()
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        SO(choice=[])
    with pytest.raises(ValueError, match="json is not valid JSON"):
        SO(json="{not json")
    assert SO(json='{"type": "string"}').json == {"type": "string"}
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs=["regex"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [True, False])
def test_bitmask_application_equals_xgrammars_own(cpu_kernels_loaded, dtype, kernel):
    """kiln's C++ kernel and its ATen fallback against xgrammar's reference, on a subset
    of rows, with all-allowed and all-forbidden words and a vocabulary that is not a
    multiple of 32."""
    vocab = 1000
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 32), dtype=torch.int32)
    bitmask[0, 3], bitmask[1, 4] = -1, 0
    logits = torch.randn(4, vocab).to(dtype)
    rows = torch.tensor([2, 0])
    expected = logits.clone()  # xgrammar's bitmask rows are the logits' rows
    full = torch.full((4, 32), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(expected, full, vocab_size=vocab, indices=[2, 0])
    ours = logits.clone()
    apply_bitmask_(ours, rows, bitmask, kernel=kernel)
    assert torch.equal(ours, expected)
    assert torch.equal(unpack_bitmask(bitmask, vocab), expected[[2, 0]] > float("-inf"))


def test_constraints_hold_in_one_mixed_batch(llm):
    free = "Once upon a time"
    alone = llm.generate([free], greedy(None, 64))[0].outputs[0].token_ids
    cons = [SO(choice=["yes", "no", "maybe"]), SO(regex=REGEX),
            SO(json=SCHEMA, disable_any_whitespace=True), SO(json_object=True), None,
            SO(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"')]
    prompts = ["Answer:", "Code:", "JSON:", "Object:", free, "Sum:"]
    outs = [o.outputs[0] for o in llm.generate(prompts, [greedy(c, 64) for c in cons])]
    assert outs[0].text in ("yes", "no", "maybe") and outs[0].finish_reason == "stop"
    assert re.fullmatch(REGEX, outs[1].text) and outs[1].finish_reason == "stop"
    value = json.loads(outs[2].text)  # the grammar closed it: EOS came only at the end
    assert set(value) == {"ok", "n", "tag"} and value["n"] in (1, 2, 3)
    assert re.fullmatch("[a-z]{2,4}", value["tag"])
    assert outs[4].token_ids == alone  # the masks of others never touch this row
    if outs[3].finish_reason == "stop":  # free-form JSON may run to max_tokens
        assert isinstance(json.loads(outs[3].text), dict)
    if outs[5].finish_reason == "stop":
        assert re.fullmatch(r"\(\d+(\+\d+)*\)", outs[5].text)


def test_sampling_n_stop_strings_logprobs_and_preemption(llm):
    so = SO(regex=r"(ab|cd){20,30}x")
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=60, logprobs=2,
                            structured_outputs=so)
    # 8 requests x 3 samples on 40 blocks: preemption is certain; their grammars survive.
    before = llm.engine.get_stats().num_preemptions
    outs = llm.generate([f"Say {i} " * 30 for i in range(8)], params)
    assert llm.engine.get_stats().num_preemptions > before
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length")
            assert c.finish_reason == "stop" and re.fullmatch(r"(ab|cd){20,30}x", c.text)
            assert len(c.logprobs) == len(c.token_ids)
            # The mask applies before the logprobs: a sampled token was always allowed.
            assert all(step[t].logprob > float("-inf") for t, step in
                       zip(c.token_ids, c.logprobs))
    stop = llm.generate(["x"], greedy(SO(regex=r"(ab)+cd(ab)+x"), stop=["cd"]))[0].outputs[0]
    assert stop.finish_reason == "stop" and re.fullmatch("(ab)+", stop.text)


def test_bad_constraint_is_a_value_error_before_scheduling(llm):
    engine = llm.engine
    for so, field in ((SO(regex="[a-"), "regex"), (SO(json={"type": "object",
                                                           "properties": 5}), "json"),
                      (SO(grammar="root ::= undefined_rule"), "grammar")):
        with pytest.raises(ValueError, match=f"structured_outputs.{field} cannot be used"):
            engine.add_request("bad", "hi", greedy(so))
        assert not engine.has_unfinished_requests()


def test_a_request_waiting_for_its_grammar_sits_aside_then_fails_alone(llm):
    engine = llm.engine
    manager = engine.structured_output_manager()
    engine.add_request("stuck", "hi", greedy(SO(regex="b")))
    engine.add_request("free", "hi", greedy(None, 4))
    stuck = engine.scheduler.requests["stuck"]
    stuck.structured = StructuredOutputRequest(stuck.structured.params, Future(),
                                               deadline=float("inf"))  # never compiles
    done = {}
    for _ in range(20):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        if "free" in done:
            break
    assert "free" in done and "stuck" not in done  # it ran past the waiting grammar
    assert engine.scheduler.requests["stuck"].status.name == "WAITING"
    stuck.structured.deadline = 0.0  # overdue now: that request fails, nothing else
    outs = engine.step()
    assert [o.request_id for o in outs] == ["stuck"]
    assert outs[0].outputs[0].finish_reason == "error"
    assert "did not compile within" in str(outs[0].outputs[0].stop_reason)
    assert not engine.has_unfinished_requests()
    assert manager is engine.scheduler.structured
    assert engine.scheduler.kv.block_pool.get_num_free_blocks() == \
        engine.scheduler.kv.block_pool.num_blocks - 1  # nothing leaked
