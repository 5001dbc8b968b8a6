"""Merge repeated samples of one RL batch so the update scores each distinct sequence once.

A memoryless policy (``rollout.context=window`` with a short history) sees the same prompt
many times in one iteration: the G rollouts of a task all start in one state, and grid
games revisit states. Sokoban with ``history_window: 0`` has about three copies of every
(prompt, action) sample per iteration. Copies have one ratio ``pi / pi_old``, so their
PPO-clip terms add up exactly: for copies whose advantages share a sign,

    sum_i w_i * min(r A_i, clip(r) A_i) = W * min(r A, clip(r) A),  W = sum_i w_i,  A = sum_i w_i A_i / W

(the clipped objective is linear in A for a fixed sign; the dual clip too). So one row with
weight ``W`` and the weighted mean advantage stands for them in the loss, the KL and
entropy terms and the aggregation denominator. The optimizer steps are still cut every
``rl.minibatch_size`` *represented* samples, so the number of steps per iteration stays
what it was; only the forward and backward passes shrink.

Departure from exactness: copies are matched on tokens, loss mask and sampling versions.
Their sampling logprobs differ by ~1e-6 (batched generation pads differently); the merged
row keeps their mean, an error of the size of the sampler-vs-trainer mismatch the loss
already accepts. Copies whose advantages differ in sign stay in two rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from turnforge.types import Sample


@dataclass(frozen=True)
class MergedSample:
    """One distinct sequence of the batch standing for ``count`` sampled copies."""

    sample: Sample  # the first copy, with the copies' mean sampling logprobs
    advantage: float | np.ndarray  # weighted mean of the copies' advantages (a float, or per token)
    weight: float  # sum of the copies' aggregation weights
    count: int  # copies it stands for


def merge_samples(
    samples: Sequence[tuple[Sample, float | np.ndarray]], weights: Sequence[float]
) -> list[MergedSample]:
    """Merge copies of one sequence (equal ``token_ids``, ``loss_mask`` and ``versions``)
    whose advantages have the same sign on every action token; first-seen order.

    ``weights``: each sample's loss-aggregation weight (``aggregation_weights``). A row
    whose copies' weights sum to 0 keeps the plain mean advantage."""
    if len(samples) != len(weights):
        raise ValueError(f"merge_samples: {len(samples)} samples but {len(weights)} weights")
    buckets: dict[tuple, list[int]] = {}
    for i, (x, a) in enumerate(samples):
        adv = np.asarray(a, np.float64)
        sign = bool(adv < 0) if adv.ndim == 0 else (adv[x.loss_mask.astype(bool)] < 0).tobytes()
        key = (x.token_ids.tobytes(), x.loss_mask.tobytes(), x.versions.tobytes(), sign, x.images)  # equal ids may hold other images
        buckets.setdefault(key, []).append(i)
    out = []
    for idx in buckets.values():
        first, first_adv = samples[idx[0]]
        if len(idx) == 1:
            out.append(MergedSample(first, first_adv, float(weights[idx[0]]), 1))
            continue
        w = np.array([weights[i] for i in idx], np.float64)
        advs = np.stack([np.asarray(samples[i][1], np.float64) for i in idx])
        share = w / w.sum() if w.sum() > 0 else np.full(len(idx), 1.0 / len(idx))
        mean_adv = np.tensordot(share, advs, axes=1)
        logprobs = np.mean(np.stack([samples[i][0].logprobs for i in idx]), axis=0).astype(np.float32)
        rep = replace(first, logprobs=logprobs)
        adv = float(mean_adv) if np.ndim(first_adv) == 0 else mean_adv.astype(np.float32)
        out.append(MergedSample(rep, adv, float(w.sum()), len(idx)))
    return out


def minibatches(rows: Sequence[MergedSample], order: Sequence[int], size: int) -> list[list[int]]:
    """Cut ``order`` (indices into ``rows``) into minibatches of at least ``size``
    represented samples (the last may be smaller), so merging leaves the number of
    optimizer steps per pass as it was."""
    out: list[list[int]] = []
    current: list[int] = []
    represented = 0
    for i in order:
        current.append(i)
        represented += rows[i].count
        if represented >= size:
            out.append(current)
            current, represented = [], 0
    if current:
        out.append(current)
    return out
