#!/usr/bin/env bash
# H200, inside `gpu_ferry.sh run`: the serving features on the invariant CUDA path in bf16 — logprobs bit-equal
# to AR's, n samples, constrained speculation equal to constrained AR (the suite's tests on CUDA), then what a
# JSON schema costs the speedup on the embedded model (benchmarks/structured_cost.py).
#   bash benchmarks/gpu_features.sh [PROMPTS] [TOKENS]      -> $OUT/features-tests.log, $OUT/structured_cost.json
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
SPECPILOT_TEST_DEVICE=cuda SPECPILOT_TEST_DTYPE=bfloat16 timeout 240 python3 -m pytest -q -p no:cacheprovider \
    tests/test_logprobs.py tests/test_samples.py tests/test_structured_output.py > "$out/features-tests.log" 2>&1
echo "== feature tests rc=$?"; tail -n 8 "$out/features-tests.log"
timeout 300 python3 benchmarks/structured_cost.py --device cuda --num-prompts "${1:-10}" --max-new-tokens "${2:-128}" \
    --repeats "${REPEATS:-3}" --out "$out" 2>&1 | grep -v "^\[W" | tail -n 20
echo "== structured cost rc=$?"
