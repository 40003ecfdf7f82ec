"""Where a step's time goes inside SGLang: SPECPILOT's worker against SGLang AR, under bench_serving load, from
SGLang's own torch profiler (inside `benchmarks/sglang_ferry.sh run`, after `install`).

Each server starts alone; a warm-up wave at the concurrency, then `/start_profile` (CPU and GPU activities, Python
stacks) for --steps scheduler steps while `sglang.bench_serving` keeps C requests in flight. The trace is read back
into: the window's GPU-busy share (the union of kernel, copy and set intervals), kernel and graph launches per step,
and the Python functions with the most inclusive time (SPECPILOT's own, `specpilot/`, all listed) per step. The
profiler's Python tracing slows the host: read the figures against each other (AR's beside SPECPILOT's), not as
served speed, which the same run's bench_serving line gives.

    python benchmarks/sglang_plugin_profile.py --model-path /tmp/smollm2 --dataset-path sharegpt.json \
        --concurrency 1 32 --steps 60 --out DIR [--deterministic] [--attention-backend flashinfer] [--server NAME ...]

Servers: the names of benchmarks/sglang_plugin_serving.py's SGLang servers (default: ar, specpilot). DIR gets each
trace, each server's log and DIR/sglang_profile.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from sglang_plugin_serving import SERVERS, add_kernel_arguments, add_load_arguments, bench, launch, server_flags

from specpilot.bench import provenance
from specpilot.optimizer.remote import Server

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
OURS = "specpilot/"
STEP = "forward_batch_generation"  # a scheduler step: the worker's and the target worker's


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summarize_trace(path: Path, top: int = 25) -> dict:
    """A chrome trace of torch's profiler (gzipped or not) as the figures this script reports."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    if not events:
        raise ValueError(f"{path}: no complete events")
    start = min(e["ts"] for e in events)
    window = max(e["ts"] + e["dur"] for e in events) - start
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_WORK]
    python: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function":
            python[e["name"]].append(e["dur"])
    step_functions = [name for name in python if name.endswith(STEP)]
    steps = max((len(python[name]) for name in step_functions), default=0)
    per = max(steps, 1)
    ranked = sorted(python, key=lambda name: -sum(python[name]))
    # ours and the step's own frames always; the rest as far as they rank
    names = dict.fromkeys([n for n in ranked if OURS in n or n in step_functions] + ranked[:top])
    chosen = [(name, python[name]) for name in names]
    return {
        "trace": path.name, "window_ms": window / 1e3, "steps": steps,
        "gpu_busy_ms": busy_us(gpu) / 1e3, "gpu_busy_share": busy_us(gpu) / window if window else 0.0,
        "kernels": len([e for e in events if e.get("cat") == "kernel"]),
        "kernel_launches_per_step": sum(e.get("name") in LAUNCHES for e in events) / per,
        "graph_launches_per_step": sum(e.get("name") == "cudaGraphLaunch" for e in events) / per,
        "python_ms_per_step": {name: sum(d) / 1e3 / per for name, d in sorted(chosen, key=lambda kv: -sum(kv[1]))},
        "python_calls_per_step": {name: len(d) / per for name, d in chosen},
    }


def newest_trace(directory: Path, after: float, timeout_s: float) -> Path:
    """The trace SGLang writes once the profiled steps are done (its size steady for a second)."""
    deadline, last = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline:
        found = [p for p in directory.glob("**/*.json.gz") if p.stat().st_mtime >= after]
        if found:
            path = max(found, key=lambda p: p.stat().st_mtime)
            size = path.stat().st_size
            if size == last:
                return path
            last = size
        time.sleep(1.0)
    raise TimeoutError(f"no trace in {directory} within {timeout_s:.0f} s")


def profile_run(server: Server, name: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict:
    traces = out / f"{name}_c{concurrency}"
    traces.mkdir(parents=True, exist_ok=True)
    bench(server, args.model_path, concurrency, args, traces / "warmup.jsonl")  # every batch size met first
    began = time.time()
    body = {"output_dir": str(traces), "num_steps": args.steps, "activities": ["CPU", "GPU"], "with_stack": True,
            "profile_prefix": f"{name}_c{concurrency}"}
    # with num_steps SGLang stops by itself; the request may only answer once it has
    starter = threading.Thread(target=lambda: server.http().post("/start_profile", json=body, timeout=600.0))
    starter.start()
    run = bench(server, args.model_path, concurrency, args, traces / "profiled.jsonl")
    starter.join(timeout=120.0)
    summary = summarize_trace(newest_trace(traces, began, 180.0))
    served = run["sglang"]
    summary |= {"output_throughput": served.get("output_throughput"), "accept_length": served.get("accept_length"),
                "median_tpot_ms": served.get("median_tpot_ms")}
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--server", action="append", choices=sorted(SERVERS), default=None,
                    help="an SGLang server of sglang_plugin_serving.py (default: ar and specpilot)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=60, help="scheduler steps profiled per run")
    add_load_arguments(ap, min_prompts=16)
    add_kernel_arguments(ap)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"provenance": provenance.collect(None, None), "runs": {}}
    for name in args.server or ["ar", "specpilot"]:
        server = launch(args.model_path, server_flags(SERVERS[name], args), out / f"{name}.server.log")
        try:
            for c in args.concurrency:
                try:
                    s = report["runs"][f"{name}_c{c}"] = profile_run(server, name, c, args, out)
                except (TimeoutError, ValueError) as err:  # one run without a trace is reported, not fatal
                    report["runs"][f"{name}_c{c}"] = {"error": str(err)}
                    print(f"{name} C={c}: {err}", flush=True)
                    continue
                print(f"{name} C={c}: {s['steps']} steps in {s['window_ms']:.0f} ms, GPU busy "
                      f"{100 * s['gpu_busy_share']:.0f}%, {s['kernel_launches_per_step']:.0f} kernel and "
                      f"{s['graph_launches_per_step']:.1f} graph launches a step", flush=True)
                for fn, ms in list(s["python_ms_per_step"].items())[:12]:
                    print(f"    {ms:8.3f} ms/step  {fn}", flush=True)
                (out / "sglang_profile.json").write_text(json.dumps(report, indent=2))
        finally:
            server.close()
    (out / "sglang_profile.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
