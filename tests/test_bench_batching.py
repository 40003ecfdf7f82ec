"""`specpilot bench --batching`: continuous refills a finished request's slot at once; waves wait for the longest."""

from rich.progress import Progress

from specpilot.bench.harness import _run
from specpilot.config import SamplingParams
from specpilot.engine.config import EngineConfig
from specpilot.engine.engine import Engine
from specpilot.state.request import Request


def _bench_run(tiny_dir, batching: str) -> list[Request]:
    engine = Engine.from_config(EngineConfig(model_path=str(tiny_dir), device="cpu", max_running_requests=2))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12], [13]]
    lengths = [2, 12, 3, 3]  # the first request short, the second long
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    with Progress(disable=True) as progress:
        task = progress.add_task("run", total=len(prompts))
        run, reqs = _run(engine, prompts, params, 2, batching, progress, task)
        assert progress.tasks[0].completed == len(prompts)
    assert run.completion_tokens == sum(lengths) and 0 < run.occupancy <= 1
    return reqs


def test_continuous_batching_refills_a_slot_at_once_with_the_same_tokens(tiny_dir):
    waves, continuous = _bench_run(tiny_dir, "waves"), _bench_run(tiny_dir, "continuous")
    assert [r.output_ids for r in continuous] == [r.output_ids for r in waves]  # batch invariance
    # waves: the third request waits for the second, the long one; continuous: it takes the first's slot
    assert waves[2].first_token_time > waves[1].finished_time
    assert continuous[2].first_token_time < continuous[1].finished_time
