"""Exact forcing's pieces that hold on any device: the logits-row digest and the exact verdict's rules.
(On CUDA the whole of exact forcing runs in test_speculative / test_redteam with SPECPILOT_TEST_DEVICE=cuda.)"""

from __future__ import annotations

from dataclasses import replace

import torch

from specpilot.forcing.forcing import ForcingVerdict, row_digests


def test_row_digest_sees_every_bit_of_a_row():
    rows = torch.randn(4, 1000)
    base = row_digests(rows)
    assert torch.equal(row_digests(rows.clone()), base)
    for col in (0, 517, 999):
        flipped = rows.clone()
        flipped[2, col] = torch.nextafter(flipped[2, col], torch.tensor(float("inf")))  # one ulp
        got = row_digests(flipped)
        assert got[2] != base[2] and torch.equal(got[[0, 1, 3]], base[[0, 1, 3]])
    swapped = rows.clone()
    swapped[1, [3, 4]] = swapped[1, [4, 3]]
    assert row_digests(swapped)[1] != base[1]  # a permuted row is another row


def test_exact_verdict_needs_identical_rows_and_a_noiseless_stock():
    clean = ForcingVerdict("x", greedy=True, num_prompts=1, positions_checked=10, exact=True, tie_epsilon=0.0)
    assert clean.passed and clean.as_dict()["exact"]
    for change in ({"row_mismatches": 1}, {"stock_noise": 1e-7}, {"tie_mismatches": 1}):
        assert not ForcingVerdict("x", True, 1, positions_checked=10, exact=True, **change).passed, change
    # the statistical mode tolerates stock noise and tie flips
    assert ForcingVerdict("x", True, 1, positions_checked=10, stock_noise=0.2, tie_mismatches=1).passed


def test_tie_allowance_scales_the_null_rate_and_adds_three_poisson_sigmas():
    v = ForcingVerdict("x", True, 1, positions_checked=200, tie_mismatches=5, null_tie_mismatches=2,
                       null_positions=100)
    assert v.tie_allowance == 4 + 3 * 2 and v.passed  # expected 4 flips over 200 positions
    assert not replace(v, tie_mismatches=11).passed
    assert replace(v, null_tie_mismatches=0).tie_allowance == 3  # at least one sigma of a rate of one
    assert ForcingVerdict("x", True, 1, positions_checked=10, tie_mismatches=4).tie_allowance is None
