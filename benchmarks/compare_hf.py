"""kiln (-O2 by default, as the CLI) vs transformers `generate` on SmolLM2, side by side.

Workloads: batch 1 (one chat prompt) and 32 requests, each generating exactly
`--new-tokens` tokens (EOS ignored, so both engines do the same work). Prints tokens/s
for both and kiln's ratio; `--json PATH` writes the numbers.

    .venv/bin/python benchmarks/compare_hf.py [--dtype float32|bfloat16] [-O 2] [--new-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

from kiln import LLM, SamplingParams
from kiln.models.model_source import resolve_model

TOPICS = ["the ocean", "a city at night", "learning to code", "autumn leaves", "a robot",
          "coffee", "mountains", "the history of paper"]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Write a long story about {TOPICS[i % 8]}."}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def run_kiln(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


@torch.no_grad()
def run_hf(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    width = max(map(len, prompts))  # left padding, as batched HF generation requires
    ids = torch.tensor([[tokenizer.pad_token_id or 0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id or 0)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - width) * len(prompts) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("-O", dest="level", type=int, default=2, help="kiln's optimization level")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = resolve_model(None)
    t0 = time.perf_counter()
    llm = LLM(str(path), dtype=args.dtype, optimization_level=args.level, progress=False)
    kiln_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, args.dtype)).eval()
    hf_load = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    run_kiln(llm, chat_prompts(tok, 1), 4)  # warm-up both
    run_hf(model, tok, chat_prompts(tok, 1), 4)
    rows = []
    for batch in args.batch:
        prompts = chat_prompts(tok, batch)
        k = run_kiln(llm, prompts, args.new_tokens)
        h = run_hf(model, tok, prompts, args.new_tokens)
        rows.append({"batch": batch, "new_tokens": args.new_tokens, "dtype": args.dtype,
                     "kiln_tok_s": round(k, 2), "transformers_tok_s": round(h, 2),
                     "ratio": round(k / h, 3)})
    print(f"\nSmolLM2-135M-Instruct, {args.dtype}, {args.new_tokens} new tokens/request, "
          f"{torch.get_num_threads()} threads; load: kiln {kiln_load:.1f} s, "
          f"transformers {hf_load:.1f} s")
    print(f"{'batch':>6} {'kiln tok/s':>11} {'transformers tok/s':>19} {'kiln/hf':>8}")
    for r in rows:
        print(f"{r['batch']:>6} {r['kiln_tok_s']:>11.1f} {r['transformers_tok_s']:>19.1f} "
              f"{r['ratio']:>7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kiln_load_s": kiln_load, "transformers_load_s": hf_load,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
