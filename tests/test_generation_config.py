"""Default sampling parameters from the model's generation_config.json (`generation_config`
auto | kiln | PATH): in LLM, the CLI and the OpenAI server alike; an explicit field wins."""
from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import transformers
from gguf import GGUFWriter
from server_utils import (API_KEY, ENGINE_KWARGS, MODEL_NAME, make_tiny_chat_model,
                          start_server, stop_server, wait_ready)
from test_gguf_convert import _tiny_model, write_tiny_gguf

from kiln import LLM, SamplingParams
from kiln.bench.chat_defaults import (distinct_2, format_chat_defaults, loops,
                                       run_chat_defaults)
from kiln.config.generation import parse_generation_config, parse_override
from kiln.entrypoints.openai.params import to_sampling_params
from kiln.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kiln.models.gguf_convert import add_sampling_defaults
from kiln.models.model_source import DEFAULT_CHAT_SAMPLING, resolve_model
from kiln.sampling.defaults import generation_defaults, with_defaults

# What the test model's file declares: a strong penalty and a top_k, plus unrelated keys.
FILE = {"repetition_penalty": 1.6, "top_k": 5, "max_new_tokens": 10, "do_sample": True,
        "bos_token_id": 1, "eos_token_id": 2, "num_beams": 1}
WANT = {"repetition_penalty": 1.6, "top_k": 5, "max_tokens": 10}


def test_sources_parse_and_fail_by_name(tmp_path):
    assert parse_generation_config("auto") == "auto"
    assert parse_generation_config("vllm") == parse_generation_config("kiln") == "kiln"
    (tmp_path / "generation_config.json").write_text(json.dumps(FILE))
    path = parse_generation_config(tmp_path)  # a folder means the file in it
    assert path == str(tmp_path / "generation_config.json")
    assert generation_defaults(path, Path("/nonexistent")) == WANT
    assert generation_defaults("auto", tmp_path) == WANT
    assert generation_defaults("kiln", tmp_path) == {}
    assert generation_defaults("kiln", tmp_path, {"temperature": 0}) == {"temperature": 0}
    assert generation_defaults("auto", tmp_path, parse_override('{"top_k": 7}'))["top_k"] == 7
    with pytest.raises(ValueError, match="generation_config='/nope'.*'auto'.*'kiln'"):
        parse_generation_config("/nope")
    with pytest.raises(ValueError, match="override_generation_config: unknown key.*seed"):
        parse_override({"seed": 3})
    with pytest.raises(ValueError, match="override_generation_config.*not valid JSON"):
        parse_override("{temperature")
    with pytest.raises(ValueError, match="^override_generation_config: top_k=40.5"):
        generation_defaults("auto", tmp_path, {"top_k": 40.5})  # not blamed on the file
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 3.0}))
    with pytest.raises(ValueError, match="generation_config.json: top_p=3.0 must be"):
        generation_defaults("auto", tmp_path)


def test_an_explicit_field_wins_and_greedy_stays_greedy():
    defaults = {"temperature": 0.7, "repetition_penalty": 1.2}
    assert with_defaults(defaults, {"temperature": 0.0, "top_p": None}) == \
        {"temperature": 0.0, "repetition_penalty": 1.2}
    req = CompletionRequest(prompt="x", temperature=0.0)
    params = to_sampling_params(req, 10, 64, defaults={**defaults, "max_tokens": 20})
    assert (params.temperature, params.repetition_penalty, params.max_tokens) == (0.0, 1.2, 20)
    req = CompletionRequest(prompt="x", repetition_penalty=1.0, max_tokens=5)
    params = to_sampling_params(req, 10, 64, defaults={**defaults, "max_tokens": 20})
    assert (params.temperature, params.repetition_penalty, params.max_tokens) == (0.7, 1.0, 5)
    # A constrained request takes no default repetition penalty (it fought JSON's repeats);
    # an explicit one still applies.
    choice = {"choice": ["yes", "no"]}
    req = CompletionRequest(prompt="x", structured_outputs=choice)
    assert to_sampling_params(req, 10, 64, defaults=defaults).repetition_penalty == 1.0
    req = CompletionRequest(prompt="x", structured_outputs=choice, repetition_penalty=1.3)
    assert to_sampling_params(req, 10, 64, defaults=defaults).repetition_penalty == 1.3
    # The default max_tokens never exceeds what fits after the prompt.
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert to_sampling_params(req, 60, 64, defaults={"max_tokens": 20}).max_tokens == 4


def test_gguf_sampling_keys_reach_generation_config(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))

    def sampling(writer: GGUFWriter) -> None:
        writer.add_sampling_temp(0.8)
        writer.add_sampling_top_k(40)
        writer.add_sampling_penalty_repeat(1.05)
        writer.add_sampling_mirostat(2)  # no kiln equivalent: logged, not applied
        writer.add_sampling_min_p(1.5)  # outside what kiln accepts: logged, not applied

    model = _tiny_model(tied=True, rope={"rope_theta": 10000.0, "rope_type": "default"})
    path = write_tiny_gguf(model, tmp_path / "s.gguf", tokenizer=False, metadata=sampling)
    out = resolve_model(str(path), progress=False)
    data = json.loads((out / "generation_config.json").read_text())
    assert {k: data[k] for k in ("temperature", "top_k", "repetition_penalty")} == \
        {"temperature": 0.8, "top_k": 40, "repetition_penalty": 1.05}
    assert data["do_sample"] is True and "mirostat" not in json.dumps(data)
    assert "min_p" not in data
    assert transformers.GenerationConfig.from_pretrained(out).top_k == 40  # still valid
    assert generation_defaults("auto", out)["temperature"] == 0.8


