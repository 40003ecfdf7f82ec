#!/usr/bin/env bash
# Issue 23's device round in one call, after benchmarks/sglang_ferry.sh's stages on the same machine (carry
# .ferry/sglang/manifest.json and .ferry/sglang/sharegpt_first_exchanges.json.gz): `install`, then token forcing of
# SPECPILOT against SGLang AR (benchmarks/sglang_force.py, bounded by FORCE_S seconds) and the serving comparison
# (benchmarks/sglang_plugin_serving.py, the rest), so that the call ends within LIMIT_S seconds with everything in
# $OUT/sglang_round.tgz (a device call returns 8 files).
#
#   bash benchmarks/sglang_round.sh [LIMIT_S]        (default 560)
#   FORCE_S=240  FORCE_ARGS="--candidate specpilot --deterministic"   the forcing's bound (0: none) and its runs
#   SERVE_ARGS="--server none --ours serve"                           the serving's runs (default: the script's)
#   SKIP_INSTALL=1                                                    a later round on the same machine
#   REPEATS=3  MIN_PROMPTS=16                         interleaved passes over C = 1, 8, 32 per server (median, spread),
#                                                    each of max(MIN_PROMPTS, 2 C) prompts
#   PROFILE_ARGS="--concurrency 1 32 --steps 60"     then benchmarks/sglang_plugin_profile.py (SGLang's profiler;
#                                                    the summaries and logs come back, the traces stay)
set -uo pipefail
cd "$(dirname "$0")/.."
limit=${1:-560}
start=$(date +%s)
left() { echo $(( start + limit - $(date +%s) )); }
[ -n "${SKIP_INSTALL:-}" ] || bash benchmarks/sglang_ferry.sh install 2>&1 | tail -3
rm -rf "$OUT/round" && mkdir -p "$OUT/round"
# the text SGLang's random prompts are cut from: without one, its client downloads ShareGPT
gunzip -c .ferry/sglang/sharegpt_first_exchanges.json.gz > /tmp/sharegpt_first_exchanges.json
# SIGINT: the scripts' finally blocks close the servers they started
if (( ${FORCE_S:-240} > 0 )); then
    bash benchmarks/sglang_ferry.sh run "timeout -s INT -k 15 ${FORCE_S:-240} python3 benchmarks/sglang_force.py \
        --model-path /tmp/smollm2 ${FORCE_ARGS:-} --out $OUT/round/force"
    echo "forcing: exit $?"
    pkill -f sglang.launch_server; sleep 3
fi
if (( $(left) > 60 )); then
    bash benchmarks/sglang_ferry.sh run "timeout -s INT -k 15 $(( $(left) - 30 )) python3 \
        benchmarks/sglang_plugin_serving.py --model-path /tmp/smollm2 \
        --dataset-path /tmp/sharegpt_first_exchanges.json ${SERVE_ARGS:-} --concurrency 1 8 32 \
        --min-prompts ${MIN_PROMPTS:-16} --repeats ${REPEATS:-3} --out $OUT/round/serving"
    echo "serving: exit $?"
    pkill -f sglang.launch_server
else
    echo "serving: skipped, $(left) s left"  # a bound of its own that would end before a server starts
fi
if [ -n "${PROFILE_ARGS:-}" ] && (( $(left) > 90 )); then
    sleep 3
    bash benchmarks/sglang_ferry.sh run "timeout -s INT -k 15 $(( $(left) - 20 )) python3 \
        benchmarks/sglang_plugin_profile.py --model-path /tmp/smollm2 \
        --dataset-path /tmp/sharegpt_first_exchanges.json $PROFILE_ARGS --out $OUT/round/profile"
    echo "profile: exit $?"
    pkill -f sglang.launch_server
fi
tar czf "$OUT/sglang_round.tgz" --exclude='*.json.gz' -C "$OUT" round && rm -rf "$OUT/round"
ls -la "$OUT"
