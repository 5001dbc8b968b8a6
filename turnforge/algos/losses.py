"""Policy losses on padded token tensors ``[B, T]`` with a loss mask.

Aggregation is a weighted mean over action tokens: ``sum(w * loss) / sum(w)`` with
``w = mask * weights``. Uniform weights give token-level aggregation (DAPO: every action
token of the batch counts once). ``aggregation_weights`` builds the other choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from turnforge.algos.corrections import CORRECTIONS, Corrected, Correction, token_ratios


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: torch.Tensor  # scalar
    clip_fraction: float  # share of action tokens whose gradient the clip cut off
    approx_kl: float  # mean of (ratio - 1) - log ratio (k3 of behaviour vs current)
    kl_ref: float  # mean KL estimate to the reference (0 without one)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` weighted by ``mask`` (0/1, or non-negative weights); 0 if the mask is empty."""
    return (x * mask).sum() / mask.sum().clamp(min=1e-12)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: ``exp(r) - r - 1``, ``r = ref - logp``.
    Unbiased, always >= 0."""
    r = ref_logprobs - logprobs
    return torch.exp(r) - r - 1


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi (Schulman's k1/k2/k3).

    ``k1 = logp - ref`` (unbiased, can be negative), ``k2 = (logp - ref)^2 / 2`` (biased, low
    variance, >= 0), ``k3 = exp(ref - logp) - (ref - logp) - 1`` (unbiased, >= 0).
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return kl_k3(logprobs, ref_logprobs)
    raise ValueError(f"unknown KL estimator {kind!r}; valid: 'k1', 'k2', 'k3'")


def ppo_clip_loss(
    logprobs: torch.Tensor,  # [B, T] current policy
    old_logprobs: torch.Tensor,  # [B, T] behaviour (sampling) logprobs
    advantages: torch.Tensor,  # [B, T] (an episode's advantage broadcast to its action tokens)
    mask: torch.Tensor,  # [B, T] 1 on action tokens
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,  # [B, T]
    kl_coef: float = 0.0,
    weights: torch.Tensor | None = None,  # [B] or [B, T] per-token loss weights (None = token-level)
    dual_clip: float | None = None,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,  # [B, T] entropy of the current policy at each position
    entropy_coef: float = 0.0,
    counts: torch.Tensor | None = None,  # [B] sampled copies each row stands for (metrics only)
) -> PolicyLossOutput:
    """PPO-clip surrogate ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``,
    weighted mean over action tokens, plus ``kl_coef * KL(pi, ref)`` (estimator ``k1``/``k2``/
    ``k3``) if a reference is given, minus ``entropy_coef * entropy``.

    ``dual_clip = c > 1`` (Ye et al. 2020) bounds the loss of negative-advantage tokens whose
    ratio has exploded: for ``A < 0`` the objective is ``max(min(...), c * A)``.

    ``counts`` (merged repeated samples, ``turnforge.train.merge``) weights the logged
    clip fraction and approximate KL by the copies each row stands for; the loss takes the
    copies through ``weights``.
    """
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1; got {dual_clip}")
    mask = mask.to(logprobs.dtype)
    w = mask if weights is None else mask * (weights[:, None] if weights.ndim == 1 else weights)
    old = torch.where(mask.bool(), old_logprobs, logprobs.detach())
    log_ratio = logprobs - old
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    objective = torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        objective = torch.where(advantages < 0, torch.maximum(objective, dual_clip * advantages), objective)
    loss = masked_mean(-objective, w)
    kl_ref = torch.zeros(())
    if ref_logprobs is not None and kl_coef > 0:
        kl_ref = masked_mean(kl_estimate(logprobs, ref_logprobs, kl_estimator), w)
        loss = loss + kl_coef * kl_ref
    if entropy is not None and entropy_coef > 0:
        loss = loss - entropy_coef * masked_mean(entropy, w)
    with torch.no_grad():
        # tokens whose gradient the clip cut off (the clipped branch won the min)
        was_clipped = (((ratio > 1 + clip_high) & (advantages > 0)) | ((ratio < 1 - clip_low) & (advantages < 0))) & mask.bool()
        per_token = mask if counts is None else mask * counts.to(mask.dtype)[:, None]
        clip_fraction = float(masked_mean(was_clipped.to(mask.dtype), per_token))
        approx_kl = float(masked_mean((ratio - 1) - log_ratio, per_token))
    return PolicyLossOutput(loss, clip_fraction, approx_kl, float(kl_ref.detach()))


def aggregation_weights(mode: str, action_tokens: torch.Tensor, episode_action_tokens: torch.Tensor) -> torch.Tensor:
    """Per-sample loss weights ``[B]`` for ``ppo_clip_loss``.

    - ``"token"``: 1 (every action token counts once: DAPO's token-level mean);
    - ``"sequence"``: ``1 / action_tokens`` (each sample counts once, whatever its length);
    - ``"episode"``: ``1 / episode_action_tokens`` (each episode counts once, however many
      turns and tokens it has). With episode-level advantages, token-level aggregation
      lets long (usually failed) episodes outweigh short successful ones; this removes
      that length bias.
    """
    if mode == "token":
        return torch.ones_like(action_tokens, dtype=torch.float32)
    if mode == "sequence":
        return 1.0 / action_tokens.clamp(min=1).float()
    if mode == "episode":
        return 1.0 / episode_action_tokens.clamp(min=1).float()
    raise ValueError(f"unknown loss aggregation {mode!r}; valid: 'token', 'sequence', 'episode'")


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of the action tokens, token-level mean."""
    return -masked_mean(logprobs, mask.to(logprobs.dtype))


def weighted_nll(logprobs: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of the action tokens, each row's tokens weighted by its weight,
    summed and divided by the number of action tokens (not by the weights: a sample weighted 0.5
    pulls half as hard, it does not raise the others' share). ``logprobs`` and ``mask`` are
    ``[B, T]`` (mask 1 on action tokens), ``weights`` ``[B]``; 0 for an empty mask."""
    return -(logprobs * (mask * weights[:, None])).sum() / mask.sum().clamp(min=1)


def signed_nll(logprobs: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``weighted_nll`` with negative samples: a row of weight ``w >= 0`` adds ``-w`` times its
    action tokens' logprobs (as ``weighted_nll``); a row of weight ``w < 0`` adds ``|w| x n x
    -log(1 - p)`` with ``p = exp(sum of its action tokens' logprobs)``, the probability of its whole
    action, and ``n`` its action tokens (unlikelihood, Welleck et al. 2019: a failed action pushed
    down, its gradient vanishing as ``p -> 0``, unlike ``+log p``'s, which never stops). The sum
    is divided by the action tokens of every row, so with no negative row it is ``weighted_nll``
    exactly. ``logprobs``, ``mask`` ``[B, T]``, ``weights`` ``[B]``; ``p`` is clamped to
    ``1 - eps``."""
    mask = mask.to(logprobs.dtype)
    neg = weights < 0
    pos_w = torch.where(neg, torch.zeros_like(weights), weights)
    positive = -(logprobs * (mask * pos_w[:, None])).sum()
    seq = (logprobs * mask).sum(dim=1)  # [B] log-probability of each row's whole action
    p = torch.exp(seq).clamp(max=1.0 - eps)
    unlikely = -torch.log1p(-p) * mask.sum(dim=1)  # [B]
    negative = (unlikely * torch.where(neg, -weights, torch.zeros_like(weights))).sum()
    return (positive + negative) / mask.sum().clamp(min=1)


def entropy_floor_penalty(entropy: torch.Tensor, mask: torch.Tensor, floor: float, coef: float,
                          mean=masked_mean) -> torch.Tensor:
    """The entropy guard of fine-tuning on the policy's own successes: ``coef * max(0, floor - H)``
    with ``H`` the token-level mean entropy over the masked positions; zero (and no gradient)
    while the batch's entropy is at or above ``floor``. ``mean``: how ``H`` is taken (on several
    trainer ranks, over the whole minibatch: ``turnforge.dist.masked_mean_over_ranks``)."""
    return coef * torch.relu(floor - mean(entropy, mask.to(entropy.dtype)))


def value_loss(
    values: torch.Tensor,  # [B, T] current critic
    old_values: torch.Tensor,  # [B, T] critic at rollout time
    returns: torch.Tensor,  # [B, T] targets
    mask: torch.Tensor,  # [B, T] 1 where a value is trained
    clip: float | None = None,
) -> torch.Tensor:
    """PPO's clipped value loss ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``,
    mean over masked positions; ``clip=None`` gives the plain ``0.5 * (V - R)^2``."""
    shapes = {k: tuple(v.shape) for k, v in {"values": values, "old_values": old_values, "returns": returns, "mask": mask}.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"value_loss: values, old_values, returns, mask must have one shape; got {shapes}")
    mask = mask.to(values.dtype)
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * masked_mean(loss, mask)


def explained_variance(predicted: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """``1 - Var(target - predicted) / Var(target)`` over masked positions: 1 = perfect, 0 = no
    better than predicting the mean, < 0 = worse. NaN when the target has no variance."""
    if mask is not None:
        keep = mask.bool()
        predicted, target = predicted[keep], target[keep]
    predicted, target = predicted.double().flatten(), target.double().flatten()
    if target.numel() < 2:
        return float("nan")
    var = target.var(unbiased=False)
    if var <= 0:
        return float("nan")
    return float(1 - (target - predicted).var(unbiased=False) / var)


def decoupled_ppo_loss(
    logprobs: torch.Tensor,  # [B, T] current policy (pi_theta)
    prox_logprobs: torch.Tensor,  # [B, T] proximal policy, recomputed by the trainer before the update
    behav_logprobs: torch.Tensor,  # [B, T] behaviour policy: the sampling logprobs
    advantages: torch.Tensor,
    mask: torch.Tensor,
    correction: Correction | None = None,
    correction_settings: Any = None,
    **ppo_kwargs,
) -> tuple[PolicyLossOutput, Corrected]:
    """Decoupled PPO (Hilton et al. 2022; AReaL): the trust region is around the proximal
    policy and the off-policy gap is a weight,
    ``-w * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`` with ``r = pi_theta / pi_prox``
    and ``w`` the ``correction``'s weight of ``pi_prox / pi_behav`` under ``correction_settings``
    (``turnforge.algos.corrections``; None: truncated IS ``min(pi_prox / pi_behav, 2)``). As
    ``w >= 0`` scales both branches of the min, this is ``ppo_clip_loss`` with ``old = prox`` and
    advantages ``w * A`` (dual clip and the KL/entropy terms as there). With ``prox == behav``
    every ratio is 1 and, with truncated IS (or a band holding 1), it is plain PPO. Returns the
    loss and the correction's weights."""
    correction = CORRECTIONS["tis"] if correction is None else correction
    corrected = correction.correct(token_ratios(prox_logprobs, behav_logprobs, mask), mask, correction_settings)
    out = ppo_clip_loss(logprobs, prox_logprobs, corrected.weights * advantages, mask, **ppo_kwargs)
    return out, corrected
