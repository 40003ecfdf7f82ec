"""`specpilot bench --serving`: load a running server the way `sglang.bench_serving` does.

ShareGPT prompts arrive as a Poisson process (or all at once), each streamed over HTTP; the client
times the first chunk (TTFT), the gaps between chunks (ITL) and the time per output token after the
first (TPOT), and reads the server's mean accept length from /get_server_info at the end.

One Python process parses a few thousand streamed chunks a second, which a fast server outruns (every chunk of
SGLang's /generate carries the text and ids so far), so the load comes from several processes
(`client_processes`; by default one per CHUNK_STREAMS_PER_PROCESS requests in flight): each sends its share of
the prompts at its share of the concurrency and rate, all starting together, and their results are pooled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from specpilot.bench import provenance
from specpilot.bench.datasets import Prompt, load_prompts
from specpilot.bench.output import bench_output_dir

BACKENDS = ("sglang", "sglang-oai-chat")
REQUEST_TIMEOUT_S = 6 * 3600.0  # a benchmark under heavy load may queue requests for a long time
CHUNK_STREAMS_PER_PROCESS = 8  # requests in flight one load process follows (a default of client_processes)


@dataclass
class ServingBenchConfig:
    base_url: str = "http://127.0.0.1:30000"
    backend: str = "sglang"
    num_prompts: int = 20
    max_new_tokens: int = 256
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    max_concurrency: int | None = None
    ignore_eos: bool = True  # fixed output lengths make runs comparable
    seed: int = 0
    dataset: str = "sharegpt"
    client_processes: int | None = None  # load processes; None: one per CHUNK_STREAMS_PER_PROCESS in flight


def client_processes(cfg: ServingBenchConfig) -> int:
    """How many processes send the load: as asked, else enough for the requests in flight within the machine's
    cores (one left for the rest); never more than the requests in flight."""
    in_flight = min(cfg.max_concurrency or cfg.num_prompts, cfg.num_prompts)  # each process keeps one in flight
    if cfg.client_processes is not None:
        return max(1, min(cfg.client_processes, in_flight))
    return max(1, min(math.ceil(in_flight / CHUNK_STREAMS_PER_PROCESS), (os.cpu_count() or 2) - 1))


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between chunks that carried new text

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def _payload(cfg: ServingBenchConfig, prompt: Prompt) -> tuple[str, dict[str, Any]]:
    if cfg.backend == "sglang":
        text = "".join(m["content"] for m in prompt.messages if m["role"] == "user")
        return "/generate", {"text": text, "stream": True, "sampling_params": {
            "max_new_tokens": cfg.max_new_tokens, "temperature": 0.0, "ignore_eos": cfg.ignore_eos}}
    return "/v1/chat/completions", {"messages": prompt.messages, "max_tokens": cfg.max_new_tokens,
                                    "temperature": 0.0, "ignore_eos": cfg.ignore_eos, "stream": True,
                                    "stream_options": {"include_usage": True}}


def _progress(backend: str, chunk: dict[str, Any], result: RequestResult) -> bool:
    """Fold one SSE chunk into `result`; True when it carried new output."""
    if "error" in chunk:
        raise RuntimeError(chunk["error"].get("message", "error event"))
    if backend == "sglang":
        meta = chunk["meta_info"]
        new = meta["completion_tokens"] > result.output_tokens
        result.prompt_tokens, result.output_tokens = meta["prompt_tokens"], meta["completion_tokens"]
        return new
    if chunk.get("usage"):
        result.prompt_tokens = chunk["usage"]["prompt_tokens"]
        result.output_tokens = chunk["usage"]["completion_tokens"]
    return any(c.get("delta", {}).get("content") for c in chunk.get("choices", []))


async def _send(client: httpx.AsyncClient, cfg: ServingBenchConfig, prompt: Prompt) -> RequestResult:
    path, payload = _payload(cfg, prompt)
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", cfg.base_url.rstrip("/") + path, json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if _progress(cfg.backend, json.loads(line[len("data: "):]), result):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        result.error = "" if result.ok else "no output"
    except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


async def _run(cfg: ServingBenchConfig, prompts: list[Prompt]) -> tuple[list[RequestResult], float, float]:
    """(results, monotonic start, monotonic end): one process's load."""
    rng = random.Random(cfg.seed)
    gate = asyncio.Semaphore(cfg.max_concurrency or len(prompts) or 1)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=cfg.max_concurrency or 100)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits, trust_env=False) as client:

        async def one(prompt: Prompt) -> RequestResult:
            async with gate:
                return await _send(client, cfg, prompt)

        start = time.monotonic()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if math.isfinite(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), start, time.monotonic()


def _load_process(cfg: ServingBenchConfig, prompts: list[Prompt], go: Any, out: Any) -> None:
    go.wait()
    out.put(asyncio.run(_run(cfg, prompts)))


def _share(cfg: ServingBenchConfig, i: int, n: int) -> ServingBenchConfig:
    """Process i of n's part of the load: its share of the concurrency (the remainder to the first) and rate."""
    c = cfg.max_concurrency
    return replace(cfg, max_concurrency=None if c is None else c // n + (i < c % n),
                   request_rate=cfg.request_rate / n, seed=cfg.seed + i)


