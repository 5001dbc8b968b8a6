"""Advantage-weighted regression (AWR; Peng, Kumar, Zhang and Levine 2019, arXiv:1910.00177):
the weights of the weighted log-likelihood fit, as pure functions on tensors.

AWR's policy step is supervised learning on the policy's own actions, each weighted by
``exp(A(s, a) / beta)`` with the weight clipped at ``max_weight``: actions that did better than
the state's value are imitated more, worse ones less, none is ever pushed down. It solves the
KL-constrained policy improvement step ``pi'(a|s) ∝ pi(a|s) exp(A(s, a) / beta)`` by projection
onto the policy class.

Where turnforge's use (``turnforge.train.awr``, ``flywheel.weighting=mc_awr``) departs from the paper:

- The paper's advantage is ``R^lambda(s, a) - V_phi(s)``: a TD(lambda) return of the sampled
  episode against a learned value network fitted to those returns. Here both terms are
  Monte-Carlo means over K restarts from the env's snapshot of the state (no value network):
  ``Q(s, a)`` takes the sampled action first, ``V(s)`` lets the tail policy choose it; with a
  fresh env future each, sharing the dynamics' random draws between the two (common random
  numbers). On stochastic dynamics this scores the action, not the luck of the episode it was in.
- The paper trains on a replay buffer of the last 50k samples of earlier policies, advantages
  recomputed with the current critic; here each round trains on its own episodes only, every
  turn of every scored episode (failed ones included).
- The paper's actions are continuous vectors; here an action is a sequence of text tokens, its
  log-likelihood the sum over them, and the loss is normalised by the action-token count as the
  flywheel's RFT stage does.
- The paper's ``beta`` (1.0) and clip (20) are for returns of its scale; with success rewards in
  [0, 1] the useful ``beta`` is near the spread of the advantages (``flywheel.awr_beta``).
"""

from __future__ import annotations

import math

import torch

from turnforge.algos.advantages import discounted_returns, grpo


def awr_weights(advantages: torch.Tensor, beta: float, max_weight: float) -> torch.Tensor:
    """``min(exp(A / beta), max_weight)`` per element: ``advantages`` [N] float, out [N] float32.

    The exponent is clipped before ``exp`` (``A / beta <= log(max_weight)``), so a large
    advantage gives ``max_weight``, never inf."""
    if beta <= 0 or not math.isfinite(beta):
        raise ValueError(f"beta must be a finite number > 0; got {beta}")
    if max_weight <= 0 or not math.isfinite(max_weight):
        raise ValueError(f"max_weight must be a finite number > 0; got {max_weight}")
    if not torch.isfinite(advantages).all():
        bad = torch.nonzero(~torch.isfinite(advantages)).flatten().tolist()
        raise ValueError(f"advantages contain NaN/inf at positions {bad[:10]}")
    z = (advantages.to(torch.float64) / beta).clamp(max=math.log(max_weight))
    return torch.exp(z).to(torch.float32)


def anchor_state_advantages(step_rewards: torch.Tensor, episode_ids: torch.Tensor, state_ids: torch.Tensor,
                            action_ids: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages from anchor-state groups, without restarts: ``A = Q(s, a) - V(s)`` with ``V(s)``
    the mean return of the steps taken in state s (``state_ids``, e.g. task and anchor key) and
    ``Q(s, a)`` the mean return of those that took action a there (``action_ids``); a return
    ``R_t`` is discounted from step t to the end of its episode. Averaging per action (not
    GiGPO's ``R_t - V(s)`` per step) gives every step of one (s, a) the same advantage, so one
    lucky episode among them does not single its own step out. Flat per-step tensors ``[S]``,
    the steps of an episode contiguous and in order. Returns ``(A [S] float32, visits [S] int64)``,
    ``visits`` the size of the step's state group (a state visited once has A = 0 and nothing to
    compare with; callers leave such steps out)."""
    if not (step_rewards.shape == episode_ids.shape == state_ids.shape == action_ids.shape) or step_rewards.ndim != 1:
        raise ValueError("step_rewards, episode_ids, state_ids and action_ids must be 1-D tensors of one length")
    returns = discounted_returns(step_rewards, episode_ids, gamma)  # [S] float64
    pair_ids = torch.unique(torch.stack([state_ids.long(), action_ids.long()], 1), dim=0, return_inverse=True)[1]
    q = returns - grpo(returns, pair_ids, std_normalize=False).double()  # [S] the mean return of the step's (s, a)
    adv = q - (returns - grpo(returns, state_ids, std_normalize=False).double())  # Q(s, a) - V(s)
    _, inverse, counts = torch.unique(state_ids, return_inverse=True, return_counts=True)
    adv = torch.where(counts[inverse] > 1, adv, torch.zeros_like(adv))
    return adv.to(torch.float32), counts[inverse]


def effective_sample_size(weights: torch.Tensor) -> float:
    """Kish's effective sample size of a weighted sample, as a share of its size:
    ``(sum w)^2 / (N sum w^2)``, in (0, 1] (1: equal weights; 1/N: one sample carries all)."""
    if weights.ndim != 1 or len(weights) == 0:
        raise ValueError(f"weights must be a non-empty 1-D tensor; got shape {tuple(weights.shape)}")
    w = weights.to(torch.float64)
    if (w < 0).any():
        raise ValueError("weights must be >= 0")
    sq = float((w * w).sum())
    return float(w.sum()) ** 2 / (len(w) * sq) if sq > 0 else 0.0


__all__ = ["anchor_state_advantages", "awr_weights", "effective_sample_size"]
