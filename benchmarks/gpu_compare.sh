#!/usr/bin/env bash
# H200, one call: the same benchmarks on two checkouts, interleaved (old, new, old, new, ...), so a
# change can be judged against the run-to-run spread: benchmarks/gpu_spec.py (Llama-8B shapes,
# synthetic), benchmarks/gpu_step_profile.py and the B=1 HumanEval bench (embedded model, shipped
# drafter, tree + assist). Results under $OUT/compare/<side>-<round>/, packed as $OUT/compare.tgz.
#   bash benchmarks/gpu_compare.sh OLD_DIR [ROUNDS]      (inside gpu_ferry.sh run; OLD_DIR: a checkout)
#   BATCHES (default "1 8"): gpu_spec.py's batch sizes; PROFILE=0 leaves the step profile out
set -uo pipefail
cd "$(dirname "$0")/.."
new=$PWD; old=$(cd "$1" && pwd); rounds=${2:-2}
# the old checkout comes without the shipped drafter's weights (gpu_ferry.sh old): the same files
[ -e "$old/specpilot/drafters/assets" ] || ln -s "$new/specpilot/drafters/assets" "$old/specpilot/drafters/assets"
out=${OUT:-/tmp/out}/compare; mkdir -p "$out"
bench="--dataset humaneval --num-prompts 20 --max-new-tokens 256 --speculative-algorithm dflash
       --speculative-num-draft-tokens 16 --speculative-eagle-topk 4 --speculative-ngram-assist 2 --device cuda"
for r in $(seq 1 "$rounds"); do
    for side in old new; do
        dir=$([ "$side" = old ] && echo "$old" || echo "$new")
        o="$out/$side-$r"; mkdir -p "$o"
        (cd "$dir" && export PYTHONPATH=/tmp/site:$dir
         t0=$SECONDS
         python3 benchmarks/gpu_spec.py --out "$o/spec" --batch ${BATCHES:-1 8} > "$o/spec.log" 2>&1
         echo "$side-$r gpu_spec rc=$? $((SECONDS - t0))s"; tail -4 "$o/spec.log"
         if [ "${PROFILE:-1}" != 0 ]; then
             t0=$SECONDS
             python3 benchmarks/gpu_step_profile.py --out "$o/profile" --num-prompts 2 --max-new-tokens 128 --topk 4 \
                 --assist 2 > "$o/profile.log" 2>&1
             echo "$side-$r step_profile rc=$? $((SECONDS - t0))s"; sed -n 2,3p "$o/profile.log"
         fi
         t0=$SECONDS
         python3 -m specpilot bench $bench --output-dir "$o/bench" > "$o/bench.log" 2>&1
         echo "$side-$r bench rc=$? $((SECONDS - t0))s"; grep -iE "speedup|tau|tpot" "$o/bench.log" | tail -4)
    done
done
tar czf "${OUT:-/tmp/out}/compare.tgz" -C "$out" .
