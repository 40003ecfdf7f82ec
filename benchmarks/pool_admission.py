"""How many requests a KV pool runs at once, and at what memory and throughput: starts `specpilot serve` (flags
after `--`), reads its idle resident memory, then per concurrency sends that many ShareGPT prompts at once
(each `--max-new-tokens`, ignore_eos) and polls /get_server_info's kv_pool while they run: the most requests
running together, the fewest free pages, every status code, output tokens per second, the peak RSS.

    python benchmarks/pool_admission.py --concurrency 64 --max-new-tokens 32 --out DIR [-- SERVE FLAGS...]
    (H200) python benchmarks/pool_admission.py --concurrency 32 64 128 256 --max-new-tokens 256 --out DIR \
        -- --device cuda --max-running-requests 256 --max-total-tokens 131584
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from specpilot.bench import provenance
from specpilot.bench.datasets import load_prompts
from specpilot.optimizer.remote import REQUEST_TIMEOUT_S, Server


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def burst(port: int, pid: int, texts: list[str], max_new_tokens: int) -> dict:
    """Every text at once; the pool polled every 50 ms until the last answer."""
    base = f"http://127.0.0.1:{port}"
    limits = httpx.Limits(max_connections=len(texts) + 4)
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        done = asyncio.Event()
        seen = {"running": 0, "min_free_pages": None, "peak_rss_mb": rss_mb(pid)}

        async def poll() -> None:
            while not done.is_set():
                pool = (await client.get("/get_server_info")).json()["kv_pool"]
                seen["running"] = max(seen["running"], pool["num_slots"] - pool["free_slots"])
                free = pool["free_pages"]
                seen["min_free_pages"] = free if seen["min_free_pages"] is None else min(seen["min_free_pages"], free)
                seen["peak_rss_mb"] = max(seen["peak_rss_mb"], rss_mb(pid))
                await asyncio.sleep(0.05)

        async def one(text: str) -> tuple[int, int]:
            body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
            response = await client.post("/generate", json=body)
            tokens = len(response.json().get("output_ids", [])) if response.status_code == 200 else 0
            return response.status_code, tokens

        poller = asyncio.create_task(poll())
        start = time.perf_counter()
        results = await asyncio.gather(*(one(t) for t in texts))
        wall = time.perf_counter() - start
        done.set()
        await poller
    tokens = sum(n for _, n in results)
    return {"requests": len(texts), "status": dict(Counter(code for code, _ in results)), "wall_s": wall,
            "output_tokens": tokens, "output_tok_per_s": tokens / wall, "most_running_at_once": seen["running"],
            "fewest_free_pages": seen["min_free_pages"], "peak_rss_mb": seen["peak_rss_mb"]}


def main() -> int:
    argv = sys.argv[1:]
    serve_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(args.dataset, max(args.concurrency))
    texts = ["".join(m["content"] for m in p.messages if m["role"] == "user") for p in prompts]
    server = Server.launch(serve_flags, out / "server.log").ready()
    try:
        time.sleep(2.0)  # start-up's transient allocations settle
        idle = rss_mb(server.proc.pid)
        info = server.http().get("/get_server_info").json()
        runs = {}
        for c in args.concurrency:
            runs[str(c)] = asyncio.run(burst(server.port, server.proc.pid, texts[:c], args.max_new_tokens))
            r = runs[str(c)]
            print(f"C={c}: status {r['status']}, {r['most_running_at_once']} running at once, "
                  f"{r['output_tok_per_s']:.0f} tok/s, fewest free pages {r['fewest_free_pages']}, "
                  f"peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
    finally:
        server.close()
    report = {"provenance": provenance.collect(None, None), "serve_flags": serve_flags, "dataset": args.dataset,
              "max_new_tokens": args.max_new_tokens, "idle_rss_mb": idle, "kv_cache": info["kv_cache"],
              "kv_pool": info["kv_pool"], "runs": runs}
    (out / "pool_admission.json").write_text(json.dumps(report, indent=2))
    print(f"idle RSS {idle:.0f} MB; pool {info['kv_pool']['pool_tokens']} positions in "
          f"{info['kv_pool']['num_pages']} pages for {info['kv_pool']['num_slots']} slots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
