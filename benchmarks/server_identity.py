"""AR against speculative decoding through the HTTP server: the same prompts, sent as concurrent streams to
a `specpilot serve` without a drafter and then to one with a drafter (the served configuration unless
flags after `--` say otherwise), each request with its own seed (base + its index) so sampled runs compare
too. Reports per dataset how many requests' output token ids are identical, and writes JSON with the
provenance.

    python benchmarks/server_identity.py --dataset humaneval mtbench sharegpt math --num-prompts 32 \
        --max-new-tokens 256 --concurrency 32 [--temperature 0.8 --top-p 0.95] [-- SERVE FLAGS...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx

from specpilot.bench import provenance
from specpilot.bench.datasets import BENCH_DATASETS, load_prompts
from specpilot.optimizer.remote import REQUEST_TIMEOUT_S, Server


async def generate_all(port: int, texts: list[str], sampling: dict, seed: int, concurrency: int) -> list[list[int]]:
    """Every text through /generate, `concurrency` at a time; request i samples with seed + i."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=REQUEST_TIMEOUT_S) as client:
        async def one(i: int, text: str) -> list[int]:
            async with gate:
                body = {"text": text, "sampling_params": sampling | {"seed": seed + i}}
                response = await client.post("/generate", json=body)
                response.raise_for_status()
                return response.json()["output_ids"]

        return await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))


def run_mode(flags: list[str], prompts: dict[str, list[str]], sampling: dict, seed: int, concurrency: int,
             log: Path) -> dict[str, list[list[int]]]:
    server = Server.launch(flags, log).ready()
    try:
        return {name: asyncio.run(generate_all(server.port, texts, sampling, seed, concurrency))
                for name, texts in prompts.items()}
    finally:
        server.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, serve = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", nargs="+", default=list(BENCH_DATASETS), choices=BENCH_DATASETS)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1, help="request i samples with seed S + i in both runs")
    ap.add_argument("--speculative-algorithm", default="dflash")
    ap.add_argument("--out", default="server_identity", help="folder for the JSON and the servers' logs")
    args = ap.parse_args(own)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = {d: ["".join(m["content"] for m in p.messages if m["role"] == "user")
                   for p in load_prompts(d, args.num_prompts)] for d in args.dataset}
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "ignore_eos": True}
    common = ["--max-running-requests", str(args.concurrency), *serve]
    ar = run_mode([*common, "--speculative-algorithm", "none"], prompts, sampling, args.seed, args.concurrency,
                  out / "server_ar.log")
    spec = run_mode([*common, "--speculative-algorithm", args.speculative_algorithm], prompts, sampling,
                    args.seed, args.concurrency, out / "server_spec.log")
    results = {d: {"requests": len(ar[d]), "identical": sum(a == s for a, s in zip(ar[d], spec[d]))}
               for d in args.dataset}
    report = {"provenance": provenance.collect(None, None), "concurrency": args.concurrency, "sampling": sampling,
              "seed": args.seed, "serve_flags": serve, "speculative_algorithm": args.speculative_algorithm,
              "results": results}
    (out / "server_identity.json").write_text(json.dumps(report, indent=2))
    for d, r in results.items():
        print(f"{d}: {r['identical']}/{r['requests']} outputs identical to AR's")
    return 0 if all(r["identical"] == r["requests"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
