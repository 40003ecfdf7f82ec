"""Token forcing between two running servers (specpilot/forcing/served.py, `specpilot force --reference-url
--candidate-url`) on CPU: two real `specpilot serve` processes over the tiny model — AR against n-gram speculation
passes, greedy and seeded; a candidate serving subtly wrong weights (what a broken weight decode would serve) fails
with mismatches beyond the tie band; and the segment logic, which forces the reference's token past each
divergence, checks every position."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specpilot.cli import main
from specpilot.forcing.forcing import NEAR_TIE
from specpilot.forcing.served import first_difference, force_served, remembered, sglang_generate
from specpilot.optimizer.remote import Server

NEW_TOKENS = 24


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 320, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory):
    server = Server.launch(["--model-path", str(tiny_dir), "--device", "cpu"],
                           tmp_path_factory.mktemp("ref") / "ar.log").ready()
    yield server
    server.close()


@pytest.fixture(scope="module")
def speculative(tiny_dir, tmp_path_factory):
    server = Server.launch(["--model-path", str(tiny_dir), "--device", "cpu", "--speculative-algorithm", "ngram",
                            "--speculative-num-draft-tokens", "4"], tmp_path_factory.mktemp("spec") / "spec.log").ready()
    yield server
    server.close()


def _force(reference: Server, candidate: Server, sampling: dict | None = None) -> dict:
    return force_served(sglang_generate(reference.http(), with_margins=True, sampling=sampling),
                        sglang_generate(candidate.http(), with_margins=False, sampling=sampling), _prompts(4),
                        NEW_TOKENS, tie_band=NEAR_TIE).as_dict()


@pytest.mark.parametrize("sampling", [None, {"temperature": 0.8, "top_p": 0.95, "sampling_seed": 5}],
                         ids=["greedy", "seeded"])
def test_speculation_served_passes_forcing_against_served_ar(reference, speculative, sampling):
    verdict = _force(reference, speculative, sampling)
    assert verdict["passed"], verdict
    assert verdict["positions_checked"] == 4 * NEW_TOKENS and verdict["non_tie_mismatches"] == 0


def test_a_server_with_perturbed_weights_fails_forcing(reference, tiny_dir, tmp_path):
    planted = shutil.copytree(tiny_dir, tmp_path / "planted")
    weights = load_file(planted / "model.safetensors")
    name = next(n for n in weights if "layers.0.mlp.down_proj" in n)
    weights[name] = weights[name] * 1.5  # some tokens flip, not all
    save_file(weights, planted / "model.safetensors", metadata={"format": "pt"})
    candidate = Server.launch(["--model-path", str(planted), "--device", "cpu"], tmp_path / "planted.log").ready()
    try:
        verdict = _force(reference, candidate)
    finally:
        candidate.close()
    assert not verdict["passed"] and 0 < verdict["non_tie_mismatches"] < 4 * NEW_TOKENS, verdict
    assert verdict["positions_checked"] == 4 * NEW_TOKENS  # forced past every divergence to the end


def test_segments_force_the_references_token_past_each_divergence():
    """A candidate that errs at output positions 3 and 7 of each prompt: two divergences a prompt, with the
    reference's margins there, and every position checked in three segments."""
    target = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    prompt = [1, 2]

    def reference(ids: list[int], n: int) -> tuple[list[int], list[float]]:
        done = len(ids) - len(prompt)
        return target[done : done + n], [0.5 + i for i in range(done, done + n)]

    def candidate(ids: list[int], n: int) -> tuple[list[int], list[float]]:
        done = len(ids) - len(prompt)
        return [t + (i in (3, 7)) for i, t in enumerate(target[done : done + n], start=done)], []

    verdict = force_served(reference, candidate, [prompt, prompt], len(target))
    assert [(d.prompt, d.position, d.expected, d.got, d.margin) for d in verdict.divergences] == [
        (0, 3, 8, 9, 3.5), (0, 7, 12, 13, 7.5), (1, 3, 8, 9, 3.5), (1, 7, 12, 13, 7.5)]
    assert verdict.positions_checked == 20 and verdict.requests == 6 and verdict.identical_unforced == 0
    assert not verdict.passed and verdict.non_tie_mismatches == 4
    assert first_difference([1, 2, 3], [1, 2]) == 2 and first_difference([1, 2], [1, 2, 3]) is None


def test_the_cli_forces_one_running_server_against_another(reference, speculative, tiny_dir, capsys):
    url = "http://127.0.0.1:{}".format
    rc = main(["force", "--reference-url", url(reference.port), "--candidate-url", url(speculative.port),
               "--tokenizer", str(tiny_dir), "--dataset", "math", "--num-prompts", "2", "--max-new-tokens", "8",
               "--tie-band", str(NEAR_TIE)])
    verdict = json.loads(capsys.readouterr().out)
    assert rc == 0 and verdict["passed"] and verdict["positions_checked"] == 16
    with pytest.raises(SystemExit, match="--reference-url and --candidate-url go together"):
        main(["force", "--reference-url", url(reference.port)])
    with pytest.raises(SystemExit, match="--tokenizer"):
        main(["force", "--reference-url", url(reference.port), "--candidate-url", url(speculative.port),
              "--tokenizer", str(tiny_dir / "missing")])


def test_a_remembered_reference_decodes_each_input_once():
    calls = []

    def reference(ids: list[int], n: int) -> tuple[list[int], list[float]]:
        calls.append((tuple(ids), n))
        return [7] * n, [1.0] * n

    recall = remembered(reference)
    assert recall([1, 2], 3) == recall([1, 2], 3) == ([7, 7, 7], [1.0, 1.0, 1.0])
    recall([1, 2, 7], 2)
    assert calls == [((1, 2), 3), ((1, 2, 7), 2)]
