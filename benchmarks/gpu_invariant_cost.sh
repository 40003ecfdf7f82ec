#!/usr/bin/env bash
# H200, inside `gpu_ferry.sh run`: what the batch-invariant kernels cost the embedded deployment at B=1.
# `specpilot bench` on HumanEval with the invariant kernels (the default) and with --no-batch-invariant,
# alternated REPEATS times (REPEATS=0: none), then the step profile (graph replays, kernels, idle gaps) of
# each configuration in a process of its own, so that one failing leaves the others' results. FORCE=1 first runs
# `specpilot force` of the served drafter in both modes: τ over stock's own texts, the same for both (the bench's
# τ is over each mode's own texts, which differ off the invariant path).
set -uo pipefail
WORK=/tmp/invariant-cost  # one archive comes back: $OUT takes few files
mkdir -p "$WORK" "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${FORCE:-0}" = 1 ]; then
    for mode in invariant fast; do
        extra=(); [ "$mode" = fast ] && extra=(--no-batch-invariant)
        python -m specpilot force --dataset humaneval --num-prompts "${PROMPTS:-10}" --max-new-tokens 128 \
            --device cuda --speculative-algorithm dflash "${extra[@]}" > "$WORK/force_$mode.json" 2> "$WORK/force_$mode.log"
        echo "== force $mode: exit $? $(python3 -c "
import json; t = open('$WORK/force_$mode.json').read(); d = json.loads(t[t.index('{'):])
print({k: d.get(k) for k in ('passed', 'exact', 'positions_checked', 'non_tie_mismatches', 'tau')})" 2>&1 | tail -1)"
    done
fi
for r in $(seq 1 "${REPEATS:-2}"); do
    for mode in invariant fast; do
        extra=(); [ "$mode" = fast ] && extra=(--no-batch-invariant)
        python -m specpilot bench --dataset humaneval --num-prompts "${PROMPTS:-10}" --max-new-tokens 256 \
            --speculative-algorithm dflash --repeats 1 "${extra[@]}" --output-dir "$WORK/bench_${mode}_$r" \
            2>&1 | tail -4
    done
done
for inv in 1 0; do
    for topk in ${TOPK:-4 1}; do
        python benchmarks/gpu_step_profile.py --out "$WORK/profile_inv${inv}_topk${topk}" --num-prompts 4 \
            --topk "$topk" --assist "${ASSIST:-3}" --batch-invariant "$inv" > "$WORK/profile_inv${inv}_topk${topk}.log" 2>&1
        echo "== invariant $inv topk $topk: exit $?"; grep -v "^\[W" "$WORK/profile_inv${inv}_topk${topk}.log" | head -40
    done
done
tar -czf "$OUT/invariant_cost.tgz" -C /tmp invariant-cost
