"""GGUF files of the newer families: Gemma 2, Gemma 3, Qwen2-MoE, and Mixtral (a `llama`
file with experts).

Each file is written here from a tiny random transformers checkpoint the way llama.cpp's
converter writes it: gguf's own tensor-name map (llama.cpp's names, independent of kiln's
table), Gemma's norms stored as 1 + w, llama's Q/K rows permuted, each projection's experts
stacked into one 3-D tensor, the metadata keys llama.cpp reads. kiln must load each one token-exact with the
model it came from, and run quantized attention natively where it is Q8_0.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from conftest import TINY, hf_greedy, random_prompts
from kiln import LLM, SamplingParams
from test_gguf_convert import add_dims, finish_gguf, llama_cpp_permute

CONFIGS = {
    "gemma2": lambda: transformers.Gemma2Config(
        **dict(TINY, num_hidden_layers=4), head_dim=32, sliding_window=24,
        query_pre_attn_scalar=32, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **dict(TINY, num_hidden_layers=6), head_dim=32, sliding_window=24,
        query_pre_attn_scalar=32, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mixtral": lambda: transformers.MixtralConfig(
        **dict(TINY, intermediate_size=96), num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **dict(TINY, intermediate_size=96), num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, norm_topk_prob=False),
}
ARCH = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3,
        "mixtral": gguf.MODEL_ARCH.LLAMA, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = random_prompts(3, [5, 40, 17], seed=31)
_EXPERT = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)"
                     r"\.weight")


def _tensors(checkpoint: dict[str, torch.Tensor], kind: str,
             cfg: transformers.PretrainedConfig) -> Iterator[tuple[str, np.ndarray]]:
    names = gguf.get_tensor_name_map(ARCH[kind], cfg.num_hidden_layers)
    stacks: dict[str, list[np.ndarray]] = {}
    for name, tensor in checkpoint.items():
        array = tensor.float().numpy().copy()
        if (m := _EXPERT.fullmatch(name)) is not None:
            stacks.setdefault(f"{m[1]}.{m[3]}", []).append(array)  # experts in index order
            continue
        if name == "lm_head.weight":  # only in untied checkpoints (save_pretrained drops it)
            yield "output.weight", array
            continue
        if kind.startswith("gemma") and name.endswith("norm.weight"):
            array = array + 1  # llama.cpp stores Gemma's (1 + w) scale
        if kind == "mixtral" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        if name.endswith("shared_expert_gate.weight"):
            array = array.reshape(-1)  # llama.cpp writes the [1, H] gate as [H]
        base, suffix = name.rsplit(".", 1)
        yield f"{names.get_name(base)}.{suffix}", array
    for base, arrays in stacks.items():
        yield f"{names.get_name(base)}.weight", np.stack(arrays)


def write_gguf(src: Path, kind: str, path: Path, types: dict[str, str]) -> Path:
    """`types`: GGUF tensor kind ("attn_q", ...) -> quantized type name for that kind."""
    cfg = transformers.AutoConfig.from_pretrained(src)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[ARCH[kind]])
    add_dims(w, cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.rope_parameters
    if kind == "gemma3":
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
        w.add_sliding_window(cfg.sliding_window)
    else:
        w.add_rope_freq_base(rope["rope_theta"])
    if kind == "gemma2":
        w.add_sliding_window(cfg.sliding_window)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if kind == "mixtral":
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if kind == "qwen2_moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    checkpoint = load_file(str(src / "model.safetensors"))
    finish_gguf(w, _tensors(checkpoint, kind, cfg), types)
    return path


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    out = {}
    for kind, make in CONFIGS.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(make()).float().eval()
        with torch.no_grad():  # random norms: a missed 1 + w shift cannot go unnoticed
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.3)
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path)
        out[kind] = path, [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]
    return out


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_gguf_family_matches_transformers(family_checkpoints, kind, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    src, refs = family_checkpoints[kind]
    path = write_gguf(src, kind, tmp_path / f"{kind}.gguf", {})
    llm = LLM(str(path), dtype="float32", progress=False, optimization_level=0,
              max_model_len=128)
    assert llm.engine.runner.config.architecture == transformers.AutoConfig.from_pretrained(
        src).architectures[0]
    assert _greedy(llm) == refs


@pytest.mark.usefixtures("cpu_kernels_loaded")
@pytest.mark.parametrize("kind", ["gemma3", "qwen2_moe"])
def test_gguf_q8_attention_runs_natively_without_a_rope_permutation(family_checkpoints, kind,
                                                                    tmp_path, monkeypatch):
    """Q/K rows of these files are in Hugging Face order (NEOX RoPE): the native path
    must not un-permute them. Expert stacks (Q8_0 here too) load dequantized."""
    from kiln.ops.quant_packing import Q8

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    src, _ = family_checkpoints[kind]
    types = {k: "Q8_0" for k in ("attn_q", "attn_k", "attn_v", "attn_output",
                                 "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
    path = write_gguf(src, kind, tmp_path / f"{kind}.gguf", types)
    kw = dict(dtype="float32", progress=False, optimization_level=0, max_model_len=128)
    want = _greedy(LLM(str(path), quantization="none", **kw))
    llm = LLM(str(path), **kw)
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert (attn.qkv_proj.qfmt, attn.o_proj.qfmt) == (Q8, Q8)
    assert _greedy(llm) == want


def test_unsupported_gguf_architecture_lists_the_supported_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "phi3")
    w.add_block_count(1)
    finish_gguf(w, iter([("token_embd.weight", np.zeros((8, 4), dtype=np.float32))]), {})
    with pytest.raises(ValueError, match="'phi3' is not supported.*gemma2, gemma3, llama, "
                                         "qwen2moe"):
        LLM(str(tmp_path / "x.gguf"), dtype="float32", progress=False)
