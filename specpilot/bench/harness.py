"""`specpilot bench`: speculative decoding against AR on the same engine, per dataset, in interleaved
repeats (AR, speculative, AR, speculative, ...) so that drift of the machine hits both sides alike."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field, replace
from itertools import zip_longest
from typing import Any

from rich.progress import Progress, TaskID

from specpilot.bench.datasets import apply_chat_template, load_prompts
from specpilot.config import SamplingParams
from specpilot.engine.engine import Engine
from specpilot.state.request import Request


@dataclass
class RunResult:
    tpot_ms: float  # mean over requests of (e2e - first token) / (completion - 1)
    tokens_per_s: float
    completion_tokens: int
    wall_s: float
    # the share of the run's request slots (batch size x wall) spent decoding (first token to last): prefills,
    # and in waves the tail of a batch, whose finished requests wait for its longest, make the rest. Throughput
    # speedup = TPOT speedup x (spec occupancy / AR occupancy), about: where the two differ, this says why
    occupancy: float = 1.0


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def median_of(values: list[Any]) -> Any:
    """The median of each number across repeats: per key of dicts, per position of lists (a missing
    position counts as 0: an empty histogram has no passes)."""
    first = values[0]
    if isinstance(first, dict):
        return {k: median_of([v[k] for v in values]) for k in first}
    if isinstance(first, list):
        return [median_of(list(column)) for column in zip_longest(*values, fillvalue=0)]
    return statistics.median(values)


@dataclass
class DatasetResult:
    dataset: str
    num_prompts: int
    ar: list[RunResult] = field(default_factory=list)  # one per repeat
    spec: list[RunResult] = field(default_factory=list)  # one per repeat; empty without a drafter
    spec_stats: list[dict] = field(default_factory=list)  # one per repeat
    # per repeat after the first AR one: how many requests produced exactly the first AR repeat's token ids
    ar_identical: list[int] = field(default_factory=list)
    spec_identical: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The headline numbers (`ar`, `spec`, `speedup`, `tau` and the other statistics) are medians over
        the repeats; `spread` has their range and values, `repeats` each repeat's raw numbers."""
        ar = [vars(r) for r in self.ar]
        spec = [vars(r) for r in self.spec]
        spreads = {"ar_tpot_ms": spread([r["tpot_ms"] for r in ar])}
        repeats = [{"ar": r} for r in ar]
        out: dict[str, Any] = {"dataset": self.dataset, "num_prompts": self.num_prompts, "ar": median_of(ar),
                               "spec": None, "speedup": None,
                               "identical_ids": {"ar_repeats": self.ar_identical, "spec_repeats": self.spec_identical,
                                                 "all": all(n == self.num_prompts for n in
                                                            self.ar_identical + self.spec_identical)}}
        if spec:
            speedups = [a["tpot_ms"] / s["tpot_ms"] for a, s in zip(ar, spec)]
            throughput = [s["tokens_per_s"] / a["tokens_per_s"] for a, s in zip(ar, spec)]
            spreads |= {"spec_tpot_ms": spread([s["tpot_ms"] for s in spec]), "speedup": spread(speedups),
                        "throughput_speedup": spread(throughput), "tau": spread([s["tau"] for s in self.spec_stats])}
            repeats = [r | {"spec": s, "speedup": x, "throughput_speedup": t, **stats}
                       for r, s, x, t, stats in zip(repeats, spec, speedups, throughput, self.spec_stats)]
            out |= {"spec": median_of(spec), "speedup": statistics.median(speedups),
                    "throughput_speedup": statistics.median(throughput), **median_of(self.spec_stats)}
        return out | {"spread": spreads, "repeats": repeats}


def tpot_ms(reqs: list[Request]) -> float:
    """Mean over requests of (e2e - first token) / (completion - 1), in ms; NaN when none has two tokens."""
    tpots = [(r.finished_time - r.first_token_time) / (len(r.output_ids) - 1) for r in reqs if len(r.output_ids) > 1]
    return 1e3 * statistics.mean(tpots) if tpots else float("nan")


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], batch_size: int, batching: str,
         progress: Progress, task: TaskID) -> tuple[RunResult, list[Request]]:
    """The prompts' requests run to completion, at most `batch_size` running (the engine's slots).
    continuous: all queued at once, a finished request's slot refilled from the queue (an offline engine's
    throughput regime); waves: `batch_size` at a time, each wave waiting for its longest request (static
    batching). Batch size 1 is one request alone either way, the latency regime."""
    wave = len(prompts) if batching == "continuous" else batch_size
    reqs: list[Request] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), wave):
        chunk, done = prompts[i : i + wave], [0]

        def advance() -> None:
            finished = len(chunk) - len(engine.running) - len(engine.waiting)  # O(1): the bar costs no scan
            progress.advance(task, finished - done[0])
            done[0] = finished

        reqs += engine.generate(chunk, params[i : i + wave], on_step=advance)
    wall = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in reqs)
    decoding = sum(r.finished_time - r.first_token_time for r in reqs)
    result = RunResult(tpot_ms(reqs), tokens / wall, tokens, wall, decoding / (min(batch_size, len(reqs)) * wall))
    return result, reqs


def _identical(reqs: list[Request], reference: list[list[int]]) -> int:
    return sum(r.output_ids == ids for r, ids in zip(reqs, reference))


def bench_dataset(engine: Engine, dataset: str, num_prompts: int, params: SamplingParams, batch_size: int,
                  repeats: int, progress: Progress, batching: str = "continuous") -> DatasetResult:
    if engine.tokenizer is None:
        raise ValueError("bench needs a model with a tokenizer")
    prompts = [apply_chat_template(engine.tokenizer, p) for p in load_prompts(dataset, num_prompts)]
    result = DatasetResult(dataset, len(prompts))
    # sampling: request i draws with seed base + i in every run, so its text may be compared across runs
    base = params.seed if params.seed is not None else random.getrandbits(62)
    plist = [params if params.greedy else replace(params, seed=base + i) for i in range(len(prompts))]
    reference: list[list[int]] | None = None
    # both modes warmed, so that neither one's first repeat pays for compilation and lazy allocations;
    # each speculative repeat starts statistics of the drafter's block size (AR's warm-up leaves none)
    engine.warm_up()
    with engine.autoregressive():
        engine.warm_up()
    ar_task = progress.add_task(f"{dataset} AR", total=repeats * len(prompts))
    spec_task = None if engine.drafter is None else \
        progress.add_task(f"{dataset} {engine.drafter.name}", total=repeats * len(prompts))
    for _ in range(repeats):
        with engine.autoregressive():
            run, reqs = _run(engine, prompts, plist, batch_size, batching, progress, ar_task)
        result.ar.append(run)
        if reference is None:
            reference = [r.output_ids for r in reqs]
        else:
            result.ar_identical.append(_identical(reqs, reference))
        if spec_task is not None:
            engine.reset_spec_stats()
            run, reqs = _run(engine, prompts, plist, batch_size, batching, progress, spec_task)
            result.spec.append(run)
            result.spec_identical.append(_identical(reqs, reference))
            result.spec_stats.append(engine.spec_stats.as_dict(wait=True))
    return result
