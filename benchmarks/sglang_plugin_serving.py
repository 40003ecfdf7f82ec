"""SPECPILOT inside SGLang against SGLang's own AR and NGRAM, and `specpilot serve`, on one model (inside
`benchmarks/sglang_ferry.sh run`):

1. identity: each server (one at a time) answers the same prompts greedily through its native /generate; each
   SGLang server's output ids are compared with SGLang AR's, prompt by prompt (in bf16 SGLang's verify and decode
   attention round differently, so only SPECPILOT under --deterministic, verifying with decode rows, is meant to
   equal it); `specpilot serve` runs other kernels, so its ids are reported beside them;
2. throughput: `sglang.bench_serving` (random prompts of fixed lengths cut from ShareGPT text, ignore-EOS) at each
   concurrency, against each server alike.

    python benchmarks/sglang_plugin_serving.py --model-path /tmp/smollm2 --dataset-path sharegpt.json \
        --concurrency 1 8 32 --out DIR [--deterministic] [--attention-backend flashinfer] \
        [--server NAME="extra launch_server flags" ...] [--ours NAME="specpilot serve flags" ...]

Default SGLang servers: `ar` (no speculation), SGLang's built-in `ngram` and `dflash` (its DFlash worker on the
shipped drafter) and `specpilot` (--speculative-algorithm SPECPILOT with the shipped drafter, trees of top-4), all on
the triton attention backend, which takes a tree mask, in bf16 (BASE); default `specpilot serve`: `serve` (the embedded
model, the shipped profile, on CUDA). A server that cannot start on the model is reported with its log's tail, and
the rest run. Each server's log and SGLang's JSON lines go to DIR; the summary to DIR/sglang_plugin.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from specpilot.bench import provenance
from specpilot.bench.charts import plt, save
from specpilot.bench.harness import spread
from specpilot.drafters import EMBEDDED_DRAFTER
from specpilot.optimizer.remote import Server, free_port

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea.",
           "import numpy as np\n\ndef softmax(x):", "Explain what a hash table is.", "1, 1, 2, 3, 5, 8,",
           "SELECT name FROM users WHERE", "Once upon a time"]
BACKEND = "--attention-backend triton"  # a backend that takes a tree mask
BASE = f"{BACKEND} --dtype bfloat16"  # every SGLang server alike, in bf16 as ours (the directory's config says fp16)
SERVERS = {  # the plugin right after AR: a run cut by its time bound still has the comparison that matters
    "ar": BASE,
    "specpilot": f"{BASE} --speculative-algorithm SPECPILOT --speculative-draft-model-path {EMBEDDED_DRAFTER} "
                 "--speculative-eagle-topk 4",
    "ngram": f"{BASE} --speculative-algorithm NGRAM",
    # SGLang's own DFlash worker on the shipped drafter (its checkpoint is in the DFlash layout SGLang loads)
    "dflash": f"{BASE} --speculative-algorithm DFLASH --speculative-draft-model-path {EMBEDDED_DRAFTER}",
}
OURS = {"serve": "--device cuda"}
# bench_serving's per-request lists (--output-details): kept in its JSON lines, not in the summary
PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")
# bench_serving's figures a run's summary gives per concurrency (median and spread over the repeats)
SUMMARY = ("output_throughput", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
           "median_e2e_latency_ms", "p99_e2e_latency_ms", "accept_length")


def add_kernel_arguments(ap: argparse.ArgumentParser) -> None:
    """The kernels every SGLang server of a run shares (server_flags)."""
    ap.add_argument("--deterministic", action="store_true",
                    help="every SGLang server with --enable-deterministic-inference (its batch-invariant kernels; "
                         "SPECPILOT's exact verify: its decode rows)")
    ap.add_argument("--attention-backend", default="triton", choices=["triton", "flashinfer"],
                    help="every SGLang server's attention backend (the plugin verifies on either)")


def add_load_arguments(ap: argparse.ArgumentParser, min_prompts: int) -> None:
    """What `bench` reads: the prompts bench_serving makes and how many."""
    ap.add_argument("--dataset-path", required=True,
                    help="a ShareGPT JSON, the text SGLang's random prompts are cut from (it would download one "
                         "otherwise): scripts/export_sharegpt_first_turns.py --first-exchanges, gunzipped")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--min-prompts", type=int, default=min_prompts)


def server_flags(flags: str, args: argparse.Namespace) -> str:
    """An SGLang server's flags on the run's kernels (add_kernel_arguments): every server alike, so AR's decode and
    the verify pass run on the same backend."""
    exact = " --enable-deterministic-inference" if args.deterministic else ""
    return flags.replace(BACKEND, f"--attention-backend {args.attention_backend}") + exact


def launch(model_path: str, flags: str, log: Path, mem_fraction: float = 0.6) -> Server:
    """`sglang.launch_server` on the model with `flags`, on a free port, once it answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--port", str(port),
           "--mem-fraction-static", str(mem_fraction), *shlex.split(flags)]
    return Server(subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT), port, log).ready(600.0)


