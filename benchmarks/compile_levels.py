"""-O0 vs -O1 on SmolLM2, side by side in one run.

1. Start-up: wall time from process start to the first generated token of
   `kiln generate --max-tokens 1` at -O0, at -O1 with an empty compile cache (cold) and
   at -O1 again (warm), each a fresh process.
2. Decode: tokens/s at -O0 and -O1 (warm), batch 1 and 32 requests, `--new-tokens` each.

    .venv/bin/python benchmarks/compile_levels.py [--new-tokens 128] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

PROMPT = "Write a short story about a kiln."


def first_token_s(level: int, cache_dir: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kiln.entrypoints.cli", "generate", "--chat", PROMPT,
                    "--max-tokens", "1", f"-O{level}", "--cache-dir", cache_dir],
                   check=True, capture_output=True, text=True)
    return time.perf_counter() - start


def decode_tok_s(level: int, cache_dir: str, batches: list[int], new_tokens: int) -> dict:
    from kiln import LLM, SamplingParams

    llm = LLM(optimization_level=level, progress=False, compilation={"cache_dir": cache_dir})
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    out = {}
    for batch in batches:
        prompts = [llm.apply_chat_template([{"role": "user", "content": f"{PROMPT} #{i}"}])
                   for i in range(batch)]
        start = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        out[batch] = sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="kiln-bench-cache-")
    startup = {"O0": first_token_s(0, cache), "O1 cold": first_token_s(1, cache),
               "O1 warm": first_token_s(1, cache)}
    decode = {f"O{lvl}": decode_tok_s(lvl, cache, args.batch, args.new_tokens) for lvl in (0, 1)}
    print("\nstart-up: process start to first token (kiln generate --max-tokens 1)")
    for name, secs in startup.items():
        print(f"  {name:8} {secs:6.1f} s")
    print(f"  warm/cold {startup['O1 warm'] / startup['O1 cold']:.0%}")
    print(f"\ndecode tokens/s ({args.new_tokens} new tokens per request)")
    print(f"  {'batch':>5} {'-O0':>8} {'-O1':>8} {'O1/O0':>7}")
    for b in args.batch:
        o0, o1 = decode["O0"][b], decode["O1"][b]
        print(f"  {b:>5} {o0:>8.1f} {o1:>8.1f} {o1 / o0:>6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"startup_s": startup, "decode_tok_s": decode}, f, indent=2)


if __name__ == "__main__":
    main()
