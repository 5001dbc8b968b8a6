"""pass@k, never-solved share, distinct successes and I(A; O) against hand-computed values."""

import math

import numpy as np
import pytest

from turnforge.algos.boundary import (
    distinct_successes,
    mean_pass_at_k,
    mutual_information,
    never_solved_share,
    pass_at_k,
    softmax_rows,
)


def test_pass_at_k_hand_computed():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=4, c=1, k=1: the success rate c/n
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # n - c < k: every draw of k holds a success; c = 0: never
    assert pass_at_k(4, 3, 2) == 1.0 and pass_at_k(16, 0, 8) == 0.0 and pass_at_k(4, 4, 4) == 1.0


def test_pass_at_k_matches_the_binomial_form_and_is_stable_for_large_n():
    for n, c, k in [(16, 3, 8), (64, 5, 64), (64, 1, 17), (200, 7, 50)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), rel=1e-12)
    # C(10000, 5000) overflows a float; the product form does not
    value = pass_at_k(10_000, 3, 5_000)
    assert value == pytest.approx(1 - (5000 * 4999 * 4998) / (10000 * 9999 * 9998), rel=1e-9)


@pytest.mark.parametrize("n, c, k", [(4, 5, 2), (4, 1, 0), (4, 1, 5), (4, -1, 2)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_mean_pass_at_k_leaves_out_tasks_with_fewer_than_k_samples():
    counts = [(4, 1), (4, 0), (3, 3)]  # the last task lost a sample to an infrastructure failure
    mean, tasks = mean_pass_at_k(counts, 4)
    assert tasks == 2 and mean == pytest.approx((1.0 + 0.0) / 2)
    mean, tasks = mean_pass_at_k(counts, 2)
    assert tasks == 3 and mean == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert mean_pass_at_k([(2, 1)], 4) == (None, 0)


def test_never_solved_share_is_the_expected_share_without_a_success():
    # task 1: C(3,2)/C(4,2) = 0.5 of 2-draws miss; task 2 never solved: 1; task 3: C(0,2)... n-c<k: 0
    counts = [(4, 1), (4, 0), (4, 3)]
    assert never_solved_share(counts, 2) == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert never_solved_share(counts, 4) == pytest.approx(1 / 3)  # only the task with no success at all
    assert never_solved_share(counts, 8) is None


def test_distinct_successes():
    # task 1: two successes, one sequence; task 2: three successes, two sequences; task 3: none (left out)
    got = distinct_successes([[("up", "left"), ("up", "left")], [("up",), ("down",), ("up",)], []])
    assert got == pytest.approx((1 + 2) / 2)
    assert distinct_successes([[], []]) is None


def test_mutual_information_of_identical_rows_is_zero():
    p = np.array([[0.7, 0.2, 0.1, 0.0]] * 5)
    assert mutual_information(p) == pytest.approx(0.0, abs=1e-12)


def test_mutual_information_of_one_hot_distinct_rows_is_log_of_the_actions():
    assert mutual_information(np.eye(4)) == pytest.approx(math.log(4))


def test_mutual_information_hand_computed():
    # rows (1, 0) and (1/2, 1/2): mean (3/4, 1/4); H(mean) = -(3/4 ln 3/4 + 1/4 ln 1/4); mean H = ln(2) / 2
    p = np.array([[1.0, 0.0], [0.5, 0.5]])
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) - math.log(2) / 2
    assert mutual_information(p) == pytest.approx(expected)


def test_mutual_information_refuses_rows_that_are_not_distributions():
    with pytest.raises(ValueError):
        mutual_information(np.array([[0.5, 0.6]]))
    with pytest.raises(ValueError):
        mutual_information(np.array([0.5, 0.5]))


def test_softmax_rows():
    p = softmax_rows(np.array([[0.0, math.log(3.0)], [-1000.0, -1000.0]]))
    np.testing.assert_allclose(p, [[0.25, 0.75], [0.5, 0.5]])


def test_gained_and_lost_hand_computed():
    from turnforge.algos.boundary import gained_and_lost

    assert gained_and_lost([0, 2, 3, 7], [0, 1, 3, 9]) == ((1, 9), (2, 7))
    assert gained_and_lost([], [4]) == ((4,), ())
    assert gained_and_lost([5], [5]) == ((), ())


def test_boundary_weight_hand_computed():
    from turnforge.algos.boundary import boundary_weight

    # 1 - (c + 1/2) / (n + 1)
    assert boundary_weight(1, 0) == pytest.approx(0.75) and boundary_weight(1, 1) == pytest.approx(0.25)
    assert boundary_weight(2, 0) == pytest.approx(5 / 6) and boundary_weight(2, 1) == pytest.approx(0.5)
    assert boundary_weight(2, 2) == pytest.approx(1 / 6)
    with pytest.raises(ValueError, match="0 <= successes <= samples"):
        boundary_weight(1, 2)


def test_success_share_hand_computed():
    from turnforge.algos.boundary import success_share

    # C(n - c, k - 1) / C(n - 1, k - 1): the chance a success is the only one among k of its group drawn with it
    assert success_share(2, 1, 2) == 1.0 and success_share(2, 2, 2) == 0.0  # 1/2 -> 1; 2/2 -> 0
    assert success_share(4, 2, 2) == pytest.approx(2 / 3)  # the other one drawn from 3, 2 of them failures
    assert success_share(4, 2, 3) == pytest.approx(1 / 3)  # C(2, 2) / C(3, 2)
    assert success_share(4, 1, 4) == 1.0 and success_share(4, 4, 2) == 0.0
    assert success_share(8, 3, 4) == pytest.approx(10 / 35)  # C(5, 3) / C(7, 3)
    assert success_share(3, 3, 1) == 1.0  # pass@1: every success weighs 1
    assert success_share(2, 1, 5) == 1.0  # k clamped to the group: n=2, k=2
    with pytest.raises(ValueError, match="1 <= c <= n"):
        success_share(2, 0, 2)


def test_boundary_allotment_deals_in_proportion_up_to_the_cap():
    from turnforge.algos.boundary import boundary_allotment

    # D'Hondt, weights 0.75, 0.25, 0.75, 4 rollouts: quotients 0.75 (t0), 0.75 (t2), 0.375 (t0), 0.375 (t2)
    assert boundary_allotment([0.75, 0.25, 0.75], 4, cap=7) == [2, 0, 2]
    # 5 rollouts: the fifth to the largest of 0.25, 0.25 (t0: 0.75/3), 0.25 (t2): the first of the ties
    assert boundary_allotment([0.75, 0.25, 0.75], 5, cap=7) == [3, 0, 2]
    # three times the weight, three times the rollouts
    assert boundary_allotment([0.75, 0.25], 8, cap=10) == [6, 2]
    # the cap: what t0 cannot take goes to the others; what no task can take is left undealt
    assert boundary_allotment([0.75, 0.25], 8, cap=3) == [3, 3]
    assert boundary_allotment([0.5, 0.5], 0, cap=3) == [0, 0]
    with pytest.raises(ValueError, match="extra >= 0"):
        boundary_allotment([0.5], -1, cap=3)
