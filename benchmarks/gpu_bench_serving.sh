#!/usr/bin/env bash
# H200, inside `gpu_ferry.sh run` on a machine already staged (carry .ferry/sgl: SGLang 0.5.10's client, the wheels
# its imports need beyond the image, and SGLang's view of ShareGPT): sglang.bench_serving against the speculative
# server and the AR one, both serving up to 256 requests from the KV memory 32 slots x 4,112 positions take.
#   bash benchmarks/gpu_bench_serving.sh ["32 64 128 256"]      -> $OUT/sglang_client/
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}/sglang_client; mkdir -p "$out"
if [ ! -f /tmp/sgl/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sgl .ferry/sgl/*.whl \
        && touch /tmp/sgl/.installed
fi
gunzip -c .ferry/sgl/sharegpt_first_exchanges.json.gz > /tmp/sharegpt_first_exchanges.json
export PYTHONPATH=/tmp/sgl:$PYTHONPATH
pool="--device cuda --max-running-requests 256 --max-total-tokens 131584"
timeout 560 python3 benchmarks/sglang_client.py --dataset-path /tmp/sharegpt_first_exchanges.json \
    --concurrency ${1:-32 64 128 256} --out "$out" \
    --server spec="$pool" --server ar="$pool --speculative-algorithm none"
echo "== sglang client rc=$?"
