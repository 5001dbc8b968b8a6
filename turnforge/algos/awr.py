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


__all__ = ["awr_weights", "effective_sample_size"]
