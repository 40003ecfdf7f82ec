#!/usr/bin/env bash
# H200, inside `gpu_ferry.sh run` (.ferry/extra carried with stage 2, or with the run): output ids of speculation
# against AR on the embedded model in bf16, served configuration (DFlash trees + n-gram assist), on the four
# bench datasets, at B=1 and 32 requests together, greedy and T=0.8 / top-p 0.95 with per-request seeds.
# Then the same through the HTTP server, 32 concurrent streams (benchmarks/server_identity.py), unless
# NO_SERVER is set; SERVERS picks those runs (default: server-greedy server-t08). RUNS picks the engine runs (default: greedy-b1 greedy-b32 t08-b1 t08-b32; "" for none);
# REPEATS (default 1): interleaved AR/speculative repeats of greedy-b1 (the README's headline: median, spread).
# .ferry/extra holds MT-Bench's questions and ShareGPT's opening turns (scripts/export_sharegpt_first_turns.py).
#   bash benchmarks/gpu_identity.sh [PROMPTS] [TOKENS]       -> $OUT/identity.tgz (bench JSON per run)
set -uo pipefail
cd "$(dirname "$0")/.."
prompts=${1:-32}; tokens=${2:-256}
out=${OUT:-/tmp/out}/identity; mkdir -p "$out"
run() {  # name, repeats, flags...
    local name=$1 repeats=$2; shift 2
    [[ " ${RUNS-greedy-b1 greedy-b32 t08-b1 t08-b32} " == *" $name "* ]] || return 0
    local t0=$SECONDS
    python3 -m specpilot bench --dataset humaneval mtbench sharegpt math --num-prompts "$prompts" \
        --max-new-tokens "$tokens" --repeats "$repeats" --speculative-algorithm dflash --device cuda \
        --output-dir "$out/$name" "$@" > "$out/$name.log" 2>&1
    echo "== $name rc=$? $((SECONDS - t0))s"
    tar czf "${OUT:-/tmp/out}/identity.tgz" -C "$out" .  # after each run: a cut-off call keeps what finished
    python3 -c "
import json, glob
for f in glob.glob('$out/$name/bench_*.json'):
    for r in json.load(open(f))['results']:
        s = r['spread']['speedup']
        print(r['dataset'], 'ids', r['identical_ids'], 'speedup', round(r['speedup'], 3), 'range',
              [round(v, 3) for v in (s['min'], s['max'])], 'tau', round(r['tau'], 3))"
}
run greedy-b1 "${REPEATS:-1}" --batch-size 1
run greedy-b32 1 --batch-size 32
run t08-b1 1 --batch-size 1 --temperature 0.8 --top-p 0.95 --sampling-seed 1
run t08-b32 1 --batch-size 32 --temperature 0.8 --top-p 0.95 --sampling-seed 1
server() {  # name, flags...
    local name=$1; shift
    [[ " ${SERVERS-server-greedy server-t08} " == *" $name "* ]] || return 0
    local t0=$SECONDS
    python3 benchmarks/server_identity.py --num-prompts "$prompts" --max-new-tokens "$tokens" --concurrency 32 \
        --out "$out/$name" "$@" -- --device cuda > "$out/$name.log" 2>&1
    echo "== $name rc=$? $((SECONDS - t0))s"; tail -n 4 "$out/$name.log"
}
if [ -z "${NO_SERVER:-}" ]; then
    server server-greedy
    server server-t08 --temperature 0.8 --top-p 0.95
fi
tar czf "${OUT:-/tmp/out}/identity.tgz" -C "$out" .
