"""`kiln bench quality`: what quantization costs in quality, per method, in one run.

Two measures for each method (`none` at the engine's dtype is the reference):
- perplexity over a fixed public-domain text shipped with kiln (the Declaration of
  Independence, kiln/bench/data/declaration.txt), cut into windows of `window` tokens;
  each window is one prompt and its prompt logprobs give every token's NLL but the
  first's;
- greedy agreement with the reference over a fixed set of chat prompts: how many
  outputs are identical, and the mean share of each output before its first difference.

Methods: `none`, `int8` and `int8-channel` run the float checkpoint (a GGUF model's converted one),
`gguf` the .gguf file itself (skipped when the model has none).
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

TEXT = Path(__file__).parent / "data" / "declaration.txt"
PROMPTS = [
    "What is the capital of France?", "Write a haiku about autumn leaves.",
    "Explain what a compiler does in two sentences.", "List three uses of clay.",
    "How many legs does a spider have?", "Give me a tip for learning to cook.",
    "What is 17 times 23?", "Describe the color blue to someone who cannot see.",
]


def text_windows(tokenizer: Any, window: int, max_windows: int | None = None
                 ) -> list[list[int]]:
    ids = tokenizer.encode(TEXT.read_text())
    windows = [ids[i:i + window] for i in range(0, len(ids) - 1, window)
               if len(ids[i:i + window]) > 1]
    return windows[:max_windows]


def perplexity(llm: Any, windows: list[list[int]]) -> tuple[float, int]:
    """(exp of the mean NLL of every token after each window's first, token count)."""
    from kiln.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll, count = 0.0, 0
    for window, out in zip(windows, outs):
        for token, pos in zip(window[1:], out.prompt_logprobs[1:]):
            nll -= pos[token].logprob
            count += 1
    return math.exp(nll / count), count


def greedy(llm: Any, max_tokens: int) -> list[list[int]]:
    from kiln.sampling.params import SamplingParams

    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[int, float]:
    """(outputs identical to the reference, mean share before the first difference)."""
    shares = []
    for a, b in zip(ref, got):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(same / max(1, len(a)))
    return sum(a == b for a, b in zip(ref, got)), sum(shares) / max(1, len(shares))


def method_models(model: str | None) -> dict[str, tuple[str | None, str]]:
    """{method: (model setting, quantization)} for the methods this model offers."""
    from kiln.models.model_source import gguf_source, resolve_model

    float_dir = str(resolve_model(model, progress=False))
    methods = {m: (float_dir, m) for m in ("none", "int8", "int8-channel")}
    gguf = gguf_source(model)
    if gguf is not None:
        methods["gguf"] = (str(gguf), "gguf")
    return methods


def run_quality(make_llm: Callable[[str | None, str], Any], model: str | None,
                methods: list[str], window: int, max_tokens: int,
                max_windows: int | None = None) -> dict[str, Any]:
    available = method_models(model)
    rows, ref_tokens = [], None
    for method in ["none"] + [m for m in methods if m != "none"]:
        if method not in available:
            rows.append({"method": method, "error": "not available for this model"})
            continue
        t0 = time.perf_counter()
        llm = make_llm(*available[method])
        windows = text_windows(llm.get_tokenizer(), window, max_windows)
        ppl, count = perplexity(llm, windows)
        tokens = greedy(llm, max_tokens)
        ref_tokens = ref_tokens or tokens
        same, share = agreement(ref_tokens, tokens)
        rows.append({"method": method, "perplexity": ppl, "tokens_scored": count,
                     "greedy_identical": same, "greedy_prompts": len(tokens),
                     "greedy_prefix_share": share, "seconds": time.perf_counter() - t0,
                     "dtype": str(llm.engine.dtype).removeprefix("torch.")})
        llm.shutdown()
        del llm
    ref = rows[0].get("perplexity")
    for r in rows:
        if ref and r.get("perplexity"):
            r["perplexity_vs_none"] = r["perplexity"] / ref - 1
    return {"mode": "quality", "model": model, "text": TEXT.name, "window": window,
            "max_tokens": max_tokens, "rows": rows}


def format_quality(r: dict[str, Any]) -> str:
    lines = [f"quality: perplexity over {r['text']} (windows of {r['window']} tokens), greedy "
             f"agreement with 'none' over {len(PROMPTS)} chat prompts x {r['max_tokens']} "
             "tokens", "",
             f"{'method':<12} {'dtype':<10} {'perplexity':>10} {'vs none':>8} "
             f"{'identical':>9} {'prefix':>7}"]
    for row in r["rows"]:
        if "error" in row:
            lines.append(f"{row['method']:<12} {row['error']}")
            continue
        lines.append(f"{row['method']:<12} {row['dtype']:<10} {row['perplexity']:>10.3f} "
                     f"{100 * row.get('perplexity_vs_none', 0):>+7.2f}% "
                     f"{row['greedy_identical']:>4}/{row['greedy_prompts']:<4} "
                     f"{100 * row['greedy_prefix_share']:>6.1f}%")
    return "\n".join(lines)


def plot_quality(r: dict[str, Any], out_dir: Path) -> list[Path]:
    del r, out_dir
    return []
