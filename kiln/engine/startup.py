"""Start-up resolution of the fields that depend on the checkpoint (dtype, lengths) and
the start-up checks of a config against the model."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from kiln.compiler.cache import default_cache_root
from kiln.config.engine import EngineConfig
from kiln.kv_cache.kv_cache_spec import KVCacheGroupSpec
from kiln.models.model_config import ModelConfig
from kiln.ops import cpu_kernels
from kiln.platforms import platform_for

logger = logging.getLogger(__name__)


def resolve_dtype(config: EngineConfig, model_config: ModelConfig) -> torch.dtype:
    """dtype='auto': the checkpoint's dtype, except that float32 checkpoints run in bfloat16
    where bfloat16 runs faster (as vLLM downcasts them; see `fast_bf16`), and other
    dtypes run in bfloat16."""
    if config.torch_dtype is not None:
        return config.torch_dtype
    dtype = model_config.checkpoint_dtype
    if dtype == torch.float32 and fast_bf16(torch.device(config.device)):
        logger.info("checkpoint dtype float32 -> bfloat16 (dtype='auto'; bfloat16 is faster "
                    "on this device; pass dtype='float32' to keep float32)")
        return torch.bfloat16
    if dtype not in (torch.float32, torch.bfloat16):
        logger.info("checkpoint dtype %s -> bfloat16 (dtype='auto')", dtype)
        return torch.bfloat16
    return dtype


def fast_bf16(device: torch.device) -> bool:
    """bfloat16 faster than float32 here: the platform says where it is (kiln's CPU
    kernels' ISA classes, sm80+ on CUDA); on a CPU the kernels must also load (a missing
    compiler or a failed build leaves oneDNN's emulated bf16, slower than float32)."""
    if not platform_for(device).fast_bf16():
        return False
    return device.type != "cpu" or cpu_kernels.ensure_planned(default_cache_root(),
                                                              progress=True)


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                         f"max_position_embeddings={limit}; lower max_model_len")
    return config.max_model_len or limit


def check_tensor_parallel(mc: ModelConfig, tp: int) -> None:
    """Heads, MLP width and KV heads must split over `tp` ranks (KV heads may instead be
    replicated: tp a multiple of num_kv_heads)."""
    if mc.moe is not None and tp > 1:
        raise ValueError(f"tensor_parallel_size={tp}: {mc.architecture} is a mixture of "
                         "experts, and kiln does not shard experts yet; use -tp 1")
    problems = _tp_problems(mc, tp)
    if problems:
        fits = [d for d in range(1, mc.num_heads + 1) if not _tp_problems(mc, d)]
        raise ValueError(f"tensor_parallel_size={tp} does not split this model's "
                         f"{', '.join(problems)}; sizes that do: {fits}")


def _tp_problems(mc: ModelConfig, tp: int) -> list[str]:
    problems = []
    if mc.num_heads % tp:
        problems.append(f"num_attention_heads={mc.num_heads}")
    if mc.intermediate_size % tp:
        problems.append(f"intermediate_size={mc.intermediate_size}")
    nkv = mc.num_kv_heads
    if (nkv % tp) if tp <= nkv else (tp % nkv):
        problems.append(f"num_key_value_heads={nkv} (tp must divide it or be a multiple "
                        "of it)")
    return problems


def check_sliding_window(mc: ModelConfig, config: EngineConfig) -> None:
    """Features that assume every layer keeps every token's KV: a KV connector (its
    tier stores whole-model blocks of one group) and a draft model (it reads the
    target's block tables as its own)."""
    if not mc.has_sliding_window:
        return
    if config.kv_transfer_config is not None:
        raise ValueError(f"kv_transfer_config: {mc.architecture} has sliding-window layers "
                         "(a hybrid KV cache), which kiln's KV connectors do not support "
                         "yet; drop kv_transfer_config")
    sc = config.speculative_config
    if sc is not None and sc.uses_draft_kv:
        raise ValueError(f"speculative_config.method={sc.method!r}: {mc.architecture} has "
                         "sliding-window layers, whose block tables a draft model cannot "
                         "share yet; use method 'ngram'")


def check_kv_capacity(num_blocks: int, groups: list[KVCacheGroupSpec], max_model_len: int,
                      max_chunk: int) -> None:
    """One request of max_model_len tokens must fit the pool alone, in every group at
    once (a sliding window holds only the blocks its window and a chunk reach)."""
    block_size = groups[0].spec.block_size
    needed = sum(g.spec.max_blocks_held(max_model_len, max_chunk) for g in groups)
    if needed > num_blocks - 1:  # block 0 is the null block
        raise ValueError(f"the KV cache has {num_blocks - 1} usable blocks of {block_size} "
                         f"tokens but one request of max_model_len={max_model_len} needs "
                         f"{needed} over {len(groups)} KV-cache group(s): raise "
                         "kv_cache_memory / num_kv_blocks or lower max_model_len")


def load_tokenizer(path: Path) -> Any | None:
    """The checkpoint's tokenizer, or None when the directory ships none (token-id
    prompts still work; outputs then carry no text)."""
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                              "tokenizer.model")):
        logger.warning("no tokenizer files in %s: prompts must be token ids", path)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def check_draft_model(sc: Any, target: ModelConfig, tokenizer: Any,
                      progress: bool) -> ModelConfig:
    """The draft checkpoint's config, after checking it shares the target's vocabulary
    (its token ids must mean the same tokens)."""
    from kiln.models.model_source import DEFAULT_MODEL, resolve_model

    name = None if sc.model in (None, "default", DEFAULT_MODEL) else sc.model
    path = resolve_model(name, progress=progress)
    draft = ModelConfig.from_pretrained(path)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model {sc.model!r} has vocab_size "
                         f"{draft.vocab_size} but the target has {target.vocab_size}: the "
                         "draft must share the target's tokenizer")
    draft_tok = load_tokenizer(path)
    if tokenizer is not None and draft_tok is not None \
            and draft_tok.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"speculative_config.model {sc.model!r} has another tokenizer "
                         "than the target (same size, other tokens): the draft must share "
                         "the target's tokenizer")
    return draft


def kv_fingerprint(path: Path, gguf: Path | None) -> dict[str, Any]:
    """What names the weights for a KV connector's namespace: the checkpoint directory,
    and the GGUF file behind it when there is one (its blocks may be run natively)."""
    from kiln.kv_transfer.layout import model_fingerprint

    out = {"checkpoint": model_fingerprint(path)}
    if gguf is not None:
        out["gguf"] = model_fingerprint(gguf)
    return out


KV_TRANSFER_PARAMS = ("do_remote_prefill", "do_remote_decode")


def check_kv_transfer_params(params: Any) -> None:
    """A request's kv_transfer_params: a dict of the flags kiln's P/D flow knows."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be a dict such as "
                         "{\"do_remote_prefill\": true}")
    unknown = sorted(set(params) - set(KV_TRANSFER_PARAMS))
    if unknown:
        raise ValueError(f"kv_transfer_params has unknown key(s) {unknown}; known: "
                         f"{list(KV_TRANSFER_PARAMS)}")
    for key, value in params.items():
        if not isinstance(value, bool):
            raise ValueError(f"kv_transfer_params.{key}={value!r} must be true or false")