def test_default_model_ships_its_chat_defaults(smollm2_dir, tmp_path):
    data = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert {k: data[k] for k in DEFAULT_CHAT_SAMPLING} == DEFAULT_CHAT_SAMPLING
    # A file that already chose sampling keys is not touched by the upgrade path.
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert not add_sampling_defaults(tmp_path, DEFAULT_CHAT_SAMPLING, replace=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    path = make_tiny_chat_model(tmp_path_factory.mktemp("genconf") / "model", smollm2_dir)
    (path / "generation_config.json").write_text(json.dumps(FILE))
    return path


@pytest.fixture(scope="module")
def llms(model_dir):
    kw = dict(progress=False, dtype="float32", **ENGINE_KWARGS)
    return LLM(str(model_dir), **kw), LLM(str(model_dir), generation_config="kiln", **kw)


def _greedy(llm: LLM, prompt: list[int], **fields) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **fields)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return out[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def prompt(llms) -> list[int]:
    """A prompt whose greedy answer repeats a token, so a repetition penalty changes it
    (the random model rarely repeats by itself): its own plain answer, twice."""
    auto = llms[0]
    ids = auto.get_tokenizer().encode("a a a a a", add_special_tokens=False)
    answer = _greedy(auto, ids)
    prompt = answer * 2
    assert _greedy(auto, prompt, repetition_penalty=1.6) != _greedy(auto, prompt)
    return prompt


def test_llm_reads_the_models_file_and_kiln_ignores_it(llms, prompt):
    auto, kiln = llms
    got = auto.get_default_sampling_params()
    assert (got.repetition_penalty, got.top_k, got.max_tokens) == (1.6, 5, 10)
    assert kiln.get_default_sampling_params() == SamplingParams()
    # With no sampling_params a request takes the defaults (10 tokens, not SamplingParams'
    # 16; the penalty); an explicit SamplingParams is used as given.
    out = auto.generate({"prompt_token_ids": prompt}, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 10 or out.finish_reason == "stop"
    assert len(kiln.generate("Hi", use_tqdm=False)[0].outputs[0].token_ids) in range(1, 17)


def test_cli_flags_win_over_the_file(model_dir, llms, prompt, capsys):
    from kiln.cli.main import main

    text = llms[0].get_tokenizer().decode(prompt)
    flags = ["--model", str(model_dir), "-O0", "--dtype", "float32", "--num-kv-blocks", "64",
             "--ignore-eos", text]
    assert main(["generate", *flags]) == 0
    shown = capsys.readouterr().out
    assert "generation config: max_tokens=10, repetition_penalty=1.6, top_k=5" in shown
    assert "| 10 tokens" in shown  # the file's max_new_tokens, not the CLI's 64
    assert main(["generate", "--generation-config", "kiln", "--max-tokens", "3", *flags]) == 0
    shown = capsys.readouterr().out
    assert "| 3 tokens" in shown and "generation config:" not in shown


def test_server_applies_the_defaults_unless_a_field_is_sent(model_dir, llms, prompt, tmp_path):
    auto, _ = llms
    server = start_server(model_dir, tmp_path / "server.log", "--dtype", "float32")
    try:
        wait_ready(server)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)

        def complete(**extra) -> tuple[str, int]:
            r = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                          extra_body={"ignore_eos": True, **extra})
            return r.choices[0].text, r.usage.completion_tokens

        def reference(**fields) -> tuple[str, int]:
            ids = _greedy(auto, prompt, **fields)
            return auto.get_tokenizer().decode(ids), len(ids)

        # No max_tokens and no penalty sent: the file's 10 tokens, penalized.
        assert complete() == reference(repetition_penalty=1.6)
        assert complete(repetition_penalty=1.0, max_tokens=10) == reference()
        assert "Default sampling parameters" in server.log()
    finally:
        stop_server(server)


def test_the_harness_reports_every_candidate(llms):
    result = run_chat_defaults(llms[0], max_tokens=4, seeds=1)
    names = [r["name"] for r in result["rows"]]
    assert names[0] == "greedy" and names[-1] == "the model's generation config"
    assert all(0 <= r["loop_rate"] <= 1 and 0 < r["mean_tokens"] <= 4 for r in result["rows"])
    assert "repetition_penalty 1.1" in format_chat_defaults(result)
    assert loops("a flame that will not rest, a flame that will not rest, a flame that will")
    assert not loops("In the heart of the earth, a fire that burns with passion.")
    assert distinct_2("a b a b a b") == pytest.approx(2 / 5)
