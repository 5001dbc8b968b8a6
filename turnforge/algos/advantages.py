"""Advantage estimators: pure functions on tensors, golden-tested against hand-computed values.

Group-relative estimators score each episode against the other episodes of its group
(the G rollouts of one task), so no critic is needed.
"""

from __future__ import annotations

import numpy as np
import torch

from turnforge.algos.boundary import pass_at_k


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
    inverse, counts = _group_index(group_ids)
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


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inverse, counts)``: a dense index 0..G-1 of each element's group, and group sizes."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO advantage per episode: ``r_i - mean_{j != i, j in g} r_j``.

    Equal to ``n / (n - 1) * (r_i - mean_g)``; a group of one gets 0.
    """
    _check_rewards(rewards, group_ids)
    r = rewards.to(torch.float64)
    inverse, counts = _group_index(group_ids)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, r)
    n = counts[inverse].to(torch.float64)
    others = (sums[inverse] - r) / (n - 1).clamp(min=1)
    return torch.where(n > 1, r - others, torch.zeros_like(r)).to(torch.float32)


def pass_at_k_advantage(successes: torch.Tensor, group_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Pass@k advantage per episode in closed form for binary success (Chen et al. 2025,
    "Pass@k Training for Adaptively Balancing Exploration and Exploitation"; the binary case of
    PKPO, Walder & Karkhanis 2025). In a group of ``n`` episodes with ``c`` successes the
    group's reward is the unbiased pass@k, ``R = 1 - C(n - c, k) / C(n, k)``
    (``turnforge.algos.boundary.pass_at_k``), with ``sigma = sqrt(R (1 - R))``; a success gets
    ``(1 - R) / sigma`` and a failure ``(1 - R - C(n - c - 1, k - 1) / C(n - 1, k - 1)) / sigma``
    = ``(pass@(k-1) of the other n - 1 - R) / sigma``: what the group's pass@k gains from it. ``k = 1``
    is GRPO with the population std. A group whose pass@k is 0 or 1 (``sigma = 0``), or with
    fewer than ``k`` episodes, gets 0.

    ``successes`` [N] (bool or 0/1), ``group_ids`` [N] int; returns float32 [N]. Departs from the
    paper only in taking the env's success flag, not a reward, as "correct"."""
    if k < 1:
        raise ValueError(f"pass_at_k_advantage needs k >= 1; got {k}")
    s = successes.to(torch.float64)
    _check_rewards(s, group_ids)
    if ((s != 0) & (s != 1)).any():
        raise ValueError("pass_at_k_advantage needs binary successes (0 or 1)")
    inverse, counts = _group_index(group_ids)
    wins = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, s)
    positive, negative = torch.zeros(len(counts), dtype=torch.float64), torch.zeros(len(counts), dtype=torch.float64)
    for g, (n, c) in enumerate(zip(counts.tolist(), wins.long().tolist())):
        if n < k:
            continue
        r = pass_at_k(n, c, k)
        sigma = (r * (1 - r)) ** 0.5
        if sigma > 0:
            others = pass_at_k(n - 1, c, k - 1) if k > 1 else 0.0  # a failure's k-1 companions among the others
            positive[g], negative[g] = (1 - r) / sigma, (others - r) / sigma
    return torch.where(s == 1, positive[inverse], negative[inverse]).to(torch.float32)


def w_reinforce(successes: torch.Tensor, lam: float = 0.1) -> torch.Tensor:
    """Weighted REINFORCE (W-REINFORCE; Zhu et al. 2025, "The Surprising Effectiveness of
    Negative Reinforcement in LLM Reasoning"): ``+lam`` for a success, ``-1`` for a failure, no
    baseline: the update mostly pushes probability away from failed samples, which keeps the
    entropy (and pass@k at large k) that positive-only updates shrink. ``lam=1`` is plain
    REINFORCE with +-1 rewards. ``successes`` [N] bool or 0/1; float32 [N]."""
    s = successes.to(torch.float64)
    if s.ndim != 1 or ((s != 0) & (s != 1)).any():
        raise ValueError("w_reinforce needs a 1-D tensor of binary successes (0 or 1)")
    return torch.where(s == 1, torch.full_like(s, lam), torch.full_like(s, -1.0)).to(torch.float32)


