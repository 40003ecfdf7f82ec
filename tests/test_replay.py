"""Replayed acceptance (bench/replay.py): traces from histograms and scaled to a τ, and a drafter whose
verify passes accept exactly the counts the trace draws while the output stays AR's."""

from __future__ import annotations

import json
import random

import pytest
import torch
from test_speculative import engine_for, mixed_prompts, tiny  # noqa: F401  (module fixture)

from specpilot.bench.replay import AcceptTrace, RecordingDrafter, ReplayDrafter
from specpilot.config import SamplingParams


def test_trace_from_a_histogram_and_its_tau(tmp_path):
    trace = AcceptTrace.from_histogram([0, 5, 3, 2], "h")
    assert trace.probs == (0.5, 0.3, 0.2) and trace.max_accepted == 2
    assert trace.tau == pytest.approx(1.7)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"results": [{"dataset": "math", "accept_histogram": [0, 1, 1]},
                                            {"dataset": "mtbench", "accept_histogram": [0, 3, 1]}]}))
    assert AcceptTrace.from_bench_json(path, "mtbench").probs == (0.75, 0.25)
    with pytest.raises(ValueError, match="no result for dataset 'code'"):
        AcceptTrace.from_bench_json(path, "code")
    with pytest.raises(ValueError, match="counts no verify pass"):
        AcceptTrace.from_histogram([4], "empty")


@pytest.mark.parametrize("tau", [1.2, 2.0, 6.5])
def test_a_scaled_trace_reaches_its_tau_and_keeps_its_length(tau):
    trace = AcceptTrace.from_histogram([0, 40, 30, 15, 8, 4, 2, 1, 0, 0], "recorded")
    scaled = trace.scaled_to(tau)
    assert scaled.tau == pytest.approx(tau, abs=1e-6) and len(scaled.probs) == len(trace.probs)
    assert sum(scaled.probs) == pytest.approx(1.0) and min(scaled.probs) >= -1e-12
    rng = random.Random(0)
    assert 1 + sum(scaled.sample(rng) for _ in range(20000)) / 20000 == pytest.approx(tau, rel=0.03)
    with pytest.raises(ValueError, match="reaches tau 1..9, not 11"):
        trace.scaled_to(11.0)


def _ar_outputs(ckpt, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    """The target's own continuations, by rid p0, p1, ...: what a replay proposes."""
    ar = engine_for(ckpt)
    reqs = {f"p{i}": ar.add_request(p, params, rid=f"p{i}") for i, p in enumerate(prompts)}
    while ar.has_work:
        ar.step()
    return {rid: r.output_ids for rid, r in reqs.items()}


def test_replayed_passes_accept_the_drawn_counts_and_keep_ar_output(tiny):  # noqa: F811
    ckpt, _ = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 4)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    reference = _ar_outputs(ckpt, prompts, params)
    spec = engine_for(ckpt, "ngram", block=5, graphs=False)
    two = AcceptTrace((0.0, 0.0, 1.0, 0.0, 0.0), "always two")
    spec.drafter = ReplayDrafter(spec.drafter, reference, two, ckpt.config.vocab_size)
    reqs = [spec.add_request(p, params, rid=f"p{i}") for i, p in enumerate(prompts)]
    while spec.has_work:
        spec.step()
    assert [r.output_ids for r in reqs] == [reference[f"p{i}"] for i in range(4)]
    hist = spec.spec_stats.histogram
    # 2 drafts and the bonus every pass, but a request's last one, cut by max_new_tokens
    assert hist[3] >= sum(hist) - len(prompts) and not any(hist[4:])


def test_replay_keeps_its_drafters_early_launch_and_never_reads_a_draft_on_the_host(tiny, monkeypatch):  # noqa: F811
    """Over a drafter that launches early (dflash), the replay launches through it too, and its proposals are made
    on the device from what the host knows (no read of the draft, which would make the host wait for it); the
    passes still accept the drawn counts and the output stays AR's."""
    ckpt, paths = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 3)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    reference = _ar_outputs(ckpt, prompts, params)
    spec = engine_for(ckpt, "dflash", paths["dflash"], 6)
    assert "early-launch" in spec.mechanisms
    inner, launches = spec.drafter, []
    launch_next = inner.launch_next
    monkeypatch.setattr(inner, "launch_next", lambda *args: launches.append(1) or launch_next(*args))
    one = AcceptTrace((0.0, 1.0, 0.0, 0.0, 0.0, 0.0), "always one")
    replay = ReplayDrafter(inner, reference, one, ckpt.config.vocab_size)
    assert replay.capabilities.early_launch
    spec.drafter = replay
    proposing, reads, tolist, item = [False], [], torch.Tensor.tolist, torch.Tensor.item

    def read(method):
        def counted(self):
            if proposing[0]:
                reads.append(method.__name__)
            return method(self)
        return counted
    monkeypatch.setattr(torch.Tensor, "tolist", read(tolist))
    monkeypatch.setattr(torch.Tensor, "item", read(item))

    def watched(propose, on: bool):  # the replay's own work is watched, not its inner drafter's (CPU attention reads)
        def run(reqs):
            proposing[0] = on
            try:
                return propose(reqs)
            finally:
                proposing[0] = not on
        return run
    monkeypatch.setattr(inner, "propose", watched(inner.propose, False))
    monkeypatch.setattr(replay, "propose", watched(replay.propose, True))
    reqs = [spec.add_request(p, params, rid=f"p{i}") for i, p in enumerate(prompts)]
    while spec.has_work:
        spec.step()
    assert [r.output_ids for r in reqs] == [reference[f"p{i}"] for i in range(3)]
    assert launches and not reads
    hist = spec.spec_stats.histogram
    assert hist[2] >= sum(hist) - len(prompts) and not any(hist[3:])


