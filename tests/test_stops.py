"""StopChecker.extend, the commit's path for a verify pass's tokens, finishes requests exactly as appending
them one at a time does."""

from __future__ import annotations

import random

from specpilot.config import SamplingParams
from specpilot.engine.stops import StopChecker
from specpilot.state.request import Request


def _state(req: Request) -> tuple:
    return req.output_ids, req.finish_reason, req.first_token_time is not None, req.finished_time is not None


def test_extend_finishes_as_appending_token_by_token():
    rng = random.Random(0)
    stops = StopChecker(None, eos_token_ids=[2], max_len=40)
    for _ in range(3000):
        max_new = rng.randint(1, 20)
        params = SamplingParams(max_new_tokens=max_new, min_new_tokens=rng.randint(0, max_new),
                                stop_token_ids=rng.sample(range(8), rng.randint(0, 2)), ignore_eos=rng.random() < 0.5)
        prompt = [9] * rng.randint(1, 30)
        done = [Request(list(prompt), params), Request(list(prompt), params)]
        while not done[0].finished:
            tokens = [rng.randrange(8) for _ in range(rng.randint(0, 6))]
            one_by_one, appended = done[0], 0
            for token in tokens:
                appended += 1
                if stops.append(one_by_one, token):
                    break
            else:
                appended = len(tokens)
            assert stops.extend(done[1], tokens) == (appended, one_by_one.finished)
            assert _state(done[1]) == _state(one_by_one)


def test_banned_rows_only_where_stop_ids_are_banned():
    stops = StopChecker(None, eos_token_ids=[2], max_len=40)
    short = Request([9], SamplingParams(max_new_tokens=8, min_new_tokens=2))
    nothing_to_ban = Request([9], SamplingParams(max_new_tokens=8, min_new_tokens=2, ignore_eos=True))
    done = Request([9], SamplingParams(max_new_tokens=8, min_new_tokens=1), output_ids=[5])
    assert stops.bans([short]) and stops.banned(short, 3) == [[2], [2], []]
    assert not stops.bans([nothing_to_ban, done]) and stops.banned(done, 2) == [[], []]
