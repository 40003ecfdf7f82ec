#!/usr/bin/env bash
# `make serve`'s settings on CPU against AR, served: client-side TPOT at concurrency 1 (AR, then
# speculation, then AR again, the same ShareGPT prompts), then the speculative server under load:
# 32 concurrent clients of specpilot's serving bench and, where SGLang is importable, SGLang's own
# bench_serving (ShareGPT, backend sglang), then scripts/load_test.py; the server's peak RSS last.
#   bash benchmarks/cpu_serving.sh OUT_DIR     (repo root, project venv; optional: SGLANG_PYTHON, TOKENIZER_DIR,
#                                              SHAREGPT_JSON = a file of complete ShareGPT records)
set -uo pipefail
OUT=${1:-specpilot-bench/cpu-serving}
PORT=${PORT:-30000}
PY=${PYTHON:-python}
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"
server=""
start() {  # name, then serve's flags
    local name=$1; shift
    /usr/bin/time -f "%M %e" -o "$OUT/$name.time" "$PY" -m specpilot serve --port "$PORT" "$@" > "$OUT/$name.log" 2>&1 &
    server=$!
    for _ in $(seq 300); do curl -sf "$URL/health" > /dev/null && return; sleep 1; done
    echo "server $name did not come up" >&2; exit 1
}
stop() { pkill -TERM -P "$server"; wait "$server"; }  # the server is GNU time's child
c1() { "$PY" -m specpilot bench --serving --base-url "$URL" --num-prompts 16 --max-concurrency 1 --max-new-tokens 128 \
        --output-dir "$OUT/$1" > "$OUT/$1.txt" 2>&1; }

start ar1 && c1 ar_c1_first && stop
start spec --speculative-algorithm dflash
c1 spec_c1
"$PY" -m specpilot bench --serving --base-url "$URL" --num-prompts 64 --max-concurrency 32 --max-new-tokens 64 \
    --output-dir "$OUT/spec_c32" > "$OUT/spec_c32.txt" 2>&1
if [ -n "${SGLANG_PYTHON:-}" ]; then
    # ShareGPT conversations that fit the served context (SGLang's loader keeps all of them otherwise)
    context=$(curl -s "$URL/get_model_info" | "$PY" -c "import json, sys; print(json.load(sys.stdin)['context_length'])")
    HF_HUB_OFFLINE=1 $SGLANG_PYTHON -m sglang.bench_serving --backend sglang --base-url "$URL" \
        --dataset-name sharegpt --dataset-path "$SHAREGPT_JSON" --sharegpt-context-len "$context" \
        --model "$TOKENIZER_DIR" --num-prompts 64 \
        --max-concurrency 32 --output-file "$OUT/sglang_bench_serving.jsonl" > "$OUT/sglang_bench_serving.txt" 2>&1
fi
"$PY" scripts/load_test.py --base-url "$URL" --clients 32 --duration 60 --pid "$(pgrep -P "$server" | head -1)" \
    > "$OUT/load_test.txt" 2>&1
curl -s "$URL/get_server_info" > "$OUT/spec_server_info.json"
stop
start ar2 && c1 ar_c1_second && stop
for f in ar1 spec ar2; do read -r kb secs < <(tail -1 "$OUT/$f.time"); echo "$f peak_rss_mb=$((kb / 1024)) wall_s=$secs"; done
grep -h "TPOT mean\|accept length\|successful\|failed" "$OUT"/*_c1_*.txt "$OUT"/spec_c1.txt "$OUT"/spec_c32.txt 2>/dev/null
