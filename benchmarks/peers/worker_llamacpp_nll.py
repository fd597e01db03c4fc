"""llama.cpp's NLL of token windows: `python worker_llamacpp_nll.py GGUF WINDOWS.json`
in the llama-cpp-python venv (numpy comes with it). Prints one JSON line
{"nll": total, "tokens": count}: every token of each window but its first, given the
tokens before it in the same window, as `kiln bench quality` scores them."""
from __future__ import annotations

import json
import os
import sys

import numpy as np


def main() -> int:
    import llama_cpp

    gguf, windows = sys.argv[1], json.load(open(sys.argv[2]))
    threads = os.cpu_count() or 1
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=max(map(len, windows)) + 8, n_batch=512,
                          logits_all=True, n_threads=threads, verbose=False)
    nll, count = 0.0, 0
    for w in windows:
        llm.reset()
        llm.eval(w)
        logits = np.asarray(llm.scores[: len(w) - 1], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll -= float(logp[np.arange(len(w) - 1), w[1:]].sum())
        count += len(w) - 1
    print(json.dumps({"nll": nll, "tokens": count}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
