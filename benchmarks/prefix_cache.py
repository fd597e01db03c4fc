"""Prefix caching on vs off: 64 requests sharing a 512-token system prompt (SmolLM2),
side by side in one run.

    .venv/bin/python benchmarks/prefix_cache.py [--requests 64] [--prefix-tokens 512]
"""
from __future__ import annotations

import argparse
import json
import time

from kiln import LLM, SamplingParams

FILLER = ("The studio keeps detailed firing logs, glaze recipes, and clay body notes so "
          "that every potter can reproduce a result. ")


def build_prompts(llm: LLM, n: int, prefix_tokens: int) -> list[dict]:
    tok = llm.get_tokenizer()
    ids = tok.encode(FILLER * (prefix_tokens // 10 + 1), add_special_tokens=False)
    system = tok.decode(ids[:prefix_tokens])
    return [llm.apply_chat_template([{"role": "system", "content": system},
                                     {"role": "user", "content": f"Question {i}: what is "
                                                                 f"cone {i % 12}?"}])
            for i in range(n)]


def run(enable: bool, args: argparse.Namespace) -> dict:
    llm = LLM(progress=False, enable_prefix_caching=enable, max_num_seqs=args.requests)
    prompts = build_prompts(llm, args.requests, args.prefix_tokens)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.engine.get_stats()
    return {"prefix_caching": enable, "seconds": round(elapsed, 2),
            "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
            "output_tok_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, 1),
            "hit_rate": round(stats.prefix_cache_hit_rate, 3),
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    off, on = run(False, args), run(True, args)
    print(f"\n{args.requests} requests, {args.prefix_tokens}-token shared system prompt, "
          f"{args.new_tokens} new tokens each")
    print(f"{'prefix caching':>15} {'seconds':>8} {'output tok/s':>13} {'hit rate':>9}")
    for r in (off, on):
        print(f"{'on' if r['prefix_caching'] else 'off':>15} {r['seconds']:>8.1f} "
              f"{r['output_tok_s']:>13.1f} {r['hit_rate']:>9.1%}")
    print(f"speed-up {off['seconds'] / on['seconds']:.2f}x; same tokens: "
          f"{off['tokens'] == on['tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: [{kk: vv for kk, vv in r.items() if kk != 'tokens'} for r in (off, on)]
                       for k in ("runs",)}, f, indent=2)


if __name__ == "__main__":
    main()
