#!/usr/bin/env bash
# H200, inside `gpu_ferry.sh run`: the forcing, keyed-sampling, red-team, structured-output, B12 and overlap tests on CUDA bf16
# (tests/test_speculative.engine_for reads SPECPILOT_TEST_DEVICE; tiny models, a few minutes; B12's and the invariant
# kernels' interpreter tests stay on CPU: the device's triton 3.6 interpreter fails on its numpy; the fp32 GEMM-tile
# case, 105 s there, too: bf16 is the device's), then exact token forcing
# of every drafter in bf16 (gpu_force_all.sh) within FORCE_S seconds: clean candidates must pass exact forcing,
# every planted one must fail it. The verdicts are packed even where the forcing runs out of time, with the
# invariant attention's tile-height probe (benchmarks/tile_heights.py: 16- against 32-row tiles per head size).
#   [TUNE=1 [TUNE_S=150]] [TESTS_S=360] [FORCE_S=420] [SKIP_TILE_HEIGHTS=1] bash benchmarks/gpu_exact.sh [PROMPTS] [TOKENS]
#       -> $OUT/exact-tests.log, $OUT/force-bfloat16.tgz
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
# TUNE=1: tune this device's GEMM tiles for the embedded target first (bf16: decode and verify rows; B12: decode
# rows), so that the tests and forcing run on them
if [ -n "${TUNE:-}" ]; then
    for tuning in "bf16 decode verify" "b12 decode"; do
        read -r kernel rows <<< "$tuning"
        # shellcheck disable=SC2086 # rows: one or two words
        timeout "${TUNE_S:-150}" python3 -m specpilot.cli bench --tune-gemm-tiles --device cuda --tile-kernels "$kernel" \
            --tile-rows $rows --output-dir "$out/tiles-$kernel" 2>&1 | grep -v -E "it/s\]|s/it\]" | tail -n 40
    done
fi
# The mechanisms' own tests first: a run cut short by TESTS_S has covered the paths most often changed
SPECPILOT_TEST_DEVICE=cuda SPECPILOT_TEST_DTYPE=bfloat16 timeout "${TESTS_S:-360}" python3 -m pytest -q -p no:cacheprovider \
    tests/test_two_level.py tests/test_overlap.py tests/test_budget.py tests/test_gemm_variants.py tests/test_gemm_tiles.py \
    tests/test_forcing_exact.py tests/test_redteam.py tests/test_speculative.py tests/test_batch_invariance.py \
    tests/test_keyed_sampling.py tests/test_stops.py tests/test_graph_paths.py tests/test_structured_output.py \
    tests/test_b12_gemm.py \
    --deselect tests/test_b12_gemm.py::test_triton_equals_the_bf16_kernel_on_the_decoded_weights \
    --deselect tests/test_batch_invariance.py::test_invariant_kernels_under_the_interpreter \
    --deselect 'tests/test_batch_invariance.py::test_gemm_tiles_do_not_change_a_row[float32]' > "$out/exact-tests.log" 2>&1
echo "== exact tests rc=$?"; tail -n 12 "$out/exact-tests.log"
timeout "${FORCE_S:-420}" bash benchmarks/gpu_force_all.sh bfloat16 "${1:-8}" "${2:-128}"
echo "== forcing rc=$? (124: out of time; the verdicts so far are packed)"
mkdir -p "$out/force"
if [ -z "${SKIP_TILE_HEIGHTS:-}" ]; then
    timeout 120 python3 benchmarks/tile_heights.py --out "$out/force" > "$out/force/tile_heights.log" 2>&1
    echo "== tile heights rc=$?"; tail -n 15 "$out/force/tile_heights.log"
fi
tar czf "$out/force-bfloat16.tgz" -C "$out/force" .