def test_replayed_confidences_are_the_traces_conditional_odds(tiny):  # noqa: F811
    trace = AcceptTrace((0.5, 0.25, 0.25), "t")  # P(accepted >= 1) = 0.5, >= 2: 0.25
    assert trace.conditional() == [0.5, 0.5]
    assert AcceptTrace((0.0, 1.0, 0.0), "t").conditional() == [1.0, 0.0]
    ckpt, _ = tiny
    spec = engine_for(ckpt, "ngram", block=5, graphs=False)
    replay = ReplayDrafter(spec.drafter, {"r": list(range(3, 40))}, trace, ckpt.config.vocab_size)
    assert replay.capabilities.confidences
    req = spec.add_request([3, 4, 5, 3, 4], SamplingParams(max_new_tokens=8, ignore_eos=True), rid="r")
    spec.drafter = replay
    spec.step()  # the prefill starts the replayed drafter
    draft = replay.propose([req])
    assert draft.confidences.tolist() == [[0.5, 0.5, 0.0, 0.0]]


def test_replay_refuses_trees_and_traces_longer_than_its_blocks(tiny):  # noqa: F811
    ckpt, paths = tiny
    tree = engine_for(ckpt, "dflash", paths["dflash"], 6, topk=3, graphs=False)
    with pytest.raises(ValueError, match="takes a chain drafter"):
        ReplayDrafter(tree.drafter, {}, AcceptTrace((1.0,), "t"), 10)
    chain = engine_for(ckpt, "ngram", block=3, graphs=False)
    with pytest.raises(ValueError, match="accepts up to 4 drafts; blocks here hold 2"):
        ReplayDrafter(chain.drafter, {}, AcceptTrace((0.2, 0.2, 0.2, 0.2, 0.2), "t"), 10)


def test_a_confidence_trace_draws_the_confidences_of_a_pass_that_accepted_as_many(tmp_path):
    passes = [(0, [0.2, 0.1]), (2, [0.9, 0.8]), (2, [0.7, 0.6]), (1, [0.6, 0.3])]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"dataset": "humaneval", "passes": passes}))
    trace = AcceptTrace.load(path)
    assert trace.probs == (0.25, 0.25, 0.5) and trace.tau == 2.25
    recorded = {(a, tuple(c)) for a, c in passes}
    rng = random.Random(0)
    for t in (trace, trace.scaled_to(2.8)):
        draws = [t.sample_pass(rng) for _ in range(200)]
        assert {d for d in draws} <= recorded and {a for a, _ in draws} == {0, 1, 2}
    assert AcceptTrace((0.5, 0.5), "t").sample_pass(rng)[1] is None  # a histogram has no passes
    with pytest.raises(ValueError, match="every pass needs 2 confidences"):
        AcceptTrace.from_passes([(0, [0.1, 0.2]), (3, [0.1, 0.2])], "t")


def test_replay_of_a_confidence_trace_proposes_its_recorded_confidences(tiny):  # noqa: F811
    ckpt, _ = tiny
    spec = engine_for(ckpt, "ngram", block=5, graphs=False)
    trace = AcceptTrace.from_passes([(1, [0.75, 0.5, 0.25]), (3, [1.0, 0.875, 0.625])], "t")  # exact in fp32
    replay = ReplayDrafter(spec.drafter, {"r": list(range(3, 40))}, trace, ckpt.config.vocab_size, seed=1)
    req = spec.add_request([3, 4, 5, 3, 4], SamplingParams(max_new_tokens=8, ignore_eos=True), rid="r")
    spec.drafter = replay
    spec.step()
    rows = [replay.propose([req]).confidences.tolist()[0] for _ in range(8)]
    assert {tuple(r) for r in rows} == {(0.75, 0.5, 0.25, 0.0), (1.0, 0.875, 0.625, 0.0)}  # padded to the block's 4


def test_a_recording_counts_every_verify_pass_but_each_requests_last(tiny):  # noqa: F811
    ckpt, paths = tiny
    spec = engine_for(ckpt, "dflash", paths["dflash"], 6, graphs=False)
    recording = RecordingDrafter(spec.drafter)
    spec.drafter = recording
    prompts = mixed_prompts(ckpt.config.vocab_size, 4)
    spec.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    hist = spec.spec_stats.histogram
    assert len(recording.passes) == sum(hist) - len(prompts)
    assert all(len(c) == 5 and all(0.0 <= x <= 1.0 for x in c) for _, c in recording.passes)
    recorded = [0] * len(hist)
    for accepted, _ in recording.passes:
        recorded[accepted + 1] += 1
    assert all(r <= h for r, h in zip(recorded, hist))  # each a pass the engine counted, drafts + the bonus
    trace = AcceptTrace.from_passes(recording.passes, "recorded")
    assert trace.max_accepted == 5
    with pytest.raises(ValueError, match="takes a chain drafter"):
        RecordingDrafter(engine_for(ckpt, "dflash", paths["dflash"], 6, topk=3, graphs=False).drafter)
