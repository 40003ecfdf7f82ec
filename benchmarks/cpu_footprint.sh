#!/usr/bin/env bash
# Peak resident memory (GNU time's %M) of the CLI's default commands on CPU: generate, serve under
# 32 concurrent clients (specpilot bench --serving), and force. Prints one JSON line per command.
#   bash benchmarks/cpu_footprint.sh [OUT_DIR]        (run from the repo root, in the project's venv)
set -euo pipefail
OUT=${1:-specpilot-bench/footprint}
PORT=${PORT:-30123}
PY=${PYTHON:-python}
mkdir -p "$OUT"
rss() {  # name, then the command: runs it under GNU time and records its peak RSS
    local name=$1; shift
    /usr/bin/time -f "%M %e" -o "$OUT/$name.time" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
    read -r kb secs < "$OUT/$name.time"
    printf '{"command": "%s", "peak_rss_mb": %.0f, "wall_s": %s}\n' "$name" "$((kb / 1024))" "$secs"
}

rss generate "$PY" -m specpilot generate --chat --prompt "Write a haiku about the sea." --speculative-algorithm dflash

/usr/bin/time -f "%M %e" -o "$OUT/serve.time" "$PY" -m specpilot serve --speculative-algorithm dflash \
    --port "$PORT" > "$OUT/serve.out" 2> "$OUT/serve.log" &
server=$!
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    sleep 1
done
"$PY" -m specpilot bench --serving --base-url "http://127.0.0.1:$PORT" --num-prompts 64 --max-concurrency 32 \
    --max-new-tokens 64 --output-dir "$OUT/serving" > "$OUT/serving.out" 2>&1
pkill -TERM -P "$server"  # the server is GNU time's child
wait "$server" || true
read -r kb secs < <(tail -1 "$OUT/serve.time")
printf '{"command": "serve (32 concurrent clients, 64 requests)", "peak_rss_mb": %.0f, "wall_s": %s}\n' \
    "$((kb / 1024))" "$secs"

rss force "$PY" -m specpilot force --speculative-algorithm dflash --dataset humaneval --num-prompts 8 \
    --max-new-tokens 64
