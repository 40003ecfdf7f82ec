"""Load test of a running `specpilot serve` (loopback only).

N concurrent clients loop for S seconds over a mix of requests: greedy /generate (plain and streamed)
whose outputs must equal a solo run of the same request, sampled OpenAI chat/completions, clients that
hang up mid-stream, and malformed requests that must get a 400. Reports the status counts (no 5xx
expected: every request either completes or gets a 503), output mismatches, the server's RSS before
and after (pass its --pid), and whether the server ends idle with no leftover requests.

    python scripts/load_test.py --clients 32 --duration 60 --pid $(pgrep -f 'specpilot serve')
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import psutil

from specpilot.bench.datasets import load_prompts

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
REQUEST_TIMEOUT_S = 120.0
MAX_BACKOFF_S = 1.0


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)  # HTTP status (or exception name) per request
    kinds: Counter = field(default_factory=Counter)
    mismatches: list[str] = field(default_factory=list)
    incomplete: int = 0  # 200 streams that ended without [DONE]
    hung_up: int = 0  # streams this client closed on purpose after two chunks

    @property
    def unexpected(self) -> int:
        return sum(n for s, n in self.statuses.items() if s not in (200, 400, 503))


def greedy_body(prompt: str, max_new_tokens: int) -> dict:
    return {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}


async def stream_lines(client: httpx.AsyncClient, path: str, body: dict, tally: Tally,
                       hang_up_after: int | None = None) -> tuple[int, list[dict] | None]:
    """(status, decoded SSE chunks); the chunks are None unless it was a complete 200 stream."""
    async with client.stream("POST", path, json=body) as response:
        tally.statuses[response.status_code] += 1
        if response.status_code != 200:
            await response.aread()
            return response.status_code, None
        chunks, done = [], False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
                if hang_up_after is not None and len(chunks) >= hang_up_after:
                    tally.hung_up += 1
                    return 200, None  # leaving the block closes the connection mid-stream
        if not done or not chunks:
            tally.incomplete += 1
            return 200, None
        return 200, chunks


async def one_request(client: httpx.AsyncClient, rng: random.Random, prompts: list[str],
                      reference: list[list[int]], args: argparse.Namespace, tally: Tally) -> int:
    """One request of a random kind; returns its HTTP status."""
    kind = rng.choice(["greedy", "greedy-stream", "chat-stream", "completion", "hang-up", "bad"])
    tally.kinds[kind] += 1
    i = rng.randrange(len(prompts))
    n = args.max_new_tokens
    if kind == "greedy":
        response = await client.post("/generate", json=greedy_body(prompts[i], n))
        tally.statuses[response.status_code] += 1
        if response.status_code == 200 and response.json()["output_ids"] != reference[i]:
            tally.mismatches.append(f"greedy prompt {i}")
        return response.status_code
    if kind == "greedy-stream":
        status, chunks = await stream_lines(client, "/generate", greedy_body(prompts[i], n) | {"stream": True},
                                            tally)
        if chunks is not None and chunks[-1]["output_ids"] != reference[i]:
            tally.mismatches.append(f"greedy stream prompt {i}")
        return status
    if kind == "chat-stream":
        body = {"messages": [{"role": "user", "content": prompts[i]}], "max_tokens": n, "temperature": 0.8,
                "seed": rng.randrange(2**31), "stream": True}
        status, _ = await stream_lines(client, "/v1/chat/completions", body, tally)
        return status
    if kind == "completion":
        body = {"prompt": prompts[i], "max_tokens": n, "temperature": 0.7, "top_p": 0.9}
        response = await client.post("/v1/completions", json=body)
        tally.statuses[response.status_code] += 1
        return response.status_code
    if kind == "hang-up":
        body = greedy_body(prompts[i], 4 * n) | {"stream": True}
        status, _ = await stream_lines(client, "/generate", body, tally, hang_up_after=2)
        return status
    bad = rng.choice([{"text": 5}, {"text": "x", "sampling_params": {"top_p": 0}}, {"input_ids": [-1]}])
    response = await client.post("/generate", json=bad)
    tally.statuses[response.status_code] += 1
    return response.status_code


async def client_loop(base_url: str, seed: int, deadline: float, prompts: list[str], reference: list[list[int]],
                      args: argparse.Namespace, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                status = await one_request(client, rng, prompts, reference, args, tally)
            except httpx.HTTPError as err:
                tally.statuses[type(err).__name__] += 1
                continue
            if status == 503:  # back off as Retry-After asks, bounded so the loop stays responsive
                await asyncio.sleep(min(MAX_BACKOFF_S, rng.uniform(0.1, 1.0)))


def rss_mib(proc: psutil.Process | None) -> float | None:
    return None if proc is None else proc.memory_info().rss / 2**20


async def main_async(args: argparse.Namespace) -> int:
    prompts = [p.messages[0]["content"][: args.prompt_chars] for p in load_prompts("sharegpt", args.num_prompts)]
    proc = psutil.Process(args.pid) if args.pid else None
    async with httpx.AsyncClient(base_url=args.base_url, timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        # solo runs: the server is otherwise idle, so these are the unbatched reference outputs
        reference = []
        for prompt in prompts:
            response = await client.post("/generate", json=greedy_body(prompt, args.max_new_tokens))
            response.raise_for_status()
            reference.append(response.json()["output_ids"])
        rss_before = rss_mib(proc)
        tally = Tally()
        peak = rss_before
        start = time.monotonic()
        deadline = start + args.duration
        loops = [asyncio.create_task(client_loop(args.base_url, args.seed + c, deadline, prompts, reference, args,
                                                 tally)) for c in range(args.clients)]
        while not all(t.done() for t in loops):
            await asyncio.sleep(1.0)
            if proc is not None:
                peak = max(peak, rss_mib(proc))
        await asyncio.gather(*loops)
        elapsed = time.monotonic() - start
        # the server must settle: nothing running or waiting, no leftover rids
        settle = time.monotonic() + 30
        while (info := (await client.get("/get_server_info")).json())["rids"] and time.monotonic() < settle:
            await asyncio.sleep(0.2)
    rss_after = rss_mib(proc)
    report = {
        "clients": args.clients, "duration_s": round(elapsed, 1),
        "requests": sum(tally.kinds.values()), "requests_per_s": round(sum(tally.kinds.values()) / elapsed, 2),
        "kinds": dict(tally.kinds), "statuses": {str(k): v for k, v in tally.statuses.items()},
        "unexpected_statuses": tally.unexpected, "incomplete_streams": tally.incomplete,
        "hung_up_on_purpose": tally.hung_up,
        "greedy_mismatches": len(tally.mismatches), "mismatch_examples": tally.mismatches[:5],
        "server_idle_after": not info["rids"] and info["running_requests"] == 0 and info["waiting_requests"] == 0,
        "rss_mib": {"before": rss_before, "peak": peak, "after": rss_after},
        "server": {"avg_spec_accept_length": info["internal_states"][0]["avg_spec_accept_length"],
                   "last_gen_throughput": info["internal_states"][0]["last_gen_throughput"]},
    }
    print(json.dumps(report, indent=2))
    ok = not tally.unexpected and not tally.incomplete and not tally.mismatches and report["server_idle_after"]
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--pid", type=int, default=None, help="server process id, for its RSS")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=8, help="distinct ShareGPT prompts")
    p.add_argument("--prompt-chars", type=int, default=400, help="prompts are cut to this many characters")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if urlparse(args.base_url).hostname not in LOOPBACK:
        p.error(f"--base-url must be a loopback address ({', '.join(sorted(LOOPBACK))})")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
