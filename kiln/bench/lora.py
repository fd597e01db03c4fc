"""`kiln bench lora`: what serving many adapters costs, side by side in one process.

Three runs of the same offline workload (N requests of fixed lengths, EOS ignored), each
warmed once at full size, then interleaved `--repeats` times so the host's drift hits
each alike:
  base        an engine without LoRA, the base model
  lora-base   an engine with LoRA on (slots for --num-adapters), every request the base
  lora-mixed  the same engine, the requests spread over --num-adapters random adapters
The overhead is the median output tok/s of `base` over each LoRA run's, minus one.

The adapters are random PEFT directories written for the model (rank --rank, every
q/k/v/o/gate/up/down projection), so the benchmark needs no downloads.
JSON: mode "lora", environment, config, runs {name: [output_tok_s, ...]},
median_tok_s {name: x}, overhead {lora-base, lora-mixed} (fractions).
"""
from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from kiln.bench.report import engine_facts, environment, repeats_table
from kiln.bench.throughput import run_throughput

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(model_config: Any, path: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory for a Llama-family model: small random A and B (std 0.02:
    outputs change, generation stays sane)."""
    from safetensors.torch import save_file

    mc = model_config
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    h, inter = mc.hidden_size, mc.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(mc.num_layers):
        for proj, (d_in, d_out) in shapes.items():
            part = "self_attn" if proj in PROJECTIONS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": list(PROJECTIONS)}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def run_lora(make: Callable[[bool], Any], num_prompts: int, input_len: int,
             output_len: int, num_adapters: int, rank: int, repeats: int) -> dict[str, Any]:
    """`make(enable_lora)` builds an engine (LoRA on: num_adapters slots of `rank`)."""
    from kiln.lora.request import LoRARequest

    base, lora = make(False), make(True)
    tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-lora-"))
    adapters = [LoRARequest(f"bench-{i}", i + 1, str(write_random_adapter(
        lora.engine.model_config, tmp / f"a{i}", rank, seed=i))) for i in range(num_adapters)]
    cases = {"base": (base, None), "lora-base": (lora, None), "lora-mixed": (lora, adapters)}
    # Warm-up at full size: the first full batch of a process runs at about half speed
    # (allocator growth, first touches of the KV cache), which would bias the first case.
    for llm, loras in cases.values():
        run_throughput(llm, num_prompts, input_len, output_len, lora_requests=loras)
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, (llm, loras) in cases.items():
            r = run_throughput(llm, num_prompts, input_len, output_len, lora_requests=loras)
            runs[name].append(r["output_tok_s"])
    med = {name: statistics.median(v) for name, v in runs.items()}
    return {"mode": "lora", **environment(lora.engine.config.device),
            "config": {"num_prompts": num_prompts, "input_len": input_len,
                       "output_len": output_len, "num_adapters": num_adapters, "rank": rank,
                       "repeats": repeats, **engine_facts(lora.engine)},
            "runs": runs, "median_tok_s": med,
            "overhead": {n: med["base"] / med[n] - 1 for n in ("lora-base", "lora-mixed")}}


def format_lora(r: dict[str, Any]) -> str:
    c = r["config"]
    head = (f"lora: {c['num_prompts']} requests, input {c['input_len']}, output "
            f"{c['output_len']}; {c['num_adapters']} adapters of rank {c['rank']}; -O"
            f"{c['optimization_level']} {c['dtype']} ({r['device']}), median of "
            f"{c['repeats']}")
    return "\n".join([head, repeats_table(r["runs"], r["median_tok_s"], r["overhead"],
                                          "base", "tok/s", digits=1)])


def plot_lora(r: dict[str, Any], out_dir: Path) -> list[Path]:
    return []  # a three-row table says it all
