"""`kiln bench hybrid-kv`: the KV blocks a Gemma-3-style local:global model holds at long
context, against the same model with every layer on full attention, side by side.

Both are random Gemma 3 text models built here (no download): `--num-layers` layers, one
in `--pattern` full attention and the rest sliding with `--window` tokens, hidden 64.
One request of `--context` prompt tokens decodes `--output-len` tokens with chunked
prefill (`--chunk` tokens a step); after every step the blocks held are read from the
pool. Blocks are counted in layer-pages (pool blocks x cache slots): one layer's K/V for
one block of tokens, the unit both layouts share. Decode speed is reported too: a
window bounds each sliding layer's attention.
JSON: mode "hybrid-kv", environment, config, runs {hybrid, full: {peak_layer_blocks,
final_layer_blocks, decode_tok_s, groups}}, ratio (final hybrid / final full).
"""
from __future__ import annotations

import tempfile
from collections import Counter
import time
from pathlib import Path
from typing import Any

import torch

from kiln.bench.report import environment, table

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


def make_gemma3(path: Path, num_layers: int, window: int, pattern: int, max_len: int,
                full: bool) -> None:
    import transformers

    torch.manual_seed(0)
    types = ["full_attention" if full or (i + 1) % pattern == 0 else "sliding_attention"
             for i in range(num_layers)]
    config = transformers.Gemma3TextConfig(**SHAPE, num_hidden_layers=num_layers,
                                           sliding_window=window, layer_types=types,
                                           max_position_embeddings=max_len)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(path)


def _held(path: str, context: int, output_len: int, chunk: int) -> dict[str, Any]:
    from kiln.entrypoints.llm import LLM
    from kiln.sampling.params import RequestOutputKind, SamplingParams

    llm = LLM(path, dtype="float32", optimization_level=0, progress=False,
              max_model_len=context + output_len, max_num_batched_tokens=chunk,
              enable_prefix_caching=False)
    engine, slots = llm.engine, llm.engine.runner._kv_buffer.shape[0]
    pool = engine.scheduler.kv.block_pool
    prompt = torch.randint(3, SHAPE["vocab_size"], (context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    peak = final = 0
    decode_s, steps = 0.0, 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        held = pool.num_blocks - 1 - pool.get_num_free_blocks()
        if engine.scheduler.running and engine.scheduler.running[0].num_output_tokens > 1:
            decode_s, steps = decode_s + time.perf_counter() - start, steps + 1
        if not outputs:  # the request still holds its blocks after this step
            peak, final = max(peak, held * slots), held * slots
    kinds = Counter(f"{type(g.spec).__name__} of {len(g.layers)} layer(s)"
                    for g in engine.scheduler.kv.groups)
    groups = [f"{n} x {kind}" for kind, n in kinds.items()]
    return {"peak_layer_blocks": peak, "final_layer_blocks": final,
            "decode_tok_s": steps / decode_s if decode_s else 0.0, "groups": groups}


def measure_kv_blocks(context: int = 4096, window: int = 512, pattern: int = 6,
                      num_layers: int = 6, output_len: int = 8,
                      chunk: int = 512) -> dict[str, Any]:
    runs = {}
    with tempfile.TemporaryDirectory(prefix="kiln-hybrid-kv-") as tmp:
        for name in ("hybrid", "full"):
            path = Path(tmp) / name
            make_gemma3(path, num_layers, window, pattern, context + output_len + 16,
                        full=name == "full")
            runs[name] = _held(str(path), context, output_len, chunk)
    ratio = runs["hybrid"]["final_layer_blocks"] / runs["full"]["final_layer_blocks"]
    return {"mode": "hybrid-kv", **environment(),
            "config": {"context": context, "window": window, "pattern": pattern,
                       "num_layers": num_layers, "output_len": output_len, "chunk": chunk},
            "runs": runs, "ratio": ratio, "hybrid_layer_blocks":
            runs["hybrid"]["final_layer_blocks"],
            "full_layer_blocks": runs["full"]["final_layer_blocks"]}


def format_hybrid_kv(r: dict[str, Any]) -> str:
    c = r["config"]
    rows = [[name, str(v["peak_layer_blocks"]), str(v["final_layer_blocks"]),
             f"{v['decode_tok_s']:.1f}", ", ".join(v["groups"])]
            for name, v in r["runs"].items()]
    head = (f"hybrid-kv: random Gemma 3 text, {c['num_layers']} layers, 1 in {c['pattern']} "
            f"global, window {c['window']}, {c['context']}-token prompt + {c['output_len']} "
            f"decoded, chunks of {c['chunk']}; blocks in layer-pages of 16 tokens")
    return "\n".join([head, table(["cache", "peak", "at the end", "decode tok/s", "groups"],
                                  rows),
                      f"hybrid / full attention at the end: {r['ratio']:.1%}"])
