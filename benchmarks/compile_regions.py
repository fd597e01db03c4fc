"""Regional compilation on vs off, side by side in one process: the cold compile of the
model and its decode speed at batch 1 and with 32 requests, interleaved.

    python benchmarks/compile_regions.py [--model DIR] [--level 2] [--rounds 5]
        [--new-tokens 64]

Each variant compiles into a fresh compile cache and Inductor cache (its `compile` phase
is the cold compile); decode rounds then alternate between the two engines, best round
reported, with the ratio regions / unrolled, and whether the greedy outputs are
identical: in bfloat16 they may not be, since a region boundary moves where Inductor
rounds (the residual add of one layer no longer fuses into the next layer's norm), as
-O0 and -O2 differ too; float32 parity with transformers holds at every level (tests).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

PROMPT = "Write a short story about a kiln."


def build(model: str | None, level: int, regions: bool, root: str):
    from kiln import LLM

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    llm = LLM(model, optimization_level=level, progress=False,
              compilation={"compile_regions": regions, "cache_dir": os.path.join(root, "cc")})
    return llm, llm.engine.phases.seconds.get("compile", 0.0)


def decode(llm, batch: int, new_tokens: int) -> tuple[float, list[list[int]]]:
    from kiln import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([PROMPT] * batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--level", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    engines, compile_s = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for regions in (True, False):
            root = os.path.join(tmp, str(regions))
            engines[regions], compile_s[regions] = build(args.model, args.level, regions, root)
        best = {(r, b): 0.0 for r in engines for b in (1, 32)}
        outputs: dict[tuple[bool, int], list[list[int]]] = {}
        for _ in range(args.rounds):
            for batch in (1, 32):
                for regions, llm in engines.items():
                    tok_s, outputs[regions, batch] = decode(llm, batch, args.new_tokens)
                    best[regions, batch] = max(best[regions, batch], tok_s)
    print(f"-O{args.level}: cold compile {compile_s[True]:.1f} s with regions, "
          f"{compile_s[False]:.1f} s unrolled")
    for batch in (1, 32):
        on, off = best[True, batch], best[False, batch]
        same = outputs[True, batch] == outputs[False, batch]
        print(f"  decode, {batch} request(s): {on:.1f} vs {off:.1f} tok/s, {on / off:.3f}x "
              f"(best of {args.rounds}; outputs identical: {same})")


if __name__ == "__main__":
    main()
