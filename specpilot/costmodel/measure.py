"""A measured step breakdown from the engine itself: AR steps, then speculative steps split by the step
clock into draft, verify and host work, over the same prompts at one batch size."""

from __future__ import annotations

import statistics
import time

from specpilot.config import SamplingParams
from specpilot.costmodel.calibrate import calibrate
from specpilot.costmodel.floors import Floors, floors, shapes_of
from specpilot.costmodel.gaps import Measured
from specpilot.engine.engine import Engine


def _decode_ms(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Mean wall ms of a decode step once every prompt is admitted and prefilled."""
    reqs = [engine.add_request(p, params) for p in prompts]
    while any(not r.output_ids for r in reqs):  # prefill (in waves if the slots are fewer)
        engine.step()
    steps, start = 0, time.perf_counter()
    while engine.has_work:
        engine.step()
        steps += 1
    return 1e3 * (time.perf_counter() - start) / max(steps, 1)


def measure(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[Measured, int]:
    """(the breakdown, the mean context length it ran at), the prompts decoding together (at most the
    engine's running requests). Both modes are warmed first."""
    prompts = prompts[: engine.config.max_running_requests]
    if engine.drafter is None:
        raise ValueError("the cost model measures a speculative configuration: give --speculative-algorithm")
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    engine.warm_up()
    with engine.autoregressive():
        engine.warm_up()
        ar_ms = _decode_ms(engine, prompts, params)
    engine.reset_spec_stats()
    _decode_ms(engine, prompts, params)
    stats = engine.spec_stats
    split = stats.time_split(wait=True)
    steps = max(stats.steps / len(prompts), 1)  # the prompts decode together: verify passes per request = steps
    measured = Measured(ar_ms, 1e3 * split["draft"] / steps, 1e3 * split["verify"] / steps,
                        1e3 * split["other"] / steps, stats.tau)
    return measured, int(statistics.mean(len(p) for p in prompts) + max_new_tokens / 2)


def replays_graphs(engine: Engine) -> bool:
    return engine.config.cuda_graphs and engine.device.type == "cuda"


def floors_of(engine: Engine, context: int) -> Floors:
    """The B=1 floors of this engine's deployment: its shapes on the device, calibrated."""
    return floors(shapes_of(engine), calibrate(engine.device, engine.dtype), 1, context, replays_graphs(engine))


def speedup_ceiling(engine: Engine, ar_ms: float, context: int) -> float:
    """The speedup over an AR time per token `ar_ms` that this engine's deployment cannot exceed (every draft
    accepted, at the speculative step's floor): the sealed evaluator's plausibility gate."""
    return floors_of(engine, context).ceiling_over(ar_ms)
