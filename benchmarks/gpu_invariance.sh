#!/usr/bin/env bash
# H200, no model wheel needed: the batch-invariance tests on CUDA, then the cost of invariance on
# Llama-3.1-8B shapes (gpu_engine.py: graph replays and prefill; gpu_spec.py: AR and spec steps), today's
# fastest kernels beside the invariant ones in one run. JSON and logs land in $OUT.
#   [REPEATS=3] bash benchmarks/gpu_invariance.sh        (carry .ferry/whl: the loaders' wheels)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ferry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
step() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $name rc=$? $((SECONDS - t0))s"; tail -n 25 "$out/$name.log"
}
step invariance-tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_batch_invariance.py \
    -k "cuda or rows_per_program"
step gpu_engine 200 python3 benchmarks/gpu_engine.py --out "$out" --repeats "${REPEATS:-3}"
step gpu_spec 230 python3 benchmarks/gpu_spec.py --out "$out" --repeats "${REPEATS:-3}"
