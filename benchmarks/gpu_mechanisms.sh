#!/usr/bin/env bash
# H200, inside `gpu_ferry.sh run`: what two-level, ragged and the budget do to offline throughput against
# speculation on every step and AR (benchmarks/mechanism_cost.py: modes interleaved on one engine, host milliseconds
# per stage), for chains (AR, spec, two-level of one width per pass, ragged), top-4 trees (AR, spec, two-level) and
# top-4 trees under the budget (AR, spec, budget: where speculation loses, AR steps instead), at B=8 and 32,
# HumanEval prompts (the wheels carried; ShareGPT needs .ferry/extra).
#   [TOKENS=128] [REPEATS=3] [WAVES=1] [PREFILL_WAVES=1] [SETS="chains trees budget"] [BATCHES="32 8"]
#   bash benchmarks/gpu_mechanisms.sh      -> $OUT/mechanisms/b{8,32}_{chains,trees,budget}[_pw{N}]/*.json
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}/mechanisms
for b in ${BATCHES:-32 8}; do
    for drafts in "chains ragged 1" "trees two-level 4" "budget budget 4"; do
        set -- $drafts
        [[ " ${SETS:-chains trees budget} " == *" $1 "* ]] || continue
        echo "== B=$b $1"
        timeout 240 python3 benchmarks/mechanism_cost.py --mechanism "$2" --topk "$3" --dataset humaneval --device cuda \
            --batch-size "$b" --max-new-tokens "${TOKENS:-128}" --repeats "${REPEATS:-3}" --waves "${WAVES:-1}" \
            --prefill-waves "${PREFILL_WAVES:-1}" --out "$out/b${b}_$1${PREFILL_WAVES:+_pw$PREFILL_WAVES}" 2>&1 \
            | grep -E "^(repeat|tok/s|host ms|prefill|decode|profiling)"
    done
done
