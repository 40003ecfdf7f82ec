#!/usr/bin/env bash
# H200, inside `gpu_ferry.sh run` (ShareGPT needs .ferry/extra staged): issue 20's load figures in parts of one device
# call each (under 10 minutes), every part's results packed into one file ($OUT/<part>.tgz: a call brings back at
# most 8 files) beside its log ($OUT/<part>.log):
#   offline  graphed against eager prefills, AR and speculation, B=32, 4 waves (benchmarks/prefill_graphs.py)
#   offline-eos  `specpilot bench --batch-size 32`: 512 ShareGPT prompts x 256 tokens, 32 running, requests stopping
#            at EOS, AR and the defaults interleaved 3 times (the issue's own offline measurement), with continuous
#            batching, then in waves of 32
#   served   `specpilot bench --serving --sweep` at C = 1..64, ignore-EOS: AR, stock, the defaults, the defaults +
#            budget, the defaults + two-level + budget (the cost table profiled first where none is cached), the
#            defaults with coalesced admission
#   served-eos  the same with requests stopping at EOS
#   replay   Llama-3.1-8B shapes, acceptance replayed at tau 6.5, 192 tokens (REPLAY_TOKENS), B = 16 and 32: stock,
#            the defaults, + two-level, + two-level + ragged (benchmarks/gpu_spec.py --mechanisms), from the embedded
#            pair's confidence trace (REPLAY=: another trace or bench JSON), so two-level reads recorded confidences
# Every part's archive also holds the cost tables the machine profiled (two-level's T(B, rows): what a CPU analysis
# of its choices needs).
#   bash benchmarks/gpu_load_suite.sh offline|offline-eos|served|served-eos|replay     [TOKENS=256] [PROMPTS=32 served, 512 offline-eos] [REPEATS=2]
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: gpu_load_suite.sh offline|offline-eos|served|served-eos|replay}
out=${OUT:-/tmp/out}
mkdir -p "$out"
work=$(mktemp -d)
tokens=${TOKENS:-256}
quiet() { grep -v -E "it/s\]|s/it\]"; }
{
case "$part" in
offline)
    timeout 300 python3 benchmarks/prefill_graphs.py --batch-size 32 --waves 4 --max-new-tokens "$tokens" \
        --repeats "${REPEATS:-2}" --out "$work/prefill_graphs" 2>&1 | quiet | tail -n 6
    ;;
offline-eos)
    for batching in continuous waves; do
        timeout 250 python3 -m specpilot.cli bench --device cuda --dataset sharegpt --num-prompts "${PROMPTS:-512}" \
            --speculative-algorithm dflash --max-new-tokens "$tokens" --batch-size 32 --batching $batching --repeats 3 \
            --output-dir "$work/bench-$batching" 2>&1 | quiet | tail -n 14
    done
    ;;
served|served-eos)
    # two-level reads the cost table of this device and model: profiled once per machine
    timeout 120 python3 -m specpilot.cli bench --profile-cost-table --device cuda 2>&1 | quiet | tail -n 2
    eos=$([ "$part" = served-eos ] && echo --disable-ignore-eos)
    timeout 500 python3 -m specpilot.cli bench --serving --sweep $eos --serve-flags "--device cuda" \
        --setting ar="--speculative-algorithm none" --setting stock="--mechanisms stock" --setting all="" \
        --setting budget="--mechanisms +budget" --setting two-level="--mechanisms +two-level,+budget" \
        --setting coalesce="--admission coalesce" \
        --num-prompts "${PROMPTS:-32}" --max-new-tokens "$tokens" --concurrency 1 4 8 16 32 64 --out "$work/sweep" \
        2>&1 | quiet | tail -n 24
    ;;
replay)
    # 192 tokens: ~30 steps a request, so the last steps' shorter verifies weigh little on tau (64 cost ~8%)
    timeout 560 python3 benchmarks/gpu_spec.py --batch 16 32 --repeats "${REPEATS:-2}" \
        --new-tokens "${REPLAY_TOKENS:-192}" \
        --replay "${REPLAY:-docs/results/2026-12-06_cpu_s31/confidence_trace_humaneval.json}" --replay-tau 6.5 \
        --mechanisms stock default +two-level +two-level,+ragged --out "$work/replay" 2>&1 | quiet | tail -n 16
    ;;
*)
    echo "unknown part $part: offline, offline-eos, served, served-eos or replay" >&2
    exit 2
    ;;
esac
} 2>&1 | tee "$out/$part.log"
cp -r "$(python3 -c 'from specpilot.config import cache_root; print(cache_root())')/cost_tables" "$work/" 2>/dev/null
tar czf "$out/$part.tgz" -C "$work" .
