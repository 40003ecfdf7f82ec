#!/usr/bin/env bash
# H200, inside `gpu_ferry.sh run`: the serving features on the invariant CUDA path in bf16 — logprobs bit-equal
# to AR's, n samples, constrained speculation equal to constrained AR (the suite's tests on CUDA), then what a
# JSON schema costs the speedup on the embedded model (benchmarks/structured_cost.py), then exact token forcing
# with that schema active (a chain with device acceptance and early launch, the served tree + assist).
#   bash benchmarks/gpu_features.sh [PROMPTS] [TOKENS]      -> $OUT/features-tests.log, $OUT/structured_cost.json,
#                                                               $OUT/force-schema-*.json
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
SPECPILOT_TEST_DEVICE=cuda SPECPILOT_TEST_DTYPE=bfloat16 timeout 240 python3 -m pytest -q -p no:cacheprovider \
    tests/test_logprobs.py tests/test_samples.py tests/test_structured_output.py > "$out/features-tests.log" 2>&1
echo "== feature tests rc=$?"; tail -n 8 "$out/features-tests.log"
timeout 300 python3 benchmarks/structured_cost.py --device cuda --num-prompts "${1:-10}" --max-new-tokens "${2:-128}" \
    --repeats "${REPEATS:-3}" --out "$out" 2>&1 | grep -v "^\[W" | tail -n 20
echo "== structured cost rc=$?"
python3 -c "import json, sys; sys.path.insert(0, 'benchmarks'); from structured_cost import SCHEMA; print(json.dumps(SCHEMA))" \
    > /tmp/schema.json
for cfg in "chain 1 0" "tree-assist 4 3"; do
    set -- $cfg
    python3 -m specpilot force --dataset humaneval --num-prompts 4 --max-new-tokens 64 --device cuda --dtype bfloat16 \
        --speculative-algorithm dflash --speculative-num-draft-tokens 16 --speculative-eagle-topk "$2" \
        --speculative-ngram-assist "$3" --json-schema @/tmp/schema.json > "$out/force-schema-$1.json" 2> "$out/force-schema-$1.log"
    echo "== force with the schema, $1: rc=$? $(python3 -c "
import json; t = open('$out/force-schema-$1.json').read(); d = json.loads(t[t.index('{'):])
print({k: d.get(k) for k in ('passed', 'exact', 'positions_checked', 'non_tie_mismatches', 'row_mismatches', 'tau')})" 2>&1 | tail -1)"
done
