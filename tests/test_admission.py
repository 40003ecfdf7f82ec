"""Coalesced admission (`--admission coalesce`, engine/admission.py): waiting requests join once the free slots'
idle time outweighs what a prefill pass stalls the running batch for; the tokens stay those of eager admission."""

from __future__ import annotations

from test_speculative import mixed_prompts, tiny  # noqa: F401  (module fixture)

from specpilot.config import SamplingParams
from specpilot.engine.admission import Admission
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.state.request import Request


def _waiting(*created: float) -> list[Request]:
    reqs = [Request([1, 2, 3], SamplingParams()) for _ in created]
    for req, t in zip(reqs, created):
        req.created = t
    return reqs


def test_idle_slot_seconds_against_the_batch_a_pass_stalls():
    admission = Admission(max_prefill_batch=8, slots=32)
    waiting = _waiting(10.45, 10.45)
    assert admission.worth_a_pass(waiting, free=2, running=30, now=10.46)  # no pass measured yet: admit
    admission.prefilled(0.002)
    admission.prefilled(0.004)
    assert admission.prefill_s == 0.3 * 0.004 + 0.7 * 0.002
    p = admission.prefill_s
    admission.slot_freed(now=9.0)  # freed before the requests came: idle since they did
    admission.slot_freed(now=10.47)
    # 30 running x p: the pass costs 30 * 2.6 ms = 78 ms of one request's decoding
    assert not admission.worth_a_pass(waiting, free=2, running=30, now=10.47)
    now = (30 * p + 10.45 + 10.47) / 2  # idle: (now - 10.45) + (now - 10.47) = 30 p
    assert not admission.worth_a_pass(waiting, free=2, running=30, now=now - 1e-6)
    assert admission.worth_a_pass(waiting, free=2, running=30, now=now + 1e-6)
    assert not admission.worth_a_pass(waiting, free=1, running=30, now=now + 1e-6)  # one slot: half the idle time
    assert admission.worth_a_pass(waiting, free=2, running=0, now=10.5)  # nothing runs: nothing stalls
    assert not admission.worth_a_pass([], free=2, running=0, now=10.5)
    assert admission.worth_a_pass(_waiting(*[10.49] * 8), free=8, running=30, now=10.5)  # a full prefill graph
    admission.filled(1)
    assert list(admission.freed) == [10.47]
    admission.filled(5)
    assert not admission.freed


def test_coalesced_admission_keeps_the_tokens_and_cuts_prefill_passes(tiny):  # noqa: F811
    ckpt, _ = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 10, seed=4)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 9, 5, 14, 7, 2, 11, 6, 8, 4)]
    runs = {}
    for admission in ("eager", "coalesce"):
        engine = Engine(ckpt, EngineConfig(device="cpu", max_running_requests=4, context_length=256,
                                           admission=admission))
        passes = {"n": 0}
        prefill = engine._prefill
        engine._prefill = lambda reqs, prefill=prefill: (passes.__setitem__("n", passes["n"] + 1), prefill(reqs))[1]
        if engine.admission is not None:  # a pass costlier than any wait: join only once nothing runs
            engine.admission.prefilled = lambda seconds, a=engine.admission: setattr(a, "prefill_s", 1e9)
        runs[admission] = ([r.output_ids for r in engine.generate(prompts, params)], passes["n"])
    assert runs["coalesce"][0] == runs["eager"][0]
    assert runs["coalesce"][1] == 3 < runs["eager"][1]  # 10 requests in waves of 4
