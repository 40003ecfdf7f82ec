#!/usr/bin/env bash
# Peak resident memory (GNU time's %M) of the one-shot CLI commands on CPU at their defaults: generate
# (AR and DFlash) and force. The server's, under 32 concurrent clients, is benchmarks/cpu_serving.sh's.
#   bash benchmarks/cpu_footprint.sh [OUT_DIR]        (run from the repo root, in the project's venv)
set -euo pipefail
OUT=${1:-specpilot-bench/footprint}
PY=${PYTHON:-python}
mkdir -p "$OUT"
rss() {  # name, then the command: runs it under GNU time and prints its peak RSS as one JSON line
    local name=$1; shift
    /usr/bin/time -f "%M %e" -o "$OUT/$name.time" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
    read -r kb secs < "$OUT/$name.time"
    printf '{"command": "%s", "peak_rss_kb": %s, "wall_s": %s}\n' "$name" "$kb" "$secs"
}
rss generate_ar "$PY" -m specpilot generate --chat --prompt "Write a haiku about the sea."
rss generate_dflash "$PY" -m specpilot generate --chat --prompt "Write a haiku about the sea." --speculative-algorithm dflash
rss force "$PY" -m specpilot force --speculative-algorithm dflash --dataset humaneval --num-prompts 8 --max-new-tokens 64
