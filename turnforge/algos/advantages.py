"""Advantage estimators: pure functions on tensors, golden-tested against hand-computed values.

Group-relative estimators score each episode against the other episodes of its group
(the G rollouts of one task), so no critic is needed.
"""

from __future__ import annotations

import torch


def _check_rewards(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D tensors of one length; got rewards {tuple(rewards.shape)}, "
            f"group_ids {tuple(group_ids.shape)}"
        )
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"rewards contain NaN/inf at positions {bad[:10]}")


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantage per episode: ``(r - mean_g) / (std_g + eps)``.

    ``rewards`` [N] float, ``group_ids`` [N] int. ``std_g`` is the unbiased sample std of
    the group; with ``std_normalize=False`` there is no division (Dr.GRPO). An episode
    alone in its group gets 0 (it has nothing to be compared with).
    """
    _check_rewards(rewards, group_ids)
    rewards = rewards.to(torch.float64)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, rewards)
    mean = sums / counts
    centred = rewards - mean[inverse]
    sq = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, centred**2)
    n = counts[inverse]
    adv = centred
    if std_normalize:
        std = torch.sqrt(sq / (counts - 1).clamp(min=1))[inverse]
        adv = centred / (std + eps)
    return torch.where(n > 1, adv, torch.zeros_like(adv)).to(torch.float32)
