"""Pure functions for the math: advantage estimators and losses."""

from turnforge.algos.advantages import (
    decoupled_gae,
    discounted_returns,
    gae,
    gigpo,
    grpo,
    length_adaptive_lam,
    reinforce_pp,
    rloo,
)
from turnforge.algos.losses import (
    ImportanceStats,
    PolicyLossOutput,
    aggregation_weights,
    decoupled_ppo_loss,
    explained_variance,
    importance_weights,
    kl_estimate,
    kl_k3,
    masked_mean,
    ppo_clip_loss,
    sft_loss,
    value_loss,
)

__all__ = [
    "aggregation_weights",
    "decoupled_gae",
    "decoupled_ppo_loss",
    "discounted_returns",
    "explained_variance",
    "gae",
    "gigpo",
    "importance_weights",
    "grpo",
    "kl_estimate",
    "kl_k3",
    "length_adaptive_lam",
    "masked_mean",
    "ppo_clip_loss",
    "reinforce_pp",
    "rloo",
    "sft_loss",
    "value_loss",
    "ImportanceStats",
    "PolicyLossOutput",
]
