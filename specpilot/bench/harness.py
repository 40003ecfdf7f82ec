"""`specpilot bench`: speculative decoding against AR on the same engine, per dataset."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from rich.progress import Progress

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


@dataclass
class DatasetResult:
    dataset: str
    num_prompts: int
    ar: RunResult
    spec: RunResult | None = None
    spec_stats: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        return None if self.spec is None else self.ar.tpot_ms / self.spec.tpot_ms

    def as_dict(self) -> dict:
        return {"dataset": self.dataset, "num_prompts": self.num_prompts, "ar": vars(self.ar),
                "spec": None if self.spec is None else vars(self.spec), "speedup": self.speedup,
                **self.spec_stats}


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams, batch_size: int,
         progress: Progress, label: str) -> RunResult:
    """Requests `batch_size` at a time (1: one request alone, the latency regime)."""
    task = progress.add_task(label, total=len(prompts))
    reqs: list[Request] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        reqs += engine.generate(prompts[i : i + batch_size], params)
        progress.advance(task, min(batch_size, len(prompts) - i))
    wall = time.perf_counter() - start
    tpots = [(r.finished_time - r.first_token_time) / (len(r.output_ids) - 1) for r in reqs if len(r.output_ids) > 1]
    tokens = sum(len(r.output_ids) for r in reqs)
    return RunResult(1e3 * statistics.mean(tpots) if tpots else float("nan"), tokens / wall, tokens, wall)


def bench_dataset(engine: Engine, dataset: str, num_prompts: int, params: SamplingParams, batch_size: int,
                  progress: Progress) -> DatasetResult:
    if engine.tokenizer is None:
        raise ValueError("bench needs a model with a tokenizer")
    prompts = [apply_chat_template(engine.tokenizer, p) for p in load_prompts(dataset, num_prompts)]
    engine.warm_up()
    with engine.autoregressive():
        ar = _run(engine, prompts, params, batch_size, progress, f"{dataset} AR")
    result = DatasetResult(dataset, len(prompts), ar)
    if engine.drafter is not None:  # warm_up left the statistics empty and AR records none
        result.spec = _run(engine, prompts, params, batch_size, progress, f"{dataset} {engine.drafter.name}")
        result.spec_stats = engine.spec_stats.as_dict(wait=True)
    return result
