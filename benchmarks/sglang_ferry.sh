#!/usr/bin/env bash
# Brings SGLang (the `sglang` extra's version) to the device machine, which reaches no package index, in parts one
# device call can carry beside the working tree (benchmarks/sglang_wheels.py; for SGLang 0.5.17 about 500 MiB,
# most of it sglang-kernel's wheel, split across parts), then installs it beside the plugin. It needs the main
# ferry installed first on the same machine (benchmarks/gpu_ferry.sh: the embedded model's wheel, gguf).
#
# Here, once:   bash benchmarks/sglang_ferry.sh prepare              (fills .ferry/sglang, which git ignores)
# On the device, in back-to-back calls (the machine is given back ~30 s after a call returns), each carrying
# .ferry/sglang/manifest.json and its part:
#   call k (carry .ferry/sglang/partKK):  bash benchmarks/sglang_ferry.sh stage KK       (KK = 01 .. the last)
#   then (carry the manifest alone):     bash benchmarks/sglang_ferry.sh install        (checks every wheel's sha256)
#   and:                                 bash benchmarks/sglang_ferry.sh run 'CMD'      (SGLang, the plugin and the
#                                        embedded model's HF directory at /tmp/smollm2; the main ferry's packages too
#                                        where benchmarks/gpu_ferry.sh installed them)
#   or both in one bounded call:         bash benchmarks/sglang_round.sh                (forcing and serving)
set -euo pipefail
cd "$(dirname "$0")/.."
FERRY=.ferry/sglang
STAGED=/tmp/sgl-ferry
SITE=/tmp/sgl-site

case "${1:-}" in
prepare)
    grep -qx "/.ferry/" .git/info/exclude 2>/dev/null || echo "/.ferry/" >> .git/info/exclude
    rm -rf "$FERRY"
    "${PYTHON:-.venv/bin/python}" benchmarks/sglang_wheels.py prepare --out "$FERRY"
    # ShareGPT text for SGLang's benchmark client, which would download it (benchmarks/sglang_round.sh carries it)
    "${PYTHON:-.venv/bin/python}" scripts/export_sharegpt_first_turns.py --first-exchanges \
        --out "$FERRY/sharegpt_first_exchanges.json.gz"
    # a stage call carries the tracked tree, the manifest and one part: all within the device's 64 MiB
    tree=$(git ls-files -z | du --files0-from=- -cb | tail -1 | cut -f1)
    part=$(du -sb "$FERRY"/part* | sort -n | tail -1 | cut -f1)
    if (( tree + part + $(stat -c %s "$FERRY/manifest.json") > 64 * 2**20 )); then
        echo "the tracked tree ($tree B) and the largest part ($part B) exceed a call's 64 MiB: lower PART_MIB" \
             "in benchmarks/sglang_wheels.py" >&2
        exit 1
    fi
    ;;
stage)
    mkdir -p "$STAGED"
    cp "$FERRY/part$2"/* "$STAGED/"
    ls "$STAGED" | wc -l
    ;;
install)
    python3 benchmarks/sglang_wheels.py join --manifest "$FERRY/manifest.json" --staged "$STAGED" --out "$STAGED/whl"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$STAGED"/whl/*.whl
    # the plugin as a distribution: SGLang's load_plugins() finds it by its entry point
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" .
    rm -rf "$STAGED"
    # what a launch imports, before any server is started: a missing package is named here, not in a server log
    PYTHONPATH="$SITE:/tmp/site:$PWD" python3 benchmarks/sglang_wheels.py check
    # the embedded model as a Hugging Face directory (SGLang loads safetensors), written by transformers' GGUF loader
    PYTHONPATH="$SITE:/tmp/site:$PWD" python3 -c "
from transformers import AutoModelForCausalLM, AutoTokenizer
from specpilot.models.checkpoint import embedded_default_path
p = embedded_default_path()
for cls in (AutoModelForCausalLM, AutoTokenizer):
    cls.from_pretrained(p.parent, gguf_file=p.name).save_pretrained('/tmp/smollm2')
print('embedded model -> /tmp/smollm2')"
    ;;
run)
    export PYTHONPATH="$SITE:/tmp/site:$PWD" PYTHONUNBUFFERED=1 SGLANG_PLUGINS=specpilot
    eval "$2"
    ;;
*)
    echo "usage: $0 prepare | stage KK | install | run 'CMD'" >&2
    exit 2
    ;;
esac
