"""The evaluator's acceptance rule: the paired sign-flip test and the verdict it gives."""

import math

from hypothesis import given
from hypothesis import strategies as st

from specpilot.optimizer.significance import min_pairs, paired_test
from specpilot.optimizer.verdicts import decide

times = st.floats(min_value=0.5, max_value=2.0)
pairs = st.lists(st.tuples(times, times), min_size=5, max_size=9)


def _verdict(stock, candidate):
    return decide(stock, candidate, over_ar=1.5, ceiling=3.0, forcing={"passed": True}, seconds=1.0)


def test_a_steady_gain_is_accepted_with_its_bound_and_every_loss_is_not():
    verdict = _verdict([1.10, 1.12, 1.09, 1.11, 1.10, 1.13], [1.0] * 6)
    assert verdict.accepted and verdict.speedup["p"] == 1 / 64 and 1.09 < verdict.speedup["lower"] < 1.11
    slower = _verdict([1.0] * 6, [1.05] * 6)
    assert not slower.accepted and slower.reason.startswith("not shown faster than stock: p = 1.000")
    head_to_head = decide([1.0] * 6, [1.05] * 6, over_ar=1.5, ceiling=3.0, forcing=None, seconds=1.0,
                          reference="the profile it is set against")
    assert "than the profile it is set against" in head_to_head.reason and "stock" not in head_to_head.reason


def test_one_outlier_pair_does_not_sink_a_clear_gain_nor_does_one_lucky_pair_make_one():
    """The old rule (faster in every pair) rejected the first; a median of noise accepted the second."""
    assert _verdict([1.30, 1.31, 1.29, 1.30, 1.32, 1.30, 1.31, 1.28], [1.0] * 7 + [1.31]).accepted
    lucky = _verdict([1.0, 1.01, 0.99, 1.0, 1.6, 1.0], [1.0, 1.0, 1.0, 1.01, 1.0, 1.0])
    assert not lucky.accepted and lucky.speedup["median"] >= 1.0


def test_too_few_pairs_is_said_and_the_ceiling_comes_first():
    few = _verdict([2.0] * 4, [1.0] * 4)
    assert not few.accepted and few.reason.startswith("too few repeats: 4 pairs") and min_pairs() == 5
    assert few.speedup["lower"] == 0.0
    fast = decide([2.0] * 6, [1.0] * 6, over_ar=4.0, ceiling=3.0, forcing=None, seconds=1.0)
    assert not fast.accepted and fast.reason.startswith("implausible")


@given(pairs)
def test_the_test_ignores_order_and_units(runs):
    stock, candidate = map(list, zip(*runs))
    base = paired_test(stock, candidate)
    shuffled = paired_test(stock[::-1], candidate[::-1])
    scaled = paired_test([3 * s for s in stock], [3 * c for c in candidate])
    assert math.isclose(base.p_value, shuffled.p_value) and math.isclose(base.p_value, scaled.p_value)
    assert math.isclose(base.lower, scaled.lower, rel_tol=1e-6)


@given(pairs)
def test_the_bound_lies_below_the_mean_and_is_above_one_exactly_when_the_test_accepts(runs):
    stock, candidate = map(list, zip(*runs))
    test = paired_test(stock, candidate)
    assert test.lower <= test.geometric_mean * (1 + 1e-9)
    assert (test.p_value <= 0.05) == (test.lower > 1.0) or math.isclose(test.lower, 1.0, rel_tol=1e-6)
