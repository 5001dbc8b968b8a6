"""Best-of-N selection math on hand-computed cases, checked against brute force over subsets."""

from __future__ import annotations

import itertools
from math import comb

import numpy as np
import pytest

from turnforge.algos.boundary import pass_at_k
from turnforge.scaling.select import best_of_n, gap_closed, roc_auc, vote_of_n


def brute_best(scores, success, n):
    """Every n-subset; the best score's attempts alike."""
    values = []
    for idx in itertools.combinations(range(len(scores)), n):
        top = max(scores[i] for i in idx)
        values.append(np.mean([success[i] for i in idx if scores[i] == top]))
    return float(np.mean(values))


def test_best_of_n_hand_cases():
    # 3 attempts, scores 0.1 0.9 0.5, only the 0.9 one succeeds: n=1 1/3, n=2 2/3 (pairs with it), n=3 1
    assert best_of_n([0.1, 0.9, 0.5], [False, True, False], 1) == pytest.approx(1 / 3)
    assert best_of_n([0.1, 0.9, 0.5], [False, True, False], 2) == pytest.approx(2 / 3)
    assert best_of_n([0.1, 0.9, 0.5], [False, True, False], 3) == pytest.approx(1.0)
    # a misleading score: the success has the lowest score, so it is picked only alone
    assert best_of_n([0.9, 0.1, 0.5], [False, True, False], 2) == pytest.approx(0.0)
    # all tied: any attempt alike, whatever n
    assert best_of_n([0, 0, 0, 0], [True, False, False, True], 3) == pytest.approx(0.5)


@pytest.mark.parametrize("seed", range(5))
def test_best_of_n_matches_brute_force_with_ties(seed):
    rng = np.random.default_rng(seed)
    scores = list(rng.integers(0, 4, size=7).astype(float))  # many ties
    success = list(rng.random(7) < 0.4)
    for n in range(1, 8):
        assert best_of_n(scores, success, n) == pytest.approx(brute_best(scores, success, n))


def test_the_oracle_is_the_unbiased_pass_at_k():
    success = [True, False, False, True, False, False, False, False]
    for n in (1, 2, 4, 8):
        assert best_of_n([float(s) for s in success], success, n) == pytest.approx(pass_at_k(8, 2, n))
        assert best_of_n([float(s) for s in success], success, n) == pytest.approx(1 - comb(6, n) / comb(8, n))


def test_vote_of_n_hand_cases():
    answers = ["7", "7", "3", None]
    success = [True, True, False, False]
    assert vote_of_n(answers, success, 1) == pytest.approx(0.5)  # one attempt: its own success
    # pairs: (7,7) 1, (7,3) tie -> 1/2, (7,None) 1, (7,3) 1/2, (7,None) 1, (3,None) 0 -> 4/6
    assert vote_of_n(answers, success, 2) == pytest.approx(4 / 6)
    assert vote_of_n(answers, success, 4) == pytest.approx(1.0)
    assert vote_of_n([None, None], [True, False], 2) == pytest.approx(0.5)  # no answers: any attempt
    sampled = vote_of_n(answers * 5, success * 5, 10, max_subsets=500, seed=1)
    assert sampled == vote_of_n(answers * 5, success * 5, 10, max_subsets=500, seed=1) and 0.9 < sampled <= 1.0


def test_auc_and_gap_closed():
    assert roc_auc([0.9, 0.8, 0.1, 0.2], [True, True, False, False]) == 1.0
    assert roc_auc([0.1, 0.8, 0.9, 0.2], [True, True, False, False]) == 0.25
    assert roc_auc([0.5, 0.5], [True, False]) == 0.5
    assert roc_auc([0.5, 0.4], [True, True]) is None
    assert gap_closed(0.55, 0.4, 0.7) == pytest.approx(0.5) and gap_closed(0.4, 0.4, 0.4) is None
