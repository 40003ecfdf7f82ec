#!/usr/bin/env bash
# H200, inside `gpu_ferry.sh run`: optimizer rounds on the embedded deployment (SmolLM2 target + shipped
# DFlash drafter, bf16, B=1, HumanEval). The memory and the reports live in /tmp/specpilot-optimize, so
# a later call on the same (still warm) machine goes on with RESUME=1; each call copies them to $OUT.
#   ROUNDS (3) AGENTS (2) BASELINE (1: also the best-of-N random baseline) RESUME (0) BUDGET_S (540)
#   TOKENS (128) PROMPTS (3)
# Rounds and baseline in two calls: BASELINE=0 first, then ROUNDS=0 RESUME=1 BASELINE=1 (the baseline gets as
# many evaluations as the loop spent in both).
set -uo pipefail
WORK=/tmp/specpilot-optimize
mkdir -p "$WORK" "$OUT"
flags=(--speculative-algorithm dflash --device cuda --rounds "${ROUNDS:-3}" --agents "${AGENTS:-2}"
       --dataset humaneval --num-prompts "${PROMPTS:-3}" --max-new-tokens "${TOKENS:-128}"
       --db "$WORK/memory.db" --output-dir "$WORK/reports")
[ "${BASELINE:-1}" = 1 ] && flags+=(--baseline)
[ "${RESUME:-0}" = 1 ] && flags+=(--resume)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git log --oneline -1 2>/dev/null || true
# at the budget, SIGTERM to the orchestrator alone: it stops after the candidate being judged (the round
# paused, for RESUME=1); the evaluator is not signalled, so no verdict is cut short
timeout --foreground -k 120 -s TERM "${BUDGET_S:-540}" python -m specpilot optimize "${flags[@]}" 2>&1 | tee -a "$WORK/optimize.log"
echo "optimize exit: ${PIPESTATUS[0]}"
python -m specpilot memory list --db "$WORK/memory.db" || true
tar -czf "$OUT/optimize.tgz" -C /tmp specpilot-optimize
