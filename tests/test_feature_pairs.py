"""Features together in one engine (docs/feature-matrix.md): each test turns several on at
once and holds the tokens to what the features give one at a time. Tiny models, fp32,
greedy; prompts repeat themselves so n-gram drafts are proposed and accepted.
"""
from __future__ import annotations

import pytest

from conftest import random_prompts
from kiln import LLM, LoRARequest, SamplingParams
from lora_utils import make_adapter
from test_gguf_convert import _tiny_model, write_tiny_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def _echo_prompts(vocab: int) -> list[list[int]]:
    """Prompts that say something twice: the n-gram drafter finds matches in them."""
    return [p + p[1:] for p in random_prompts(3, [6, 11, 17], vocab=vocab, seed=21)]


def _greedy(llm: LLM, prompts: list[list[int]], lora: LoRARequest | None
            ) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                        lora_request=lora, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.usefixtures("cpu_kernels_loaded")
def test_lora_on_native_gguf_blocks_with_ngram_drafts(tmp_path, monkeypatch):
    """An adapter on a GGUF model whose linears run natively (Q4_1, Q4_0, Q8_0 blocks),
    with n-gram speculation: the tokens of the dequantized file with the same adapter and
    no drafts, with and without the adapter, and drafts accepted."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    model = _tiny_model(tied=True, rope={"rope_theta": 1e4, "rope_type": "default"})
    types = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_0",
             "ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q4_1", "token_embd": "Q8_0"}
    path = write_tiny_gguf(model, tmp_path / "tiny.gguf", tokenizer=False, types=types)
    make_adapter(model, tmp_path / "adapter", 4, ["q_proj", "v_proj", "down_proj"], seed=3)
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    prompts = _echo_prompts(model.config.vocab_size)
    kw = dict(dtype="float32", progress=False, max_model_len=128, optimization_level=0,
              enable_lora=True, max_lora_rank=8)
    plain = LLM(str(path), quantization="none", **kw)
    want = {name: _greedy(plain, prompts, r) for name, r in (("base", None), ("lora", lora))}
    assert want["base"] != want["lora"]  # the adapter changes the answers
    llm = LLM(str(path), speculative_config=NGRAM, **kw)
    assert llm.engine.quantization.method == "gguf"
    assert _greedy(llm, prompts, lora) == want["lora"]
    assert _greedy(llm, prompts, None) == want["base"]
    assert llm.engine.get_stats().spec_decoding.num_accepted_tokens > 0


def test_ngram_drafts_beside_constrained_and_adapter_requests(tmp_path, smollm2_dir):
    """One batch of constrained requests (no drafts for them), free ones (drafted), with
    and without an adapter, under n-gram speculation: every request's tokens equal the
    engine's without speculation, the constraints hold, and drafts are accepted."""
    import re

    import transformers

    from kiln.structured_output.params import StructuredOutputsParams as SO
    from server_utils import make_tiny_chat_model

    path = make_tiny_chat_model(tmp_path / "m", smollm2_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    make_adapter(base, tmp_path / "adapter", 4, ["q_proj", "v_proj", "down_proj"], seed=4)
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    echo = _echo_prompts(base.config.vocab_size)
    cases = [(echo[0], None, lora), (echo[1], None, None),
             (echo[2], SO(regex="[a-z]{3}-[0-9]{2}"), lora),
             (echo[0], SO(choice=["yes", "no", "maybe"]), None)]
    prompts = [{"prompt_token_ids": p} for p, _, _ in cases]
    # The free rows lean hard on one token: they repeat it, so n-gram drafts are
    # proposed and accepted (this random model seldom repeats itself otherwise).
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=c is None,
                             structured_outputs=c,
                             logit_bias=None if c is not None else {p[0]: 30.0})
              for p, c, _ in cases]
    loras = [r for _, _, r in cases]
    kw = dict(dtype="float32", progress=False, max_model_len=256, optimization_level=0,
              enable_lora=True, max_lora_rank=8)

    def run(llm: LLM) -> list:
        return [o.outputs[0] for o in llm.generate(prompts, params, lora_request=loras,
                                                    use_tqdm=False)]

    want = run(LLM(str(path), **kw))
    llm = LLM(str(path), speculative_config=NGRAM, **kw)
    got = run(llm)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", got[2].text)
    assert got[3].text in ("yes", "no", "maybe")
    assert llm.engine.get_stats().spec_decoding.num_accepted_tokens > 0


def test_default_model_at_o2_holds_constraints_under_ngram_drafts_compiling_nothing():
    """The default model as users run it (native GGUF blocks, bf16, -O2, from the compile
    cache `make test` warmed): a JSON schema, a choice and a free request in one batch
    under n-gram speculation; the constraints hold, drafts are accepted, and nothing
    compiles (speculation and constraints change no compiled code)."""
    import json

    from kiln.compiler.counter import compilation_counter
    from kiln.structured_output.params import StructuredOutputsParams as SO

    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 12}}}
    llm = LLM(optimization_level=2, progress=False, max_model_len=512,
              speculative_config=NGRAM)
    assert llm.engine.quantization.method == "gguf"
    before = compilation_counter.clone()
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=c)
              for c in (SO(json=schema, disable_any_whitespace=True),
                        SO(choice=["Paris", "Rome"]), None)]
    prompts = ["Give the capital of France as JSON.", "The capital of Italy is",
               "Count: one, two, three, four, one, two, three, four, one, two,"]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not any(compilation_counter.delta(before).values())
    assert set(json.loads(outs[0].text)) == {"city"}
    assert outs[1].text in ("Paris", "Rome")
    assert llm.engine.get_stats().spec_decoding.num_accepted_tokens > 0
