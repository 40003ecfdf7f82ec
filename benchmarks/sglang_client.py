"""SGLang's own load generator, `python -m sglang.bench_serving`, against `specpilot serve`: per server setting
(speculative and AR, each a list of serve flags) and per concurrency, after a warm-up load that is not
reported, ShareGPT prompts with a fixed output length (ignore-EOS, SGLang's default), while /get_server_info's KV pool is polled for the most requests running
at once. SGLang's JSON lines (throughput, TPOT, TTFT, accept length) and ours (the most running at once, the
scheduler's time in prefill steps, decode steps and publishing during the run) go to `--out`.

Needs the sglang package and its client's imports (on the H200: `.ferry/sgl`, see benchmarks/gpu_bench_serving.sh)
and a ShareGPT file SGLang reads (`scripts/export_sharegpt_first_turns.py --first-exchanges`, gunzipped).

    python benchmarks/sglang_client.py --dataset-path sharegpt.json --concurrency 32 64 128 256 --out DIR \
        --server spec="--device cuda --max-running-requests 256 --max-total-tokens 131584" \
        --server ar="--device cuda --speculative-algorithm none --max-running-requests 256 --max-total-tokens 131584"
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from specpilot.bench import provenance
from specpilot.models.checkpoint import embedded_default_path
from specpilot.models.gguf_loader import tokenizer_cache_dir
from specpilot.optimizer.remote import Server


def poll_running(server: Server, stop: threading.Event, seen: dict) -> None:
    """The most requests running at once and the fewest free pages, every 50 ms until `stop`."""
    while not stop.is_set():
        try:
            pool = server.http().get("/get_server_info", timeout=5.0).json()["kv_pool"]
        except Exception:  # a busy server may miss a poll; the run's own numbers are SGLang's
            time.sleep(0.05)
            continue
        seen["most_running_at_once"] = max(seen["most_running_at_once"], pool["num_slots"] - pool["free_slots"])
        seen["fewest_free_pages"] = min(seen["fewest_free_pages"], pool["free_pages"])
        time.sleep(0.05)


def step_time(server: Server) -> dict[str, dict[str, float]]:
    """The server's scheduler time by what it did (prefill and decode steps, publishing), since it started."""
    return server.http().get("/get_server_info", timeout=30.0).json()["internal_states"][0]["step_time"]


def bench(server: Server, args: argparse.Namespace, concurrency: int, out_file: Path,
          prompts: int | None = None) -> dict:
    prompts = prompts or max(args.min_prompts, args.waves * concurrency)
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
           "--base-url", f"http://127.0.0.1:{server.port}", "--dataset-name", "sharegpt",
           "--dataset-path", args.dataset_path, "--sharegpt-output-len", str(args.output_len),
           "--sharegpt-context-len", str(args.context_len), "--tokenizer", args.tokenizer,
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--output-file", str(out_file),
           "--seed", "1", "--disable-tqdm"]
    clock_before = step_time(server)
    seen = {"most_running_at_once": 0, "fewest_free_pages": 1 << 60}
    stop = threading.Event()
    poller = threading.Thread(target=poll_running, args=(server, stop, seen), daemon=True)
    poller.start()
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    stop.set()
    poller.join()
    clock = {k: {"count": v["count"] - clock_before[k]["count"], "seconds": v["seconds"] - clock_before[k]["seconds"]}
             for k, v in step_time(server).items()}
    lines = out_file.read_text().splitlines() if out_file.is_file() else []
    sglang = json.loads(lines[-1]) if lines and done.returncode == 0 else {}
    return {"concurrency": concurrency, "num_prompts": prompts, "returncode": done.returncode, "wall_s": wall,
            "stdout_tail": done.stdout[-1500:], "stderr_tail": done.stderr[-1500:] if done.returncode else "",
            "sglang": sglang, "scheduler_time": clock, **seen}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset-path", required=True, help="a ShareGPT JSON SGLang's loader reads")
    ap.add_argument("--server", action="append", required=True, metavar="NAME=FLAGS",
                    help="a server setting: a name and its serve flags (repeatable)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--context-len", type=int, default=4096, help="SGLang keeps prompts that fit with the output")
    ap.add_argument("--waves", type=int, default=2, help="prompts per run: this many times the concurrency")
    ap.add_argument("--min-prompts", type=int, default=128)
    ap.add_argument("--tokenizer", default=None, help="default: the embedded model's cached tokenizer")
    ap.add_argument("--warmup-prompts", type=int, default=64,
                    help="a first load, not reported, at the largest concurrency (compiles, graphs and pools settle)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.tokenizer = args.tokenizer or str(tokenizer_cache_dir(embedded_default_path()))
    report: dict = {"provenance": provenance.collect(None, None), "client": "sglang.bench_serving",
                    "output_len": args.output_len, "servers": {}}
    for spec in args.server:
        name, _, flags = spec.partition("=")
        server = Server.launch(shlex.split(flags), out / f"{name}.server.log").ready()
        try:
            info = server.http().get("/get_server_info").json()
            runs: list[dict] = []
            report["servers"][name] = {"flags": flags, "kv_pool": info["kv_pool"], "speed": info["speed"], "runs": runs}
            if args.warmup_prompts:
                bench(server, args, max(args.concurrency), out / f"{name}_warmup.jsonl", args.warmup_prompts)
            for c in args.concurrency:
                r = bench(server, args, c, out / f"{name}_c{c}.jsonl")
                s = r["sglang"]
                t = r["scheduler_time"]
                print(f"{name} C={c}: rc {r['returncode']}, {s.get('completed')}/{r['num_prompts']} completed, "
                      f"{s.get('output_throughput', float('nan')):.0f} tok/s, TPOT {s.get('mean_tpot_ms', float('nan')):.1f} ms, "
                      f"accept length {s.get('accept_length')}, {r['most_running_at_once']} running at once; scheduler: "
                      + ", ".join(f"{k} {v['count']} x {1e3 * v['seconds'] / max(v['count'], 1):.2f} ms"
                                  for k, v in t.items()), flush=True)
                runs.append(r)
                (out / "sglang_client.json").write_text(json.dumps(report, indent=2))  # kept if a later run is cut
        finally:
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