def _run_processes(cfg: ServingBenchConfig, prompts: list[Prompt], n: int) -> tuple[list[RequestResult], float]:
    """(every process's results, the load's wall time: first start to last end)."""
    if n == 1:
        results, start, end = asyncio.run(_run(cfg, prompts))
        return results, end - start
    ctx = multiprocessing.get_context("fork")  # the parent holds no CUDA, threads or event loop here
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_load_process, args=(_share(cfg, i, n), prompts[i::n], go, out), daemon=True)
             for i in range(n)]
    for proc in procs:
        proc.start()
    go.set()
    parts = [out.get() for _ in procs]
    for proc in procs:
        proc.join()
    return [r for results, _, _ in parts for r in results], max(p[2] for p in parts) - min(p[1] for p in parts)


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)

    def pct(q: float) -> float:  # linear interpolation between closest ranks (numpy's default)
        pos = q * (len(ordered) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"mean": 1000 * sum(ordered) / len(ordered), "p50": 1000 * pct(0.5), "p99": 1000 * pct(0.99)}


def summarize(results: list[RequestResult], duration: float, server_info: dict[str, Any]) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    states = server_info.get("internal_states") or [{}]
    return {
        "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "input_throughput": sum(r.prompt_tokens for r in done) / duration,
        "output_throughput": out_tokens / duration,
        "total_output_tokens": out_tokens,
        "concurrency": sum(r.latency for r in done) / duration,
        "ttft_ms": _stats_ms([r.ttft for r in done]),
        "tpot_ms": _stats_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": _stats_ms([gap for r in done for gap in r.itl]),
        "e2e_latency_ms": _stats_ms([r.latency for r in done]),
        "accept_length": states[0].get("avg_spec_accept_length"),
    }


def run_serving_bench(cfg: ServingBenchConfig) -> tuple[dict[str, Any], list[RequestResult]]:
    if cfg.backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}")
    prompts = load_prompts(cfg.dataset, cfg.num_prompts, seed=cfg.seed)
    processes = client_processes(cfg)
    results, duration = _run_processes(cfg, prompts, processes)
    with httpx.Client(timeout=30.0, trust_env=False) as client:
        info = client.get(cfg.base_url.rstrip("/") + "/get_server_info").json()
    # the client's machine and software; the server's own settings and version are in server_info
    report = {"provenance": provenance.collect(None, info.get("dtype")),
              "config": asdict(cfg) | {"request_rate": str(cfg.request_rate), "client_processes": processes},
              "summary": summarize(results, duration, info),
              "requests": [{"ok": r.ok, "error": r.error, "prompt_tokens": r.prompt_tokens,
                            "output_tokens": r.output_tokens, "ttft_s": r.ttft, "latency_s": r.latency}
                           for r in results],
              "server_info": info}
    return report, results


def latency_chart(results: list[RequestResult], title: str, path: Path, footer: str) -> Path:
    """CDFs of TTFT and end-to-end latency, and the histogram of inter-token latencies."""
    from specpilot.bench.charts import plt, save

    done = [r for r in results if r.ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in (("TTFT", [r.ttft for r in done]), ("E2E latency", [r.latency for r in done])):
        ordered = sorted(1000 * v for v in values)
        ax1.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=name)
    ax1.set_xlabel("ms")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title(title)
    ax1.legend()
    ax2.hist([1000 * gap for r in done for gap in r.itl], bins=50)
    ax2.set_xlabel("inter-token latency (ms)")
    ax2.set_ylabel("chunks")
    return save(fig, path, footer)


def _table(summary: dict[str, Any], title: str) -> Any:
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [("successful requests", f"{summary['completed']}"), ("failed requests", f"{summary['failed']}"),
            ("duration (s)", f"{summary['duration_s']:.2f}"),
            ("request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
            ("input throughput (tok/s)", f"{summary['input_throughput']:.1f}"),
            ("output throughput (tok/s)", f"{summary['output_throughput']:.1f}"),
            ("concurrency", f"{summary['concurrency']:.2f}")]
    for key, name in (("e2e_latency_ms", "E2E"), ("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")):
        for stat, value in summary[key].items():
            rows.append((f"{name} {stat} (ms)", "n/a" if value is None else f"{value:.2f}"))
    accept = summary["accept_length"]
    rows.append(("accept length", "n/a" if accept is None else f"{accept:.2f}"))
    for row in rows:
        table.add_row(*row)
    return table


def run_from_args(args: argparse.Namespace) -> int:
    from rich.console import Console

    cfg = ServingBenchConfig(base_url=args.base_url, backend=args.backend, num_prompts=args.num_prompts,
                             max_new_tokens=args.max_new_tokens, request_rate=args.request_rate,
                             max_concurrency=args.max_concurrency, ignore_eos=not args.disable_ignore_eos,
                             seed=args.seed, client_processes=args.client_processes)
    try:
        report, results = run_serving_bench(cfg)
    except httpx.ConnectError as err:
        raise ValueError(f"--base-url {cfg.base_url}: no server answers ({err}); start one with specpilot serve") \
            from err
    out = bench_output_dir(args.output_dir)
    name = f"serving_{cfg.backend}"
    title = f"specpilot bench --serving ({cfg.backend}, rate {cfg.request_rate}, {cfg.num_prompts} prompts)"
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    latency_chart(results, title, out / f"{name}.png", provenance.label(report["provenance"]))
    Console().print(_table(report["summary"], title))
    print(f"results in {out}/: {name}.json, {name}.png")
    return 0 if report["summary"]["completed"] else 1
