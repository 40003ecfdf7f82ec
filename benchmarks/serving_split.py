"""What serving costs against the same engine offline, with the engine in its own process and in the HTTP
server's: the engine decodes N prompts at batch C offline (`Engine.generate`), then `specpilot serve` (each mode
in turn, interleaved over repeats) is loaded by `specpilot bench --serving --max-concurrency C` with the same
count of prompts and tokens. Reports output tok/s (median and range) and served / offline.

    python benchmarks/serving_split.py [--tiny] [--model-path P] [--device cpu] [--concurrency 32]
        [--num-prompts 128] [--max-new-tokens 200] [--repeats 2] [--out DIR]

`--tiny`: a tiny random Llama (the tests' model) whose steps take about as long as the embedded model's on an
H200, so a CPU shows what the server's host work costs a fast engine.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import out_dir, write_json  # noqa: E402

from specpilot.bench.datasets import apply_chat_template, load_prompts  # noqa: E402
from specpilot.bench.harness import spread  # noqa: E402
from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402

PORT = 30171


def _offline(args: argparse.Namespace) -> float:
    engine = Engine.from_config(EngineConfig(model_path=args.model_path, device=args.device,
                                             max_running_requests=args.concurrency, context_length=args.context))
    prompts = [apply_chat_template(engine.tokenizer, p) for p in load_prompts("sharegpt", args.num_prompts)]
    # the server refuses (400) a prompt that leaves no room for the new tokens: leave those out here too
    prompts = [p for p in prompts if len(p) + args.max_new_tokens <= engine.context_length]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=8, ignore_eos=True))
    start = time.perf_counter()
    reqs = engine.generate(prompts, params)
    return sum(len(r.output_ids) for r in reqs) / (time.perf_counter() - start)


def _cpu_seconds(proc: psutil.Process | None) -> float:
    if proc is None:
        return 0.0
    times = proc.cpu_times()
    return times.user + times.system


def _served(args: argparse.Namespace, single: bool, work: Path) -> tuple[float, dict[str, float]]:
    """(output tok/s, each process's CPU seconds over the load's wall seconds)."""
    flags = (["--model-path", args.model_path] if args.model_path else []) + [
        "--device", args.device, "--max-running-requests", str(args.concurrency), "--context-length", str(args.context),
        "--port", str(PORT)] + (["--single-process"] if single else [])
    server = subprocess.Popen([sys.executable, "-m", "specpilot", "serve", *flags], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{PORT}"
        for _ in range(600):
            if subprocess.run(["curl", "-sf", f"{url}/health"], capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
        http = psutil.Process(server.pid)
        # the engine process: multiprocessing's spawned child (its resource tracker is the other one)
        engine = next((c for c in http.children() if "spawn_main" in " ".join(c.cmdline())), None)
        before = {"http": _cpu_seconds(http), "engine": _cpu_seconds(engine),
                  "client": resource.getrusage(resource.RUSAGE_CHILDREN)}
        start = time.perf_counter()
        out = work / ("single" if single else "split")
        subprocess.run([sys.executable, "-m", "specpilot", "bench", "--serving", "--base-url", url, "--num-prompts",
                        str(args.num_prompts), "--max-concurrency", str(args.concurrency), "--max-new-tokens",
                        str(args.max_new_tokens), "--output-dir", str(out)], check=True, capture_output=True)
        wall = time.perf_counter() - start
        client = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = {"http": (_cpu_seconds(http) - before["http"]) / wall,
               "engine": (_cpu_seconds(engine) - before["engine"]) / wall if engine is not None else None,
               # the load generator, and the curl probes before it (a few ms)
               "client": (client.ru_utime + client.ru_stime - before["client"].ru_utime - before["client"].ru_stime)
               / wall}
        summary = json.loads((out / "serving_sglang.json").read_text())["summary"]
        return summary["output_throughput"], cpu
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="serving-split-"))
    if args.tiny:
        from tiny_models import make_tiny_model_dir

        args.model_path = str(make_tiny_model_dir(work / "tiny"))
    rates: dict[str, list[float]] = {"offline": [], "split": [], "single": []}
    cpu: dict[str, list[dict[str, float]]] = {"split": [], "single": []}
    for r in range(args.repeats):
        rates["offline"].append(_offline(args))
        for single in (False, True):
            mode = "single" if single else "split"
            rate, shares = _served(args, single, work)
            rates[mode].append(rate)
            cpu[mode].append(shares)
        print(f"repeat {r + 1}: " + ", ".join(f"{m} {v[-1]:.0f} tok/s" for m, v in rates.items()) + "; CPU over wall: "
              + "; ".join(f"{m} " + ", ".join(f"{k} {v:.2f}" for k, v in c[-1].items() if v is not None)
                          for m, c in cpu.items()), flush=True)
    med = {m: statistics.median(v) for m, v in rates.items()}
    result = {"provenance": collect(None, None), "command": " ".join(sys.argv), "model": args.model_path or "embedded",
              "concurrency": args.concurrency, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
              "tok_s": {m: spread(v) for m, v in rates.items()},
              "served_over_offline": {m: med[m] / med["offline"] for m in ("split", "single")},
              "cpu_over_wall": cpu}
    write_json(out_dir(args.out) / "serving_split.json", result)
    print(f"tok/s median: offline {med['offline']:.0f}; served, engine process {med['split']:.0f} "
          f"({med['split'] / med['offline']:.2f}x offline); served, one process {med['single']:.0f} "
          f"({med['single'] / med['offline']:.2f}x)")


if __name__ == "__main__":
    main()
