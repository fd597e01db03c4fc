"""`kiln bench sampling`: which default sampling parameters give a model readable chat.

For each candidate (greedy with and without a repetition penalty, low temperatures with
top-p, and whatever the model's generation config says), every chat prompt of PROMPTS is
answered (`--seeds` times for sampled candidates), and three things are reported:
- loop rate: the share of answers in which some word 4-gram occurs three times or more;
- distinct-2: unique word bigrams over all bigrams, per answer, averaged (higher: less
  repetitive);
- length: mean tokens per answer, and the share that ended by themselves (EOS) rather
  than at `--max-tokens`.
All candidates run as one batch through one engine; every answer is seeded or greedy, so
a run reproduces.

JSON (`--json`): {"model", "max_tokens", "seeds", "num_prompts", "rows": [{"name",
"params", "answers", "loop_rate", "distinct_2", "mean_tokens", "stopped"}]}.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Any

PROMPTS = [
    "Write a haiku about a kiln firing clay.",
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain what a compiler does in two sentences.",
    "Write a short poem about the sea.",
    "How do I make a cup of tea?",
    "Tell me a fun fact about octopuses.",
    "What are the benefits of regular exercise?",
    "Describe a sunset to someone who has never seen one.",
    "Write a short story about a robot who learns to paint.",
    "What should I pack for a weekend hiking trip?",
    "Explain photosynthesis to a ten-year-old.",
    "Suggest a name for a bakery and say why.",
    "What is the difference between weather and climate?",
    "Write a thank-you note to a teacher.",
    "How can I learn a new language quickly?",
]

# name -> SamplingParams fields. Greedy rows run once; sampled rows once per seed.
CANDIDATES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "greedy, repetition_penalty 1.1": {"temperature": 0.0, "repetition_penalty": 1.1},
    "greedy, repetition_penalty 1.2": {"temperature": 0.0, "repetition_penalty": 1.2},
    "temperature 0.2, top_p 0.9": {"temperature": 0.2, "top_p": 0.9},
    "temperature 0.2, top_p 0.9, repetition_penalty 1.1":
        {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1},
    "temperature 0.6, top_p 0.9, repetition_penalty 1.1":
        {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1},
}
_WORD = re.compile(r"\w+(?:'\w+)?")


def loops(text: str, n: int = 4, times: int = 3) -> bool:
    """Whether some word n-gram occurs `times` times or more (case-insensitive)."""
    words = _WORD.findall(text.lower())
    grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    return any(c >= times for c in grams.values())


def distinct_2(text: str) -> float:
    words = _WORD.findall(text.lower())
    grams = [tuple(words[i:i + 2]) for i in range(len(words) - 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def candidates(model_defaults: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """CANDIDATES, plus the model's own generation-config defaults when they differ from
    every candidate (greedy unless the file sets a temperature, as `kiln generate` runs
    them)."""
    rows = dict(CANDIDATES)
    own = {k: v for k, v in model_defaults.items() if k != "max_tokens"}
    own = {"temperature": 0.0, **own}
    if len(own) > 1 and own not in rows.values():
        rows["the model's generation config"] = own
    return rows


def run_chat_defaults(llm: Any, max_tokens: int, seeds: int) -> dict[str, Any]:
    from kiln.sampling.params import SamplingParams

    rows = candidates(llm.engine.default_sampling)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    jobs: list[tuple[str, Any, SamplingParams]] = []
    for name, fields in rows.items():
        runs = 1 if fields.get("temperature", 1.0) == 0 else seeds
        for seed in range(runs):
            params = SamplingParams(max_tokens=max_tokens, seed=seed, **fields)
            jobs += [(name, prompt, params) for prompt in prompts]
    outs = llm.generate([j[1] for j in jobs], [j[2] for j in jobs])
    answers: dict[str, list[Any]] = {name: [] for name in rows}
    for (name, _, _), out in zip(jobs, outs):
        answers[name].append(out.outputs[0])
    return {"model": llm.engine.config.model, "max_tokens": max_tokens, "seeds": seeds,
            "num_prompts": len(PROMPTS),
            "rows": [_row(name, rows[name], answers[name]) for name in rows]}


def _row(name: str, params: dict[str, Any], outs: list[Any]) -> dict[str, Any]:
    texts = [o.text for o in outs]
    return {"name": name, "params": params, "answers": len(outs),
            "loop_rate": sum(map(loops, texts)) / len(outs),
            "distinct_2": sum(map(distinct_2, texts)) / len(outs),
            "mean_tokens": sum(len(o.token_ids) for o in outs) / len(outs),
            "stopped": sum(o.finish_reason == "stop" for o in outs) / len(outs),
            "first_answer": texts[0]}


def format_chat_defaults(result: dict[str, Any]) -> str:
    lines = [f"chat defaults: {result['num_prompts']} prompts, up to {result['max_tokens']} "
             f"tokens, sampled rows x{result['seeds']} seeds",
             f"{'candidate':<52} {'answers':>7} {'loops':>6} {'distinct-2':>10} "
             f"{'tokens':>7} {'EOS':>5}"]
    for r in result["rows"]:
        lines.append(f"{r['name']:<52} {r['answers']:>7} {r['loop_rate']:>6.0%} "
                     f"{r['distinct_2']:>10.3f} {r['mean_tokens']:>7.1f} {r['stopped']:>5.0%}")
    return "\n".join(lines)
