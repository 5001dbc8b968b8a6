"""Credit assignment glue: trajectories -> per-turn advantages -> per-sample advantages.

The math lives in ``turnforge.algos`` (pure tensor functions); this module only turns
``Trajectory`` records into the flat tensors those functions take and maps the result back
onto samples. Episode-level estimators (grpo, rloo, reinforce_pp) give every turn of an
episode the same value; GiGPO gives each turn its own.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from turnforge.algos import gigpo, grpo, reinforce_pp, rloo
from turnforge.config import RLConfig
from turnforge.types import Sample, Trajectory


def turn_advantages(trajs: Sequence[Trajectory], rl: RLConfig) -> dict[str, np.ndarray]:
    """Advantage of every turn of every trajectory (``trajectory_id -> [num_turns]``).

    ``trajs`` must hold no infrastructure failures (they are excluded before this)."""
    if not trajs:
        return {}
    groups = {g: i for i, g in enumerate(dict.fromkeys(t.group_id for t in trajs))}
    group_of = torch.tensor([groups[t.group_id] for t in trajs])
    if rl.advantage == "gigpo":
        anchors: dict[str, int] = {}
        steps = [(e, t, turn) for e, t in enumerate(trajs) for turn in t.turns]
        adv = gigpo(
            torch.tensor([turn.reward for _, _, turn in steps], dtype=torch.float64),
            torch.tensor([e for e, _, _ in steps]),
            torch.tensor([groups[t.group_id] for _, t, _ in steps]),
            torch.tensor([anchors.setdefault(turn.anchor_key, len(anchors)) for _, _, turn in steps]),
            gamma=rl.gamma,
            omega=rl.gigpo_omega,
            std_normalize=rl.std_normalize,
        ).numpy()
        out, k = {}, 0
        for t in trajs:
            out[t.trajectory_id] = adv[k:k + t.num_turns]
            k += t.num_turns
        return out
    returns = torch.tensor([t.episode_return for t in trajs], dtype=torch.float64)
    if rl.advantage == "grpo":
        per_episode = grpo(returns, group_of, std_normalize=rl.std_normalize)
    elif rl.advantage == "rloo":
        per_episode = rloo(returns, group_of)
    else:  # reinforce_pp: the group mean as baseline, the batch std as scale
        per_episode = reinforce_pp(returns, group_of)
    return {t.trajectory_id: np.full(t.num_turns, float(a), np.float32) for t, a in zip(trajs, per_episode)}


def sample_advantage(sample: Sample, per_turn: np.ndarray) -> float | np.ndarray:
    """The advantage of one sample: its turn's value (one sample per turn), or, for a
    whole-episode sample, a per-token array with turn k's value on the k-th run of action
    tokens."""
    if sample.turn_index >= 0:
        return float(per_turn[sample.turn_index])
    mask = sample.loss_mask.astype(bool)
    starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
    if len(starts) != len(per_turn):
        raise ValueError(
            f"sample {sample.trajectory_id!r}: {len(starts)} runs of action tokens but {len(per_turn)} turns"
        )
    run = np.cumsum(np.isin(np.arange(len(mask)), starts)) - 1
    return np.where(mask, np.asarray(per_turn, np.float32)[np.clip(run, 0, None)], 0.0).astype(np.float32)
