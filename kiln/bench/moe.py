"""`kiln bench moe`: decode throughput of a small but realistically shaped mixture of
experts, kiln vs transformers, side by side.

The model is a random Mixtral built here (no download): hidden 512, 4 layers, 8 query
and 4 KV heads, 8 experts of intermediate 1024, top-2, vocabulary 8192. Both engines run
it in `--dtype` (bfloat16 by default) on the same random prompts (`--input-len` tokens,
`--output-len` new tokens, EOS ignored), at each `--batch-sizes` entry, interleaved
`--repeats` times after a warm-up. Throughput is output tokens over wall time.
JSON: mode "moe", environment, config, runs {batch: {kiln, transformers: [tok/s]}},
median_tok_s, speedup {batch: kiln / transformers}.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kiln.bench.report import environment, table

SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
             num_experts_per_tok=2, max_position_embeddings=2048, sliding_window=None)


def make_mixtral(path: Path) -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(**SHAPE, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    return model


def run_moe(level: int, dtype: str, batch_sizes: list[int], input_len: int,
            output_len: int, repeats: int) -> dict[str, Any]:
    from kiln.entrypoints.llm import LLM

    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, SHAPE["vocab_size"], (max(batch_sizes), input_len),
                            generator=g)
    runs: dict[int, dict[str, list[float]]] = {b: {"kiln": [], "transformers": []}
                                               for b in batch_sizes}
    with tempfile.TemporaryDirectory(prefix="kiln-moe-bench-") as tmp:
        hf = make_mixtral(Path(tmp)).to(torch_dtype)
        llm = LLM(tmp, dtype=dtype, optimization_level=level, progress=False,
                  max_num_seqs=max(batch_sizes), max_model_len=input_len + output_len + 16)
        cases = {"kiln": lambda b: _kiln(llm, prompts[:b], output_len),
                 "transformers": lambda b: _hf(hf, prompts[:b], output_len)}
        for b in batch_sizes:  # warm-up: first calls, thread pools, graphs
            for run in cases.values():
                run(b)
        for _ in range(repeats):
            for b in batch_sizes:
                for name, run in cases.items():
                    runs[b][name].append(b * output_len / run(b))
    med = {b: {n: statistics.median(v) for n, v in r.items()} for b, r in runs.items()}
    return {"mode": "moe", **environment(),
            "config": {"shape": SHAPE, "dtype": dtype, "optimization_level": level,
                       "batch_sizes": batch_sizes, "input_len": input_len,
                       "output_len": output_len, "repeats": repeats},
            "runs": runs, "median_tok_s": med,
            "speedup": {b: m["kiln"] / m["transformers"] for b, m in med.items()}}


def _kiln(llm: Any, prompts: torch.Tensor, output_len: int) -> float:
    from kiln.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params,
                 use_tqdm=False)
    return time.perf_counter() - start


@torch.inference_mode()
def _hf(model: Any, prompts: torch.Tensor, output_len: int) -> float:
    start = time.perf_counter()
    model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                   max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0)
    return time.perf_counter() - start


def format_moe(r: dict[str, Any]) -> str:
    c = r["config"]
    rows = [[str(b), f"{m['kiln']:.1f}", f"{m['transformers']:.1f}",
             f"{r['speedup'][b]:.2f}x"] for b, m in r["median_tok_s"].items()]
    head = (f"moe: random Mixtral (8 experts, top-2, hidden 512, 4 layers), {c['dtype']}, "
            f"-O{c['optimization_level']}, input {c['input_len']}, output {c['output_len']}, "
            f"median of {c['repeats']}")
    return "\n".join([head, table(["batch", "kiln tok/s", "transformers tok/s", "speedup"],
                                  rows)])