def greedy_ids(server: Server, new_tokens: int) -> list[list[int]]:
    body = {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    return [a["output_ids"] for a in server.http().post("/generate", json=body).json()]


def bench(server: Server, model_path: str, concurrency: int, args: argparse.Namespace, out_file: Path) -> dict:
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
           "--base-url", f"http://127.0.0.1:{server.port}",
           "--dataset-name", "random", "--dataset-path", args.dataset_path,
           "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--random-range-ratio", "1", "--tokenizer", model_path,
           "--num-prompts", str(max(args.min_prompts, 2 * concurrency)), "--max-concurrency", str(concurrency),
           "--output-file", str(out_file), "--seed", "1", "--disable-tqdm",
           # a first wave at the run's concurrency, not measured: every server meets its batch sizes before the run
           "--warmup-requests", str(concurrency),
           "--output-details"]  # each request's TTFT and token gaps, in the JSON lines only
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = out_file.read_text().splitlines() if out_file.is_file() else []
    figures = json.loads(lines[-1]) if lines and done.returncode == 0 else {}
    return {"concurrency": concurrency, "returncode": done.returncode,
            "sglang": {k: v for k, v in figures.items() if k not in PER_REQUEST},
            "stderr_tail": done.stderr[-1500:] if done.returncode else ""}


def named(given: list[str] | None, default: dict[str, str]) -> dict[str, str]:
    """NAME=FLAGS options as a dict: `default` where none is given, nothing for 'none'; a bare NAME is the default
    server of that name."""
    if given is None:
        return default
    if given == ["none"]:
        return {}
    chosen = {}
    for option in given:
        name, has_flags, flags = option.partition("=")
        if not has_flags and name not in default:
            raise SystemExit(f"--server/--ours {name}: no default server of that name ({', '.join(default)})")
        chosen[name] = flags if has_flags else default[name]
    return chosen


def compare_to_ar(report: dict) -> None:
    """Each server's greedy ids against SGLang AR's, prompt by prompt, once both are known."""
    want = report["servers"].get("ar", {}).get("ids")
    if want is None:
        return
    for entry in report["servers"].values():
        if "ids" in entry:
            entry["identical_to_ar"] = [a == b for a, b in zip(entry["ids"], want)]


def summarize(runs: list[dict]) -> dict[int, dict[str, dict]]:
    """Per concurrency, each reported figure's median and spread over the repeats that ran."""
    by_level: dict[int, list[dict]] = {}
    for run in runs:
        if run["sglang"]:
            by_level.setdefault(run["concurrency"], []).append(run["sglang"])
    summary: dict[int, dict[str, dict]] = {}
    for c, done in sorted(by_level.items()):
        values = {key: [r[key] for r in done if r.get(key) is not None] for key in SUMMARY}
        summary[c] = {key: spread(v) for key, v in values.items() if v}
    return summary


