"""Several policies in one run (``agent.policies``): each LoRA adapter learns from its own calls.

An agent names the policy of each call with the request's ``model`` field; the gateway samples
it with that adapter and the trace compiler keeps each policy's calls apart
(``turnforge.gateway.trace``). Here, per RL iteration:

1. credit: each policy sees the batch as its own (``policy_view``): the episodes it was called
   in, only its samples, and its reward (the agent's ``rewards[name]``, else ``reward``); the
   run's estimator assigns advantages over those views, so group baselines are per policy
   (a proposer's reward is compared with the proposer's, a solver's with the solver's);
2. update: each policy's samples train its adapter alone (``use_adapter``), one PPO pass after
   the other in the order of ``agent.policies``, each with its own minibatch order. One optimizer
   holds every adapter's parameters, so each keeps its own Adam moments and step count; a step
   after one policy's backward pass leaves the others alone (their parameters have no gradient).

"One trajectory, one weight" holds per policy: an episode is one member of each group it is in,
whatever number of calls or splits its samples have (the token-mean aggregation weighs its tokens).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from turnforge.config import TrainConfig
from turnforge.data.store import advantage_key
from turnforge.optim import GuardedStep
from turnforge.policy.lora import use_adapter
from turnforge.policy.model import Policy
from turnforge.seeding import rng
from turnforge.train.credit import Credit, assign_credit
from turnforge.train.metrics import PolicyIteration, UpdateStats
from turnforge.train.update import ppo_update
from turnforge.types import Trajectory


def policy_view(t: Trajectory, name: str) -> Trajectory | None:
    """Episode ``t`` as policy ``name`` sees it: its samples only, its reward (on the episode and
    its turns); None when ``name`` made no call in it."""
    samples = tuple(x for x in t.samples if x.policy == name)
    if not samples:
        return None
    reward = t.policy_rewards.get(name, t.episode_return)
    turns = tuple(dataclasses.replace(turn, reward=reward) for turn in t.turns)
    return dataclasses.replace(t, samples=samples, turns=turns, episode_return=reward)


def policy_credit(trajs: list[Trajectory], cfg: TrainConfig, it: int, *, pad_id: int,
                  reference: torch.nn.Module | None = None) -> Credit:
    """Step 1 (module docstring): each policy's ``Credit`` in ``by_policy``; the whole is their
    samples together, per-turn advantages under ``advantage_key(id, policy)`` and the group counts
    summed."""
    by_policy: dict[str, Credit] = {}
    for name in cfg.agent.policies:
        views = [v for v in (policy_view(t, name) for t in trajs) if v is not None]
        by_policy[name] = assign_credit(views, cfg, it, pad_id=pad_id, reference=reference)
    parts = by_policy.values()
    penalties = [c.kl_penalty for c in parts if c.kl_penalty is not None]
    return Credit(
        samples=[pair for c in parts for pair in c.samples],
        per_turn={advantage_key(tid, name): adv for name, c in by_policy.items() for tid, adv in c.per_turn.items()},
        groups=sum(c.groups for c in parts), flat_groups=sum(c.flat_groups for c in parts),
        kl_penalty=float(np.mean(penalties)) if penalties else None,
        void_episodes=sum(c.void_episodes for c in parts), overlong_episodes=sum(c.overlong_episodes for c in parts),
        by_policy=by_policy,
    )


def policy_updates(policy: Policy, credit: Credit, step: GuardedStep, cfg: TrainConfig, it: int, *,
                   reference: torch.nn.Module | None) -> dict[str, UpdateStats]:
    """Step 2 (module docstring): each policy's PPO update on its own samples, through its adapter."""
    assert credit.by_policy is not None
    out = {}
    for name, c in credit.by_policy.items():
        use_adapter(policy.model, name)
        out[name] = ppo_update(policy, c.samples, step, cfg.rl, temperature=cfg.rollout.temperature,
                               shuffle=rng(cfg.seed, "rl-shuffle", it, name), reference=reference,
                               micro_batch_tokens=cfg.model.micro_batch_tokens)
    return out


def combined(updates: list[UpdateStats]) -> UpdateStats:
    """The policies' updates as one record: tokens summed, the rest weighted by tokens."""
    total = sum(u.tokens for u in updates)

    def mean(field: str) -> float:
        return sum(getattr(u, field) * u.tokens for u in updates) / total if total else 0.0

    return UpdateStats(loss=mean("loss"), clip_fraction=mean("clip_fraction"), approx_kl=mean("approx_kl"),
                       kl_ref=mean("kl_ref"), entropy=mean("entropy"), grad_norm=mean("grad_norm"), tokens=total,
                       merged_row_fraction=mean("merged_row_fraction"))


def policy_iterations(trajs: list[Trajectory], credit: Credit, updates: dict[str, UpdateStats],
                      names: list[str]) -> dict[str, PolicyIteration]:
    """Each policy's figures of the iteration (``IterationMetrics.policies``)."""
    assert credit.by_policy is not None
    out = {}
    for name in names:
        views = [v for v in (policy_view(t, name) for t in trajs) if v is not None]
        c = credit.by_policy[name]
        out[name] = PolicyIteration(
            episodes=len(views), calls=sum(int(t.turns[0].info.get(f"n_calls_{name}", 0)) for t in trajs if t.turns),
            reward=float(np.mean([v.episode_return for v in views])) if views else 0.0, samples=len(c.samples),
            zero_variance_groups=c.flat_groups / max(c.groups, 1), update=updates[name])
    return out
