#!/usr/bin/env bash
# GPU check: tests/gpu (FULL and PIECEWISE capture/replay, equality with eager, padding)
# and a short decode benchmark, -O0 vs -O2 tokens/s. Budget: under 8 minutes.
#
# Runs from the source tree with the host's python (PYTHONPATH=., nothing installed). The
# GPU host has no network; the one kiln dependency it lacks (gguf, pure Python) travels as
# a wheel in .whl/ (ignored by git). On a machine with network, fetch it once with
#     scripts/gpu_check.sh --fetch-wheels
# then on the GPU host, from the repository root:
#     scripts/gpu_check.sh            (PYTHON=... to pick another interpreter)
# The benchmark uses randomly initialised weights of SmolLM2-135M's shape unless
# KILN_BENCH_MODEL names a model directory.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(gguf==0.19.0)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    "$PY" -m pip download --no-deps --only-binary=:all: -d .whl "${WHEELS[@]}"
    exit 0
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kiln-site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/kiln-site"
fi
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-$(mktemp -d -t kiln-gpu-cache-XXXX)}
export PYTHONUNBUFFERED=1

"$PY" - <<'PYEOF'
import importlib, sys
import torch
missing = [m for m in ("transformers", "safetensors", "gguf", "filelock", "xxhash", "tqdm",
                       "numpy", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing packages {missing}; run scripts/gpu_check.sh "
             "--fetch-wheels where pip has network and bring .whl/ along")
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
print(f"gpu_check: torch {torch.__version__} on {torch.cuda.get_device_name()}")
PYEOF

start=$(date +%s)
echo "== tests/gpu"
timeout 300 "$PY" -m pytest -p no:logging -p no:cacheprovider -q -rs tests/gpu
echo "== decode benchmark (-O0 vs -O2)"
model_args=(--random-weights)
[[ -n "${KILN_BENCH_MODEL:-}" ]] && model_args=(--model "$KILN_BENCH_MODEL")
timeout 240 "$PY" benchmarks/compile_levels.py --device cuda --levels 0 2 \
    "${model_args[@]}" --new-tokens 64 --batch 1 32
echo "gpu_check: done in $(( $(date +%s) - start )) s"
