"""Policy losses on padded token tensors ``[B, T]`` with a loss mask.

Aggregation is a weighted mean over action tokens: ``sum(w * loss) / sum(w)`` with
``w = mask * weights``. Uniform weights give token-level aggregation (DAPO: every action
token of the batch counts once). ``aggregation_weights`` builds the other choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: torch.Tensor  # scalar
    clip_fraction: float  # share of action tokens whose gradient the clip cut off
    approx_kl: float  # mean of (ratio - 1) - log ratio (k3 of behaviour vs current)
    kl_ref: float  # mean KL estimate to the reference (0 without one)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (0 if the mask is empty)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: ``exp(r) - r - 1``, ``r = ref - logp``.
    Unbiased, always >= 0."""
    r = ref_logprobs - logprobs
    return torch.exp(r) - r - 1


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
) -> PolicyLossOutput:
    """PPO-clip surrogate ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``,
    weighted mean over action tokens, plus ``kl_coef * k3(pi, ref)`` if a reference is given."""
    mask = mask.to(logprobs.dtype)
    w = mask if weights is None else mask * (weights[:, None] if weights.ndim == 1 else weights)
    old = torch.where(mask.bool(), old_logprobs, logprobs.detach())
    log_ratio = logprobs - old
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss = masked_mean(per_token, w)
    kl_ref = torch.zeros(())
    if ref_logprobs is not None and kl_coef > 0:
        kl_ref = masked_mean(kl_k3(logprobs, ref_logprobs), w)
        loss = loss + kl_coef * kl_ref
    with torch.no_grad():
        # tokens whose gradient the clip cut off (the clipped branch won the min)
        was_clipped = (((ratio > 1 + clip_high) & (advantages > 0)) | ((ratio < 1 - clip_low) & (advantages < 0))) & mask.bool()
        clip_fraction = float(was_clipped.sum() / mask.sum().clamp(min=1))
        approx_kl = float(masked_mean((ratio - 1) - log_ratio, mask))
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
