"""The math of best-of-N selection, as pure functions over one task's attempts.

An evaluation plays N attempts per task once; the success of a selector at n <= N is the
expectation over every n-subset of those attempts (drawn without replacement) of the success of
the attempt it picks, computed exactly, not by resampling:

- ``best_of_n``: the attempt with the highest score (ties broken uniformly). With tied scores
  occupying ascending ranks a..b (1-based), the subset's best lies in that group with probability
  (C(b, n) - C(a - 1, n)) / C(N, n), and is then any of the group's members alike. With the
  success itself as the score this is the unbiased pass@n estimator (the oracle).
- ``vote_of_n``: the majority final answer among the subset's answered attempts (ties between
  answers broken uniformly; no answer at all: a uniform attempt), exact over all subsets when
  there are at most ``max_subsets`` of them, else a seeded sample of that many.
- ``roc_auc``: how well scores rank successes above failures (0.5 = chance), ties counted half.
- ``gap_closed``: the share of the pass@1 -> pass@N gap a selector closes.
"""

from __future__ import annotations

import itertools
from collections import Counter
from math import comb
from typing import Sequence

import numpy as np


def best_of_n(scores: Sequence[float], success: Sequence[bool], n: int) -> float:
    """Expected success of the highest-scoring attempt of a uniform n-subset of the attempts."""
    total = len(scores)
    if not 1 <= n <= total or len(success) != total:
        raise ValueError(f"best_of_n needs 1 <= n <= {total} attempts and one success per score; got n={n}")
    order = np.argsort(np.asarray(scores, dtype=np.float64), kind="stable")
    s = np.asarray(scores, dtype=np.float64)[order]
    ok = np.asarray(success, dtype=np.float64)[order]
    value, a = 0.0, 0
    while a < total:
        b = a
        while b + 1 < total and s[b + 1] == s[a]:
            b += 1
        p_group = (comb(b + 1, n) - comb(a, n)) / comb(total, n)  # ranks a+1 .. b+1 (1-based)
        value += p_group * float(ok[a:b + 1].mean())
        a = b + 1
    return value


def _vote(answers: Sequence[str | None], success: Sequence[bool]) -> float:
    """Expected success of the majority answer's attempt within one subset."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return float(np.mean(success))
    top = max(counts.values())
    winners = [a for a, c in counts.items() if c == top]
    # each winning answer alike; within an answer, any of its attempts alike
    return float(np.mean([np.mean([s for a, s in zip(answers, success) if a == w]) for w in winners]))


def vote_of_n(answers: Sequence[str | None], success: Sequence[bool], n: int, *, max_subsets: int = 20_000,
              seed: int = 0) -> float:
    """Expected success of majority voting over a uniform n-subset of the attempts."""
    total = len(answers)
    if not 1 <= n <= total or len(success) != total:
        raise ValueError(f"vote_of_n needs 1 <= n <= {total} attempts and one success per answer; got n={n}")
    if comb(total, n) <= max_subsets:
        subsets: Sequence[Sequence[int]] = list(itertools.combinations(range(total), n))
    else:
        rng = np.random.default_rng(seed)
        subsets = [rng.choice(total, size=n, replace=False) for _ in range(max_subsets)]
    return float(np.mean([_vote([answers[i] for i in idx], [success[i] for i in idx]) for idx in subsets]))


def roc_auc(scores: Sequence[float], success: Sequence[bool]) -> float | None:
    """P(score of a random success > score of a random failure), ties counted 1/2; None when
    every attempt succeeded or every one failed."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(success, dtype=bool)
    pos, neg = s[y], s[~y]
    if len(pos) == 0 or len(neg) == 0:
        return None
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(pos) * len(neg)))


def gap_closed(selected: float, pass1: float, pass_n: float) -> float | None:
    """(selected - pass@1) / (pass@N - pass@1); None when the oracle gains nothing."""
    gap = pass_n - pass1
    return None if gap <= 1e-12 else (selected - pass1) / gap
