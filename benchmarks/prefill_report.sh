#!/usr/bin/env bash
# #46's must-shows for this host in one run, each figure under its ISA path: the cores' own
# bf16 rate, kiln's prefill in process (with its share of a bf16 torch.mm), kiln against
# vLLM CPU per prompt length, and batch-1 decode bf16 and int8. On an AMX host every part
# runs twice, natively and capped to the reference host's path (avx512_bf16), and the
# decode rounds alternate the two paths, so "AMX at least as fast as its own avx512_bf16
# path" is read from one run. From the repository root, after `make run` (the venv and
# the converted default model) and `.venv/bin/python benchmarks/peers/install.py vllm`:
#
#     benchmarks/prefill_report.sh [OUT_DIR]          # LENGTHS="512 2000" to shorten it
#
# ROUNDS (default 3) sets the decode rounds: one round of batch-1 decode is noisy on these
# VMs (bf16 on a 2-vCPU Zen 4: 82-104 tok/s from run to run), so read the rounds together.
#
# About 25 minutes on a 2-core host (vLLM's 8,000-token prefill is most of it), twice that
# on AMX. Everything printed is also kept in OUT_DIR (default: prefill-report-<date>/).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${1:-prefill-report-$(date +%Y%m%d-%H%M)}
LENGTHS=${LENGTHS:-512 2000 8000}
ROUNDS=${ROUNDS:-3}
MODEL=$($PY -c "from kiln.models.model_source import resolve_model as r; print(r(None))")
CAP=(KILN_CPU_ISA=avx512_bf16 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16)
mkdir -p "$OUT"
exec > >(tee "$OUT/report.txt") 2>&1

path_env() { [[ $1 == capped ]] && echo "${CAP[@]}"; true; }
with_path() {  # with_path native|capped CMD...: CMD under that path's variables
    local path=$1; shift
    env $(path_env "$path") "$@"
}
isa_class() {
    with_path "${1:-native}" $PY -c "from kiln.ops import cpu_kernels; print(cpu_kernels.isa_class())"
}
PATHS=(native)
[[ $(isa_class) == amx ]] && PATHS+=(capped)

echo "== host: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs," \
     "kiln's path $(isa_class), model $MODEL"
grep -q avx512_bf16 /proc/cpuinfo && $PY benchmarks/dot_peak.py
for path in "${PATHS[@]}"; do
    echo "== $path ($(isa_class "$path")): kiln prefill in process, bf16"
    with_path "$path" $PY benchmarks/prefill_ttft.py --lengths $LENGTHS --repeats 3 --gemm \
        --model "$MODEL" --dtype bfloat16
    for n in $LENGTHS; do
        echo "== $path: kiln vs vLLM CPU, $n-token prompts (best of three one-token runs)"
        with_path "$path" env VLLM_CPU_OMP_THREADS_BIND="0-$(($(nproc) - 1))" \
            VLLM_CPU_NUM_OF_RESERVED_CPU=0 $PY benchmarks/peers/run.py --peers vllm \
            --no-install --b1-input-len "$n" --new-tokens 2 --num-prompts 2 --input-len 16 \
            --repeats 3 --vllm-kwargs '{"max_model_len": 8192}' \
            --kiln-args "--max-model-len 8192" --json "$OUT/prefill_${path}_$n.json" \
            > "$OUT/peers_${path}_$n.log"
        $PY benchmarks/peers/ttft.py "$OUT/prefill_${path}_$n.json"
    done
done
echo "== batch-1 decode, tok/s: $ROUNDS rounds, the paths and weights alternating"
for round in $(seq "$ROUNDS"); do
    for path in "${PATHS[@]}"; do
        for q in none int8; do
            tok=$(with_path "$path" .venv/bin/kiln bench latency --model "$MODEL" -q "$q" \
                  --dtype bfloat16 --batch-size 1 --input-len 32 --output-len 128 \
                  --num-iters 3 2>&1 | sed -n 's/^decode \([0-9.]*\) tok\/s.*/\1/p')
            echo "  round $round  $path  -q $q  $tok tok/s"
        done
    done
done
