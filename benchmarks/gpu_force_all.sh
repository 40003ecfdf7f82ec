#!/usr/bin/env bash
# H200: token forcing of every drafter on the embedded model (chain, tree, n-gram assist on each, PARD,
# n-gram; a tree under a JSON schema; in bf16 also a tree with the target's weights as B12), one dtype, HumanEval prompts; one JSON verdict per drafter
# in $OUT/force (gpu_exact.sh packs them). PARD has no
# shipped checkpoint: a random one of the target's family and vocabulary stands in (forcing checks the
# output, whatever the drafter proposes).
#   [CONFIGS="chain tree ..."] bash benchmarks/gpu_force_all.sh [DTYPE] [PROMPTS] [TOKENS]     (inside gpu_ferry.sh run;
#   CONFIGS: only these drafter configurations, in this script's order)
set -uo pipefail
cd "$(dirname "$0")/.."
dtype=${1:-float32}; prompts=${2:-8}; tokens=${3:-128}
out=${OUT:-/tmp/out}/force; mkdir -p "$out"
pard=/tmp/random-pard
python3 -c "
import sys; sys.path.insert(0, 'tests')
from pathlib import Path
from spec_fixtures import write_random_pard
write_random_pard(Path('$pard'), pard_token=49151, vocab_size=49152)"
common="--dataset humaneval --num-prompts $prompts --max-new-tokens $tokens --device cuda --dtype $dtype"
wanted() { [ -z "${CONFIGS:-}" ] || [[ " $CONFIGS " == *" $1 "* ]]; }
run() {  # name, flags...
    local name=$1; shift
    wanted "$name" || return 0
    local t0=$SECONDS
    python3 -m specpilot force $common "$@" > "$out/$name.json" 2> "$out/$name.log"
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s $(python3 -c "
import json; t = open('$out/$name.json').read(); d = json.loads(t[t.index('{'):])
print({k: d.get(k) for k in ('passed', 'exact', 'positions_checked', 'non_tie_mismatches', 'tie_mismatches', 'row_mismatches', 'logit_deviations', 'stock_noise', 'tau')})" 2>&1 | tail -1)"
}
run chain --speculative-algorithm dflash --speculative-num-draft-tokens 16 --speculative-eagle-topk 1 --speculative-ngram-assist 0
run chain-assist --speculative-algorithm dflash --speculative-num-draft-tokens 16 --speculative-eagle-topk 1 --speculative-ngram-assist 2
run tree --speculative-algorithm dflash --speculative-num-draft-tokens 16 --speculative-eagle-topk 4 --speculative-ngram-assist 0
run tree-assist --speculative-algorithm dflash --speculative-num-draft-tokens 16 --speculative-eagle-topk 4 --speculative-ngram-assist 2
run pard --speculative-algorithm pard --speculative-draft-model-path $pard --speculative-num-draft-tokens 8
run pard-assist --speculative-algorithm pard --speculative-draft-model-path $pard --speculative-num-draft-tokens 8 --speculative-ngram-assist 2
run ngram --speculative-algorithm ngram --speculative-num-draft-tokens 8
# speculation or AR per step by measured rates (budget), beside every mechanism a tree takes
run tree-assist-budget --speculative-algorithm dflash --speculative-num-draft-tokens 16 --speculative-eagle-topk 4 \
    --speculative-ngram-assist 2 --mechanisms budget,device-acceptance,early-launch,layout-ahead,device-lookup
# each request verifies the drafts worth their rows (two-level: the cost table profiled first), with the budget and
# every mechanism a chain takes
if wanted chain-assist-two-level || wanted tree-assist-two-level || wanted chain-assist-ragged; then
    python3 -m specpilot bench --profile-cost-table --device cuda --dtype $dtype --cost-batch-sizes 1 2 4 8 \
        --cost-tokens 1 2 4 8 16 --output-dir "$out/cost-table" > "$out/cost-table.log" 2>&1
fi
run chain-assist-two-level --speculative-algorithm dflash --speculative-num-draft-tokens 16 --speculative-eagle-topk 1 \
    --speculative-ngram-assist 2 --mechanisms two-level,budget,device-acceptance,early-launch,layout-ahead
run tree-assist-two-level --speculative-algorithm dflash --speculative-num-draft-tokens 16 --speculative-eagle-topk 4 \
    --speculative-ngram-assist 2 --mechanisms two-level,device-acceptance,early-launch,layout-ahead,device-lookup
# the same with ragged graphs: requests of different widths packed into one graph per (batch, rows) bucket
run chain-assist-ragged --speculative-algorithm dflash --speculative-num-draft-tokens 16 --speculative-eagle-topk 1 \
    --speculative-ngram-assist 2 --mechanisms two-level,ragged,device-acceptance,early-launch,layout-ahead
# a tree with a JSON schema (HumanEval prompts do not ask for JSON: the grammar overrules the target often, and the
# decisions it redoes after the device's acceptance go on down the drafts the device left in place)
run tree-assist-schema --speculative-algorithm dflash --speculative-num-draft-tokens 16 --speculative-eagle-topk 4 \
    --speculative-ngram-assist 2 --json-schema '{"type": "object", "properties": {"name": {"type": "string",
    "maxLength": 40}, "summary": {"type": "string", "maxLength": 200}, "arguments": {"type": "integer"}},
    "required": ["name", "summary", "arguments"], "additionalProperties": false}'
# the target's weights as B12 (against a bf16 reference of its own), with every mechanism a tree takes
if [ "$dtype" = bfloat16 ]; then
    run tree-assist-b12 --speculative-algorithm dflash --speculative-num-draft-tokens 16 --speculative-eagle-topk 4 \
        --speculative-ngram-assist 2 --mechanisms b12,device-acceptance,early-launch,layout-ahead,device-lookup
fi
