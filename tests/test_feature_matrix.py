"""The cells of docs/feature-matrix.md that no other test holds: each test turns several
features on in one engine and holds its tokens to an engine without the features that
must not change them (speculation, a KV connector, prefix caching, tp, pp), whose own
parity is tested elsewhere; quantized and adapted rows against their float references.
Tiny models, fp32, greedy, -O0 (the compiled levels change no feature's code: the
`-O2` cells of the matrix are their own tests).
"""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import TINY, random_prompts
from lora_utils import make_adapter, peft_greedy
from server_utils import _TOKENIZER_FILES, free_port, make_tiny_chat_model
from test_gguf_convert import _tiny_model, write_tiny_gguf
from test_hybrid_kv import CONFIGS as WINDOWED
from test_kv_transfer import _disk, _pd, decode_outputs
from test_moe import CONFIGS as MOE
from test_pipeline_parallel import run_cases
from test_quantization import _write_dequantized

from kiln import LLM, LoRARequest, SamplingParams
from kiln.ops.quant_packing import quantize_int8_groups
from kiln.structured_output.params import StructuredOutputsParams as SO

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
REGEX = "[a-z]{3}-[0-9]{2}"
MAX_NEW = 12
KW = dict(dtype="float32", progress=False, optimization_level=0, max_model_len=192)
LORA_KW = dict(enable_lora=True, max_lora_rank=8)


class Rows:
    """One batch of mixed requests over a shared prefix (prefix-cache and tier hits):
    free rows that lean on one token (so n-gram drafts are proposed and accepted),
    constrained rows (no drafts for them), with and without an adapter."""

    def __init__(self, vocab: int, lora: LoRARequest | None, constrained: bool,
                 bias: bool = True) -> None:
        shared = random_prompts(1, [40], vocab=vocab, seed=31)[0]
        tails = random_prompts(4, [3, 9, 5, 14], vocab=vocab, seed=32)
        self.prompts = [shared + t for t in tails]
        free = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                               logit_bias={p[-1]: 30.0} if bias else None)
                for p in self.prompts]
        self.params = free
        self.loras = [lora, None, lora, None]
        if constrained:
            self.params = free[:2] + [
                SamplingParams(temperature=0, max_tokens=MAX_NEW,
                               structured_outputs=SO(regex=REGEX)),
                SamplingParams(temperature=0, max_tokens=MAX_NEW,
                               structured_outputs=SO(choice=["yes", "no", "maybe"]))]

    def run(self, llm: LLM) -> list:
        outs = llm.generate([{"prompt_token_ids": p} for p in self.prompts], self.params,
                            lora_request=self.loras, use_tqdm=False)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        llm.engine.flush_kv_saves()
        return [o.outputs[0] for o in outs]

    def check_constraints(self, outs: list) -> None:
        assert re.fullmatch(REGEX, outs[2].text), outs[2].text
        assert outs[3].text in ("yes", "no", "maybe"), outs[3].text


def _through_pd(path: Path, rows: Rows, decode_kw: dict | None = None, **kw
                ) -> tuple[list, int]:
    """The rows prefilled by a producer instance and decoded by a consumer that loads
    every prompt's blocks from it (torch_distributed P/D, both in this process): its
    outputs and, with speculation, the drafts it accepted."""
    port = free_port()
    prefill = LLM(str(path), **KW, **kw, kv_transfer_config=_pd("kv_producer", port))
    decode = LLM(str(path), **KW, **kw, **(decode_kw or {}),
                 kv_transfer_config=_pd("kv_consumer", port, remote_timeout_s=60))
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prefill.generate([{"prompt_token_ids": p} for p in rows.prompts], one,
                     lora_request=rows.loras, use_tqdm=False)
    outs = decode_outputs(decode, rows.prompts, rows.params, True, rows.loras)
    eng = decode.engine
    assert eng.get_stats().kv_transfer.hit_tokens > 0
    accepted = _accepted(decode) if decode_kw else 0
    prefill.shutdown()
    decode.shutdown()
    return outs, accepted


def _tiny_gguf(path: Path, types: dict[str, str]):
    """A tiny tied Llama written as a GGUF file with these block types; (file, model)."""
    model = _tiny_model(tied=True, rope={"rope_theta": 1e4, "rope_type": "default"})
    return write_tiny_gguf(model, path, tokenizer=False, types=types), model


def _tokens(outs: list) -> list[list[int]]:
    return [o.token_ids for o in outs]


def _accepted(llm: LLM) -> int:
    return llm.engine.get_stats().spec_decoding.num_accepted_tokens