def reinforce_pp(rewards: torch.Tensor, group_ids: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ advantage per episode: returns normalised over the whole batch,
    ``(r - mean_batch) / (std_batch + eps)`` (unbiased std).

    With ``group_ids`` this is REINFORCE++-baseline: the group mean is subtracted first,
    then the batch std divides (the std is global, not per group, unlike GRPO).
    Departure from the paper: its KL penalty is folded into the token rewards before
    normalising; here the KL to the reference is a loss term (``rl.kl_coef``).
    """
    if group_ids is None:
        group_ids = torch.zeros_like(rewards, dtype=torch.long)
    _check_rewards(rewards, group_ids)
    if rewards.numel() < 2:
        return torch.zeros_like(rewards, dtype=torch.float32)
    r = rewards.to(torch.float64)
    inverse, counts = _group_index(group_ids)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, r)
    centred = r - (sums / counts)[inverse]
    return (centred / (centred.std(unbiased=True) + eps)).to(torch.float32)


def discounted_returns(step_rewards: torch.Tensor, episode_ids: torch.Tensor, gamma: float) -> torch.Tensor:
    """``R_t = sum_{k >= t} gamma^(k - t) r_k`` within each episode.

    Flat per-step tensors ``[S]``; the steps of an episode must be contiguous and in order.
    """
    _check_contiguous(episode_ids)
    r = step_rewards.to(torch.float64)
    out = torch.zeros_like(r)
    running = 0.0
    for i in range(len(r) - 1, -1, -1):
        if i == len(r) - 1 or episode_ids[i + 1] != episode_ids[i]:
            running = 0.0
        running = float(r[i]) + gamma * running
        out[i] = running
    return out


def _check_contiguous(episode_ids: torch.Tensor) -> None:
    starts = torch.ones(len(episode_ids), dtype=torch.bool)
    starts[1:] = episode_ids[1:] != episode_ids[:-1]
    if int(starts.sum()) != len(torch.unique(episode_ids)):
        raise ValueError("episode_ids: the steps of each episode must be contiguous and in order")


def _normalise_within(values: torch.Tensor, group_ids: torch.Tensor, std_normalize: bool, eps: float) -> torch.Tensor:
    """``(x - mean_g) / F`` per group, ``F`` = unbiased std + eps or 1; 0 for groups of one."""
    return grpo(values, group_ids, std_normalize=std_normalize, eps=eps).to(torch.float64)


def gigpo(
    step_rewards: torch.Tensor,
    episode_ids: torch.Tensor,
    group_ids: torch.Tensor,
    anchor_ids: torch.Tensor,
    gamma: float = 0.95,
    omega: float = 1.0,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GiGPO (group-in-group) advantage per step ``[S]``: ``A^E + omega * A^S``.

    Flat per-step tensors: ``step_rewards`` float, ``episode_ids`` / ``group_ids`` /
    ``anchor_ids`` int, with the steps of each episode contiguous and in order. ``A^E`` is
    GRPO on episode returns (sum of the episode's step rewards) within the episode group.
    ``A^S`` normalises the discounted step return ``R_t`` within the anchor group: the
    steps of one episode group whose env state (``anchor_ids``) is equal, across and
    within episodes. A step alone in its anchor group gets ``A^S = 0``.
    """
    tensors = {"step_rewards": step_rewards, "episode_ids": episode_ids, "group_ids": group_ids, "anchor_ids": anchor_ids}
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if any(len(s) != 1 for s in shapes.values()) or len(set(shapes.values())) != 1:
        raise ValueError(f"gigpo: step_rewards, episode_ids, group_ids, anchor_ids must be 1-D of one length; got {shapes}")
    if step_rewards.numel() == 0:
        raise ValueError("gigpo: no steps (empty step_rewards)")
    _check_rewards(step_rewards, group_ids)
    _check_contiguous(episode_ids)
    ep_inverse, _ = _group_index(episode_ids)
    n_ep = int(ep_inverse.max()) + 1
    r = step_rewards.to(torch.float64)
    ep_return = torch.zeros(n_ep, dtype=torch.float64).index_add_(0, ep_inverse, r)
    ep_group = torch.zeros(n_ep, dtype=torch.long).index_copy_(0, ep_inverse, group_ids.long())
    if not torch.equal(ep_group[ep_inverse], group_ids.long()):
        raise ValueError("gigpo: group_ids differ between steps of one episode")
    a_episode = _normalise_within(ep_return, ep_group, std_normalize, eps)[ep_inverse]
    step_return = discounted_returns(r, episode_ids, gamma)
    anchor_group = torch.unique(torch.stack([group_ids.long(), anchor_ids.long()], 1), dim=0, return_inverse=True)[1]
    a_step = _normalise_within(step_return, anchor_group, std_normalize, eps)
    return (a_episode + omega * a_step).to(torch.float32)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the action tokens of padded sequences.

    ``rewards``, ``values``, ``mask``: float ``[B, T]``; ``lam`` a float or a ``[B]`` tensor
    (one lambda per sequence). The recursion visits only positions where ``mask == 1``, in
    order: the "next value" of the last action token of turn k is the value at the first
    action token of turn k+1, and the value after the last action token is 0. Rewards at
    positions with ``mask == 0`` are skipped with them (put a turn's reward on its last
    action token). Returns ``(advantages, returns)``, both 0 where ``mask == 0``;
    ``returns = advantages + values`` elsewhere.
    """
    shapes = {"rewards": tuple(rewards.shape), "values": tuple(values.shape), "mask": tuple(mask.shape)}
    if rewards.ndim != 2 or len(set(shapes.values())) != 1:
        raise ValueError(f"gae: rewards, values, mask must be [B, T] tensors of one shape; got {shapes}")
    batch = rewards.shape[0]
    lam_t = torch.as_tensor(lam, dtype=torch.float64)
    if lam_t.ndim == 0:
        lam_t = lam_t.expand(batch)
    if tuple(lam_t.shape) != (batch,):
        raise ValueError(f"gae: lam must be a float or a [B] = [{batch}] tensor; got shape {tuple(lam_t.shape)}")
    if not torch.isfinite(rewards).all() or not torch.isfinite(values).all():
        raise ValueError("gae: rewards or values contain NaN/inf")
    r, v, m = rewards.to(torch.float64), values.to(torch.float64), mask.bool()
    adv = torch.zeros_like(r)
    next_value = torch.zeros(batch, dtype=torch.float64)
    next_adv = torch.zeros(batch, dtype=torch.float64)
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam_t * next_adv
        here = m[:, t]
        adv[:, t] = torch.where(here, a, torch.zeros_like(a))
        next_value = torch.where(here, v[:, t], next_value)
        next_adv = torch.where(here, a, next_adv)
    returns = torch.where(m, adv + v, torch.zeros_like(v))
    return adv.to(rewards.dtype), returns.to(rewards.dtype)


def length_adaptive_lam(mask: torch.Tensor, alpha: float = 0.05) -> torch.Tensor:
    """VAPO's per-sequence lambda ``1 - 1 / (alpha * length)`` clamped to [0, 1], ``length``
    = the number of action tokens (``mask == 1``) of each sequence. ``[B, T]`` -> ``[B]``."""
    if alpha <= 0:
        raise ValueError(f"length_adaptive_lam: alpha must be > 0; got {alpha}")
    length = mask.to(torch.float64).sum(dim=1)
    lam = 1.0 - 1.0 / (alpha * length.clamp(min=1e-12))
    return lam.clamp(0.0, 1.0)


def decoupled_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam_policy: float | torch.Tensor = 0.95,
    lam_critic: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """VAPO's decoupled GAE: policy advantages with ``lam_policy``, critic targets (returns)
    with ``lam_critic`` (1.0 = unbiased Monte-Carlo targets). Returns ``(advantages, returns)``."""
    advantages, _ = gae(rewards, values, mask, gamma, lam_policy)
    _, returns = gae(rewards, values, mask, gamma, lam_critic)
    return advantages, returns


def blend(v_critic: torch.Tensor | np.ndarray, v_mc: torch.Tensor | np.ndarray, w: float) -> torch.Tensor | np.ndarray:
    """(1 - w) * v_critic + w * v_mc: w = 0 is the learned critic alone, w = 1 the MC values."""
    if not 0.0 <= w <= 1.0:
        raise ValueError(f"blend weight w must be in [0, 1]; got {w}")
    return (1.0 - w) * v_critic + w * v_mc
