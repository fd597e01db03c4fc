"""Time to first token per engine from `run.py --json` files: the best and the median of
the batch-1 one-token runs (`batch1_samples_s["t_1"]`, one fresh prompt each), with kiln
over each peer. With `--b1-input-len N --new-tokens 2` that is a prefill of N tokens:

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
    .venv/bin/python benchmarks/peers/run.py --peers vllm --b1-input-len 2000 --new-tokens 2 \\
        --num-prompts 2 --input-len 16 --repeats 3 --vllm-kwargs '{"max_model_len": 8192}' \\
        --kiln-args "--max-model-len 8192" --json prefill_2000.json
    .venv/bin/python benchmarks/peers/ttft.py prefill_2000.json
"""
from __future__ import annotations

import argparse
import json
import statistics


def first_token_times(path: str) -> dict[str, list[float]]:
    """{engine label: every t_1 sample over the rounds}."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    out: dict[str, list[float]] = {}
    for row in rows:
        label = f"{row['engine']} ({row['dtype']})"
        for result in row["raw"].get("rounds", [row["raw"]]):
            samples = result.get("batch1_samples_s") or {}
            out.setdefault(label, []).extend(samples.get("t_1", []))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="run.py --json files")
    for path in ap.parse_args().json:
        times = {k: v for k, v in first_token_times(path).items() if v}
        kiln = next((min(v) for k, v in times.items() if k.startswith("kiln")), None)
        print(path)
        for label, t in times.items():
            peer = kiln and not label.startswith("kiln")
            ratio = f"  kiln/this {min(t) / kiln:.2f}x" if peer else ""
            print(f"  {label:<28} best {min(t):.3f} s  "
                  f"median {statistics.median(t):.3f} s{ratio}")


if __name__ == "__main__":
    main()