@pytest.fixture(scope="module")
def chat(tmp_path_factory, smollm2_dir):
    """A tiny Llama with SmolLM2's tokenizer (constraints need one), an adapter, and the
    int8 reference: the same checkpoint with every linear as dequant(quantize(w))."""
    root = tmp_path_factory.mktemp("matrix")
    path = make_tiny_chat_model(root / "m", smollm2_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    make_adapter(base, root / "adapter", 4, ["q_proj", "v_proj", "down_proj"], seed=5)
    _write_dequantized(path, root / "int8-ref", quantize_int8_groups)
    lora = LoRARequest("adapter", 1, str(root / "adapter"))
    ref = LLM(str(root / "int8-ref"), **KW, **LORA_KW)
    # Two batches: free rows that lean on a token (n-gram drafts find it), and free rows
    # left alone (a draft model has no logit bias, so only those accept its drafts).
    out = {}
    for name, bias in (("ngram", True), ("draft", False)):
        rows = Rows(base.config.vocab_size, lora, constrained=True, bias=bias)
        out[name] = rows, _tokens(rows.run(ref))
    return path, out


def test_int8_with_lora_ngram_constraints_prefix_hits_and_the_disk_tier(chat, tmp_path):
    """int8 x LoRA x n-gram x structured output x prefix caching x the disk tier, in one
    batch: the tokens of the dequantized-int8 checkpoint with the adapter and none of the
    rest; again after a restart, from the tier."""
    path, batches = chat
    rows, want = batches["ngram"]
    kw = dict(**KW, **LORA_KW, quantization="int8", speculative_config=NGRAM,
              kv_transfer_config=_disk(tmp_path / "tier"))
    for restart in (False, True):
        llm = LLM(str(path), **kw)
        assert llm.engine.quantization.method == "int8"
        got = rows.run(llm)
        assert _tokens(got) == want, restart
        rows.check_constraints(got)
        stats = llm.engine.get_stats()
        assert stats.spec_decoding.num_accepted_tokens > 0
        assert stats.prefix_cache_hits > 0
        kt = stats.kv_transfer
        assert (kt.blocks_loaded > 0) if restart else (kt.blocks_saved > 0)
        llm.shutdown()


def test_draft_model_with_int8_lora_constraints_and_prefix_hits(chat):
    """A draft model (the float checkpoint drafting for its int8 self) x int8 x LoRA x
    structured output x prefix caching: the same tokens; the draft runs the base model,
    so adapted rows accept fewer drafts, and every token is still the target's."""
    path, batches = chat
    rows, want = batches["draft"]
    llm = LLM(str(path), **KW, **LORA_KW, quantization="int8",
              speculative_config={"method": "draft_model", "model": str(path),
                                  "num_speculative_tokens": 3})
    got = rows.run(llm)
    assert _tokens(got) == want
    rows.check_constraints(got)
    assert _accepted(llm) > 0


def test_pd_with_int8_lora_ngram_and_constraints(chat):
    """torch_distributed P/D x int8 x LoRA x n-gram x structured output: the prefill
    instance computes every prompt (with its adapter), the decode instance loads the
    blocks and answers as one instance would."""
    path, batches = chat
    rows, want = batches["ngram"]
    got, accepted = _through_pd(path, rows, dict(speculative_config=NGRAM), **LORA_KW,
                                quantization="int8")
    assert _tokens(got) == want and accepted > 0
    rows.check_constraints(got)


def test_native_gguf_blocks_with_the_disk_tier_a_draft_and_pd(tmp_path, monkeypatch):
    """GGUF blocks (Q8_0, Q4_1) x the disk tier x n-gram (across a restart), x a draft
    model, x P/D: the tokens of the same blocks with none of them."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    types = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q4_1",
             "ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q4_1", "token_embd": "Q8_0"}
    gguf, model = _tiny_gguf(tmp_path / "tiny.gguf", types)
    path = str(gguf)
    model.save_pretrained(tmp_path / "draft")
    rows = Rows(model.config.vocab_size, None, constrained=False)
    unbiased = Rows(model.config.vocab_size, None, constrained=False, bias=False)
    plain = LLM(path, **KW)
    assert plain.engine.quantization.method == "gguf"
    want, want_unbiased = _tokens(rows.run(plain)), _tokens(unbiased.run(plain))
    plain.shutdown()
    for restart in (False, True):
        llm = LLM(path, **KW, speculative_config=NGRAM,
                  kv_transfer_config=_disk(tmp_path / "tier"))
        assert _tokens(rows.run(llm)) == want and _accepted(llm) > 0
        assert llm.engine.get_stats().prefix_cache_hits > 0
        kt = llm.engine.get_stats().kv_transfer
        assert (kt.blocks_loaded > 0) if restart else (kt.blocks_saved > 0)
        llm.shutdown()
    llm = LLM(path, **KW, speculative_config={"method": "draft_model",
                                               "model": str(tmp_path / "draft"),
                                               "num_speculative_tokens": 3})
    assert _tokens(unbiased.run(llm)) == want_unbiased and _accepted(llm) > 0
    llm.shutdown()
    got, _ = _through_pd(Path(path), rows)
    assert _tokens(got) == want


# ---- the sliding-window and MoE families -------------------------------------------------
# The family tests' tiny configurations (test_hybrid_kv.py, test_moe.py).
FAMILIES = {"gemma2": WINDOWED["gemma2"], "mixtral": MOE["mixtral"]}


def _family(kind: str, root: Path, smollm2_dir: Path):
    """A tiny model of the family with SmolLM2's tokenizer and vocabulary."""
    config = FAMILIES[kind]()
    config.vocab_size = transformers.AutoConfig.from_pretrained(smollm2_dir).vocab_size
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    path = root / kind
    model.save_pretrained(path)
    for name in _TOKENIZER_FILES:
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, path / name)
    return path, model


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_families_with_lora_ngram_constraints_int8_and_more(kind, tmp_path, smollm2_dir,
                                                            caplog):
    """Each family x LoRA (against peft) x n-gram x structured output in one batch; x int8
    (against its dequantized checkpoint). MoE also x the disk tier, x a draft model and x
    P/D (all three refused with sliding windows: test_hybrid_kv.py and the refusals
    below)."""
    path, model = _family(kind, tmp_path, smollm2_dir)
    peft_model = make_adapter(model, tmp_path / "adapter", 4, ["q_proj", "v_proj"], seed=6)
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    rows = Rows(model.config.vocab_size, lora, constrained=True)
    plain = LLM(str(path), **KW, **LORA_KW)
    want = rows.run(plain)
    # kiln's adapter on this family is peft's (a row without the logit bias).
    alone = plain.generate({"prompt_token_ids": rows.prompts[0]},
                           SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                           lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == peft_greedy(peft_model, rows.prompts[:1], MAX_NEW)[0]
    plain.shutdown()
    extra = {"mixtral": dict(kv_transfer_config=_disk(tmp_path / "tier"))}.get(kind, {})
    llm = LLM(str(path), **KW, **LORA_KW, speculative_config=NGRAM, **extra)
    got = rows.run(llm)
    assert _tokens(got) == _tokens(want)
    rows.check_constraints(got)
    assert _accepted(llm) > 0
    llm.shutdown()
    if kind == "mixtral":
        unbiased = Rows(model.config.vocab_size, lora, constrained=True, bias=False)
        plain = LLM(str(path), **KW, **LORA_KW)
        want = _tokens(unbiased.run(plain))
        plain.shutdown()
        llm = LLM(str(path), **KW, **LORA_KW, speculative_config={
            "method": "draft_model", "model": str(path), "num_speculative_tokens": 3})
        assert _tokens(unbiased.run(llm)) == want and _accepted(llm) > 0
        llm.shutdown()
        got, _ = _through_pd(path, unbiased, **LORA_KW)
        assert _tokens(got) == want
    # int8 quantizes the attention and dense linears; the experts and the router stay
    # float (a start-up warning says so).
    _write_dequantized(path, tmp_path / "int8-ref", quantize_int8_groups,
                       skip="block_sparse_moe")
    free = Rows(model.config.vocab_size, None, constrained=False)
    ref = _tokens(free.run(LLM(str(tmp_path / "int8-ref"), **KW)))
    with caplog.at_level(logging.WARNING, logger="kiln.runner.load"):
        llm = LLM(str(path), **KW, quantization="int8")
    assert ("the experts' weights stay" in caplog.text) == (kind == "mixtral")
    assert _tokens(free.run(llm)) == ref


# ---- tp and pp ---------------------------------------------------------------------------
def _case(path: Path, rows: Rows, **case) -> dict:
    params = [{"regex": p.structured_outputs.regex} if p.structured_outputs is not None
              else {"logit_bias": p.logit_bias or {}} for p in rows.params]
    return {"model": str(path), "level": 0, "tp": 1, "backend": "mp",
            "prompts": rows.prompts, "params": params, "max_tokens": MAX_NEW, **case}


def _regex_rows(vocab: int) -> Rows:
    rows = Rows(vocab, None, constrained=False)
    rows.params[2] = SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                    structured_outputs=SO(regex=REGEX))
    return rows


