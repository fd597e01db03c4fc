"""Optimization levels side by side in one run: start-up and decode tokens/s.

1. Start-up: wall time from process start to the first generated token at each level,
   each a fresh process. The first compiling
   level starts with an empty compile cache (cold); every level after it finds what it can
   share (on the CPU -O1..-O3 build the same code, so they start warm).
2. Decode: tokens/s per level (warm), batch 1 and 32 requests, `--new-tokens` each.

    python benchmarks/compile_levels.py [--levels 0 1 2 3] [--device cpu|cuda]
        [--model DIR | --random-weights] [--new-tokens 128] [--json PATH]
        [--quantization none int8 fp8]   # decode columns per weight format, at each level

`--random-weights` benchmarks a randomly initialised model of SmolLM2-135M's shape (for
hosts without the embedded model; speed depends on shapes, not weights).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

PROMPT = "Write a short story about a kiln."
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     max_position_embeddings=8192, rope_theta=100000.0,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def random_smollm2(path: str) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_SHAPE))
    model.save_pretrained(path)
    return path


_FIRST_TOKEN = """
import sys
from kiln import LLM, SamplingParams
model, level, cache, device, ids = sys.argv[1] or None, int(sys.argv[2]), *sys.argv[3:6]
llm = LLM(model, optimization_level=level, device=device, progress=False,
          compilation={"cache_dir": cache})
prompt = {"prompt_token_ids": [int(t) for t in ids.split()]} if ids else \\
    llm.apply_chat_template([{"role": "user", "content": "Write a short story about a kiln."}])
llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
"""


def first_token_s(args: argparse.Namespace, level: int, cache_dir: str) -> float:
    """A fresh process: imports, model load, compile or cache load, graph capture, one
    token."""
    ids = "1 2 3 4 5 6 7 8" if args.random_weights else ""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", _FIRST_TOKEN, args.model or "", str(level),
                    cache_dir, args.device, ids], check=True, capture_output=True, text=True)
    return time.perf_counter() - start


def decode_tok_s(args: argparse.Namespace, level: int, cache_dir: str,
                 quantization: str = "none") -> dict[int, float]:
    from kiln import LLM, SamplingParams

    llm = LLM(args.model, optimization_level=level, progress=False, device=args.device,
              compilation={"cache_dir": cache_dir},
              quantization=None if quantization == "none" else quantization)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    words = PROMPT.split()
    out = {}
    for batch in args.batch:
        prompts = [{"prompt_token_ids": list(range(10 + i, 30 + i))} for i in range(batch)] \
            if args.random_weights else [f"{PROMPT} #{i} {words[i % len(words)]}"
                                         for i in range(batch)]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4),
                     use_tqdm=False)
        start = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        out[batch] = sum(len(r.outputs[0].token_ids) for r in res) / elapsed
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--quantization", nargs="+", default=["none"],
                    help="weight formats for the decode table (none int8 fp8 ...)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="kiln-bench-cache-")
    if args.random_weights and not args.model:
        args.model = random_smollm2(tempfile.mkdtemp(prefix="kiln-smollm2-shape-"))
    startup: dict[str, float] = {}
    if not args.skip_startup:
        cold_done = False
        for level in args.levels:
            label = f"O{level}" if level == 0 or cold_done else f"O{level} cold"
            startup[label] = first_token_s(args, level, cache)
            if level and not cold_done:
                cold_done = True
                startup[f"O{level} warm"] = first_token_s(args, level, cache)
        print("\nstart-up: process start to first token (fresh process per row)")
        for name, secs in startup.items():
            print(f"  {name:8} {secs:6.1f} s")
    decode = {f"O{lvl}" + ("" if q == "none" else f" {q}"): decode_tok_s(args, lvl, cache, q)
              for q in args.quantization for lvl in args.levels}
    base = next(iter(decode.values()))
    print(f"\ndecode tokens/s on {args.device} ({args.new_tokens} new tokens per request)")
    print(f"  {'batch':>5} " + " ".join(f"{name:>8}" for name in decode)
          + f"  (x vs {next(iter(decode))})")
    for b in args.batch:
        row = " ".join(f"{decode[name][b]:>8.1f}" for name in decode)
        ratios = " ".join(f"{decode[name][b] / base[b]:.2f}x" for name in decode)
        print(f"  {b:>5} {row}  ({ratios})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"startup_s": startup, "decode_tok_s": decode}, f, indent=2)


if __name__ == "__main__":
    main()
