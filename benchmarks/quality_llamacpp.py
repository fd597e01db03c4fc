"""llama.cpp's perplexity on `kiln bench quality`'s text, for the same GGUF file:

    .venv/bin/python benchmarks/quality_llamacpp.py [--window 512]

The windows are cut with kiln's tokenizer (the same token ids kiln scores), and
llama-cpp-python (its own venv, `benchmarks/peers/install.py llamacpp`) scores them with
the file's quantized weights. Compare with the `gguf` and `none` rows of
`kiln bench quality`.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))

import install  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from kiln.bench.quality import text_windows
    from kiln.models.model_source import default_gguf_path, resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(None, progress=False)))
    windows = text_windows(tok, args.window)
    python = install.install("llamacpp", install.default_venv_dir(),
                             Path(tempfile.gettempdir()) / "kiln-llamacpp-install.log")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(windows, f)
        f.flush()
        out = subprocess.run([str(python), str(HERE / "peers" / "worker_llamacpp_nll.py"),
                              str(default_gguf_path()), f.name], check=True,
                             capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    print(f"llama.cpp ({default_gguf_path().name}): perplexity "
          f"{math.exp(r['nll'] / r['tokens']):.3f} over {r['tokens']} tokens "
          f"(windows of {args.window})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