def test_tp_and_pp_with_quantization_speculation_constraints_and_families(
        tmp_path, smollm2_dir, monkeypatch):
    """One engine process, one engine per case, each against the same engine at tp = pp
    = 1 in this process: tp=2 x int8 x n-gram x structured output x prefix caching;
    tp=2 x a sliding-window family; pp=2 x structured output; pp=2 x GGUF blocks; pp=2 x
    MoE."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))  # the workers inherit it
    chat = make_tiny_chat_model(tmp_path / "chat", smollm2_dir)
    chat_rows = _regex_rows(transformers.AutoConfig.from_pretrained(chat).vocab_size)
    gemma, _ = _family("gemma2", tmp_path, smollm2_dir)
    mixtral, _ = _family("mixtral", tmp_path, smollm2_dir)
    vocab = transformers.AutoConfig.from_pretrained(gemma).vocab_size
    free = Rows(vocab, None, constrained=False)
    gguf, _ = _tiny_gguf(tmp_path / "tiny.gguf",
                         {"attn_q": "Q8_0", "ffn_down": "Q4_1", "ffn_up": "Q8_0"})
    gguf_rows = Rows(268, None, constrained=False)
    tp_engine = {"quantization": "int8", "speculative_config": NGRAM}
    cases = [_case(chat, chat_rows, tp=2, engine=tp_engine),
             _case(gemma, free, tp=2),
             _case(chat, chat_rows, pp=2),
             _case(gguf, gguf_rows, pp=2),
             _case(mixtral, free, pp=2)]
    results = run_cases(cases)
    for case, rows, got in zip(cases, [chat_rows, free, chat_rows, gguf_rows, free], results):
        llm = LLM(case["model"], **{**KW, "max_model_len": 128}, num_kv_blocks=64,
                  **case.get("engine", {}))
        want = rows.run(llm)
        llm.shutdown()
        assert got["tokens"] == _tokens(want), (case["model"], case["tp"], case.get("pp"))
        if case["model"] == str(chat):
            assert re.fullmatch(REGEX, got["texts"][2]), got["texts"][2]
    assert results[0]["drafts_accepted"] > 0 and results[0]["prefix_hits"] > 0


def test_pairs_refused_at_start_up_name_both_features(tmp_path, tiny_models):
    """Refused pairs fail at start-up with a ValueError that names both features."""
    path = str(tiny_models["llama"][0])
    draft = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    refused = [  # (LLM keyword arguments, what the message names)
        (dict(tensor_parallel_size=2, speculative_config=draft),
         "draft_model.*tensor_parallel_size=1"),
        (dict(speculative_config=draft, kv_transfer_config=_disk(tmp_path / "t")),
         "draft_model.*kv_transfer_config"),
        (dict(speculative_config=draft, kv_transfer_config=_pd("kv_consumer", 1)),
         "draft_model.*kv_transfer_config"),
        (dict(pipeline_parallel_size=2, distributed_executor_backend="mp",
              speculative_config=draft), "speculative_config does not run with pipeline"),
        (dict(pipeline_parallel_size=2, distributed_executor_backend="mp",
              kv_transfer_config=_disk(tmp_path / "t")),
         "kv_transfer_config.*pipeline_parallel_size=2"),
        (dict(pipeline_parallel_size=2, distributed_executor_backend="mp",
              kv_transfer_config=_pd("kv_producer", 1)),
         "kv_transfer_config.*pipeline_parallel_size=2"),
        (dict(tensor_parallel_size=2, kv_transfer_config=_pd("kv_producer", 1)),
         "kv_transfer_config.*tensor_parallel_size=1"),
    ]
    for kwargs, words in refused:
        with pytest.raises(ValueError, match=words):
            LLM(path, progress=False, optimization_level=0, **kwargs)
    gguf, _ = _tiny_gguf(tmp_path / "tiny.gguf", {"attn_q": "Q8_0"})
    with pytest.raises(ValueError, match="quantization='gguf'.*tensor_parallel_size=1"):
        LLM(str(gguf), progress=False, optimization_level=0, tensor_parallel_size=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(FAMILIES["gemma2"]()).save_pretrained(
        tmp_path / "gemma2")
    with pytest.raises(ValueError, match="kv_transfer_config: Gemma2ForCausalLM has "
                                         "sliding-window layers"):
        LLM(str(tmp_path / "gemma2"), progress=False, optimization_level=0,
            kv_transfer_config=_pd("kv_producer", 1))
    # A hybrid whose two stages would hold different window/full mixes (layers 0-1 full,
    # 2-3 sliding): the workers find it at start-up.
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(
        **dict(TINY, num_hidden_layers=4), use_sliding_window=True, sliding_window=24,
        max_window_layers=2)).save_pretrained(tmp_path / "qwen2")
    with pytest.raises(ValueError, match="pipeline stages lay out their KV cache "
                                         "differently.*sliding-window"):
        LLM(str(tmp_path / "qwen2"), progress=False, optimization_level=0, dtype="float32",
            pipeline_parallel_size=2, distributed_executor_backend="mp")