def chart(report: dict, path: Path) -> Path:
    """Output throughput and p99 TPOT by concurrency, a line per server that ran: medians over the repeats, their
    range as error bars."""
    fig, (rate, tail) = plt.subplots(1, 2, figsize=(11, 4))
    levels: set[int] = set()
    for name, entry in report["servers"].items():
        summary = summarize(entry.get("runs", []))
        if summary:
            levels.update(summary)
            for ax, key in ((rate, "output_throughput"), (tail, "p99_tpot_ms")):
                figures = [summary[c][key] for c in summary]
                medians = [f["median"] for f in figures]
                ax.errorbar(list(summary), medians, yerr=[[m - f["min"] for m, f in zip(medians, figures)],
                                                          [f["max"] - m for m, f in zip(medians, figures)]],
                            marker="o", capsize=3, label=name)
    for ax, label in ((rate, "output tok/s"), (tail, "p99 TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(levels), [str(c) for c in sorted(levels)])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.legend()
    rate.set_title("sglang.bench_serving, random 256/256, ignore-EOS")
    return save(fig, path, provenance.label(report["provenance"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True, help="a Hugging Face model directory SGLang loads")
    ap.add_argument("--server", action="append", default=None, metavar="NAME=FLAGS",
                    help="an SGLang server: a name and its launch_server flags, or a default's name alone (default: "
                         "ar, specpilot, ngram, dflash; 'none': no such)")
    ap.add_argument("--ours", action="append", default=None, metavar="NAME=FLAGS",
                    help="a `specpilot serve` server: a name and its flags, or a default's name alone (default: "
                         "serve on CUDA; 'none': no such)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    add_load_arguments(ap, min_prompts=32)
    ap.add_argument("--repeats", type=int, default=3,
                    help="passes over the concurrencies per server, interleaved (C = 1, 8, 32, then again)")
    ap.add_argument("--identity-tokens", type=int, default=128)
    add_kernel_arguments(ap)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    servers = {name: ("sglang", server_flags(flags, args)) for name, flags in named(args.server, SERVERS).items()}
    servers |= {name: ("specpilot", flags) for name, flags in named(args.ours, OURS).items()}
    report: dict = {"provenance": provenance.collect(None, None), "prompts": PROMPTS, "servers": {}}
    for name, (kind, flags) in servers.items():
        log = out / f"{name}.server.log"
        try:
            server = (launch(args.model_path, flags, log) if kind == "sglang"
                      else Server.launch(shlex.split(flags), log).ready(600.0))
        except (RuntimeError, TimeoutError) as err:  # one that cannot start on this model is reported, not fatal
            report["servers"][name] = {"kind": kind, "flags": flags, "error": str(err)[-3000:]}
            print(f"{name}: did not start: {str(err)[-500:]}", flush=True)
            continue
        try:
            entry = report["servers"][name] = {"kind": kind, "flags": flags,
                                               "ids": greedy_ids(server, args.identity_tokens), "runs": []}
            for repeat in range(args.repeats):
                for c in args.concurrency:
                    run = bench(server, args.model_path, c, args, out / f"{name}_c{c}_r{repeat}.jsonl")
                    s = run["sglang"]
                    print(f"{name} C={c} #{repeat}: rc {run['returncode']}, "
                          f"{s.get('output_throughput', float('nan')):.0f} tok/s, TPOT "
                          f"{s.get('mean_tpot_ms', float('nan')):.2f} ms, accept length {s.get('accept_length')}",
                          flush=True)
                    entry["runs"].append(run | {"repeat": repeat})
                    entry["summary"] = summarize(entry["runs"])
                    compare_to_ar(report)
                    (out / "sglang_plugin.json").write_text(json.dumps(report, indent=2))
        finally:
            server.close()
    compare_to_ar(report)
    for name, entry in report["servers"].items():
        if "identical_to_ar" in entry:
            held = "" if entry["kind"] == "sglang" else " (other kernels: reported, not held to it)"
            print(f"{name}: output ids equal SGLang AR's on {sum(entry['identical_to_ar'])} of "
                  f"{len(entry['identical_to_ar'])} prompts{held}")
    for name, entry in report["servers"].items():
        for c, figures in entry.get("summary", {}).items():
            rate = figures["output_throughput"]
            print(f"{name} C={c}: median {rate['median']:.0f} tok/s ({rate['min']:.0f}–{rate['max']:.0f}) over "
                  f"{len(rate['values'])} runs")
    (out / "sglang_plugin.json").write_text(json.dumps(report, indent=2))
    print(f"chart: {chart(report, out / 'sglang_plugin.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
