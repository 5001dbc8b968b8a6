"""Pure functions for the math: advantage estimators and losses."""

from turnforge.algos.advantages import grpo
from turnforge.algos.losses import PolicyLossOutput, aggregation_weights, kl_k3, masked_mean, ppo_clip_loss, sft_loss

__all__ = ["aggregation_weights", "grpo", "kl_k3", "masked_mean", "ppo_clip_loss", "sft_loss", "PolicyLossOutput"]
