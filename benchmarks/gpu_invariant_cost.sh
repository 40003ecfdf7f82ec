#!/usr/bin/env bash
# H200, inside `gpu_ferry.sh run`: what the batch-invariant kernels cost the embedded deployment at B=1.
# `specpilot bench` on HumanEval with the invariant kernels (the default) and with --no-batch-invariant,
# alternated REPEATS times, then the step profile (graph replays, kernels, idle gaps) of both.
set -uo pipefail
WORK=/tmp/invariant-cost  # one archive comes back: $OUT takes few files
mkdir -p "$WORK" "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for r in $(seq 1 "${REPEATS:-2}"); do
    for mode in invariant fast; do
        extra=(); [ "$mode" = fast ] && extra=(--no-batch-invariant)
        python -m specpilot bench --dataset humaneval --num-prompts "${PROMPTS:-10}" --max-new-tokens 256 \
            --speculative-algorithm dflash --repeats 1 "${extra[@]}" --output-dir "$WORK/bench_${mode}_$r" \
            2>&1 | tail -4
    done
done
python benchmarks/gpu_step_profile.py --out "$WORK/profile" --num-prompts 4 --topk 1 4 --assist 0 \
    --batch-invariant 1 0 2>&1 | tail -60
tar -czf "$OUT/invariant_cost.tgz" -C /tmp invariant-cost
