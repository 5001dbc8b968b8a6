"""The boundary of what a policy solves: pass@k, never-solved share, distinct successes, and
whether actions depend on the observation. Pure functions on counts and probability arrays,
unit-tested against hand-computed values (``tests/algos/test_boundary_math.py``).

Sharpening (the policy concentrates on what it already solves) and expansion (it solves tasks it
never solved) look the same at pass@1; pass@k for large k and the never-solved share tell them
apart: sharpening raises pass@1 and leaves pass@k at large k (or lowers it), expansion raises both.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k for one task from ``n`` samples, ``c`` of them correct
    (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"):
    ``1 - C(n - c, k) / C(n, k)``, the chance that ``k`` of the ``n`` samples drawn without
    replacement hold at least one success. Computed in the paper's numerically stable product
    form ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (no binomials of large numbers)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k samples holds a success
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> tuple[float | None, int]:
    """pass@k averaged over tasks, each given as ``(n, c)`` (samples scored, successes); a task
    with fewer than ``k`` scored samples (infrastructure failures left out) is left out.
    Returns ``(mean, tasks averaged)``; the mean is None when no task has ``k`` samples."""
    values = [pass_at_k(n, c, k) for n, c in counts if n >= k]
    return (float(np.mean(values)) if values else None), len(values)


def never_solved_share(counts: Sequence[tuple[int, int]], k: int) -> float | None:
    """The expected share of tasks with no success among ``k`` samples: the mean over tasks of
    ``C(n - c, k) / C(n, k)``, i.e. ``1 - pass@k`` (unbiased, the same estimator and the same
    tasks as ``mean_pass_at_k``). None when no task has ``k`` scored samples."""
    mean, _ = mean_pass_at_k(counts, k)
    return None if mean is None else 1.0 - mean


def distinct_successes(successes: Sequence[Sequence[Hashable]]) -> float | None:
    """Distinct successful solutions per task: for each task, the list of its successful
    episodes' action sequences (any hashable, e.g. a tuple of action texts); the number of
    distinct ones, averaged over the tasks with at least one success (None when none has)."""
    counts = [len(set(xs)) for xs in successes if len(xs)]
    return float(np.mean(counts)) if counts else None


def entropy(p: np.ndarray) -> np.ndarray:
    """Shannon entropy in nats of each distribution along the last axis (0 log 0 = 0)."""
    p = np.asarray(p, dtype=np.float64)
    logs = np.log(np.where(p > 0, p, 1.0))
    return -(p * logs).sum(axis=-1)


def mutual_information(probs: np.ndarray) -> float:
    """I(A; O) in nats between the observation O (uniform over the rows) and the action A drawn
    from the row's distribution: ``H(mean_o p(a|o)) - mean_o H(p(a|o))``. ``probs`` ``[O, A]``,
    each row a distribution over the action set. 0 when every row is the same distribution (the
    action does not depend on the input); ``log(A)`` at most, reached when the rows are one-hot
    on distinct actions, each action as often."""
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2 or probs.shape[0] < 1 or probs.shape[1] < 1:
        raise ValueError(f"mutual_information needs a [observations, actions] array; got shape {probs.shape}")
    if not np.allclose(probs.sum(axis=1), 1.0, atol=1e-6) or (probs < 0).any():
        raise ValueError("each row of probs must be a probability distribution (non-negative, summing to 1)")
    mi = float(entropy(probs.mean(axis=0)) - entropy(probs).mean())
    return max(mi, 0.0)  # (float rounding only: the mutual information is never negative)


def softmax_rows(scores: np.ndarray) -> np.ndarray:
    """Each row of log-scores ``[O, A]`` normalised into a distribution (a stable softmax)."""
    scores = np.asarray(scores, dtype=np.float64)
    z = np.exp(scores - scores.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def gained_and_lost(start: Sequence[int], end: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Tasks gained and lost against the start: ``start`` and ``end`` are the indices of the tasks
    solved at least once (in N samples) by the starting and the trained policy; returns the sorted
    indices solved only at the end (gained) and only at the start (lost)."""
    a, b = set(start), set(end)
    return tuple(sorted(b - a)), tuple(sorted(a - b))


def success_share(n: int, c: int, k: int) -> float:
    """What one success adds to its group's pass@k: the chance that it is the only success among
    ``k`` rollouts of its group drawn with it (the other ``k - 1`` from the other ``n - 1``, of which
    ``c - 1`` succeeded), ``C(n - c, k - 1) / C(n - 1, k - 1)`` = ``1 - pass@(k-1)`` of the others;
    ``k`` is clamped to ``n``. The weight of a success in a pass@k objective (its gradient is
    ``k (1 - p)^(k-1)`` times pass@1's; Chen et al. 2025): 1 for a lone success, 0 where every
    draw of ``k`` holds another. n=2: 1/2 -> 1, 2/2 -> 0; n=4, k=2: 2/4 -> 2/3; n=4, k=3: 2/4 -> 1/3."""
    if not 1 <= c <= n or k < 1:
        raise ValueError(f"success_share needs 1 <= c <= n and k >= 1; got n={n}, c={c}, k={k}")
    k = min(k, n)
    return 1.0 if k == 1 else 1.0 - pass_at_k(n - 1, c - 1, k - 1)


def boundary_weight(samples: int, successes: int) -> float:
    """How close a task is to the boundary of what the policy solves, from its probes:
    ``1 - p`` with ``p = (c + 1/2) / (n + 1)`` (the success rate, pulled toward 1/2 so that one
    probe is not a verdict). 0/1 -> 0.75, 1/1 -> 0.25, 0/2 -> 5/6, 1/2 -> 1/2, 2/2 -> 1/6:
    rarely solved tasks weigh most, always-solved ones least."""
    if not 0 <= successes <= samples:
        raise ValueError(f"boundary_weight needs 0 <= successes <= samples; got {samples}, {successes}")
    return 1.0 - (successes + 0.5) / (samples + 1)


def boundary_allotment(weights: Sequence[float], extra: int, cap: int) -> list[int]:
    """``extra`` rollouts dealt to tasks in proportion to their ``weights`` (the D'Hondt rule: each
    next rollout goes to the task with the largest ``w / (given + 1)``, ties to the first), at
    most ``cap`` per task; what no task can take (all at ``cap``) is left undealt. Returns the
    rollouts per task."""
    if extra < 0 or cap < 0:
        raise ValueError(f"boundary_allotment needs extra >= 0 and cap >= 0; got extra={extra}, cap={cap}")
    given = [0] * len(weights)
    for _ in range(extra):
        best, score = None, -1.0
        for i, w in enumerate(weights):
            if given[i] < cap and w / (given[i] + 1) > score:
                best, score = i, w / (given[i] + 1)
        if best is None:
            break
        given[best] += 1
    return given
