#!/usr/bin/env bash
# H200, inside `gpu_ferry.sh run`: exact token forcing of every drafter in bf16 (gpu_force_all.sh), then the
# forcing, keyed-sampling and red-team tests on CUDA bf16 (tests/test_speculative.engine_for reads
# SPECPILOT_TEST_DEVICE): clean candidates must pass exact forcing, every planted one must fail it.
#   bash benchmarks/gpu_exact.sh [PROMPTS] [TOKENS]      -> $OUT/force-bfloat16.tgz, $OUT/exact-tests.log
set -uo pipefail
cd "$(dirname "$0")/.."
bash benchmarks/gpu_force_all.sh bfloat16 "${1:-8}" "${2:-128}"
SPECPILOT_TEST_DEVICE=cuda SPECPILOT_TEST_DTYPE=bfloat16 timeout 300 python3 -m pytest -q -p no:cacheprovider \
    tests/test_redteam.py tests/test_keyed_sampling.py tests/test_speculative.py tests/test_forcing_exact.py \
    tests/test_budget.py tests/test_stops.py tests/test_two_level.py \
    > "${OUT:-/tmp/out}/exact-tests.log" 2>&1
echo "== exact tests rc=$?"; tail -n 30 "${OUT:-/tmp/out}/exact-tests.log"
