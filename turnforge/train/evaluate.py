"""Held-out evaluation: success rate, mean return, invalid-action rate, mean turns.

Evaluation episodes are the tasks ``0..episodes-1`` of a split with env seed = task
index, so every evaluation of every run sees the same levels. Infrastructure failures
are excluded from the rates and counted separately.
"""

from __future__ import annotations

from typing import Sequence

from turnforge.config import RolloutConfig
from turnforge.envs.base import Env
from turnforge.policy.model import Policy
from turnforge.rollout.runner import EpisodeRequest, PolicyActor, rollout
from turnforge.train.common import generator
from turnforge.types import EvalResult, Trajectory


def evaluate(
    policy: Policy,
    envs: Sequence[Env],
    rollout_cfg: RolloutConfig,
    *,
    episodes: int,
    split: str = "heldout",
    temperature: float = 0.0,
    seed: int = 0,
) -> tuple[EvalResult, list[Trajectory]]:
    """Play ``episodes`` tasks of ``split`` with the policy (greedy when temperature is 0)."""
    env_id = envs[0].env_id
    actor = PolicyActor(policy, rollout_cfg.max_new_tokens, temperature, generator(seed, "eval", split, episodes))
    trajectories: list[Trajectory] = []
    for start in range(0, episodes, len(envs)):
        requests = [
            EpisodeRequest(envs[0].task(split, i), i, f"eval-{i}", f"eval-{split}-{i}")
            for i in range(start, min(episodes, start + len(envs)))
        ]
        trajs, _ = rollout(actor, envs, requests, rollout_cfg, policy)
        trajectories.extend(trajs)
    return summarize(env_id, split, trajectories), trajectories


def summarize(env_id: str, split: str, trajectories: Sequence[Trajectory]) -> EvalResult:
    """Aggregate episodes into an ``EvalResult`` (infra failures excluded and counted)."""
    ok = [t for t in trajectories if t.infra_failure is None]
    n = len(ok)
    actions = sum(t.num_turns for t in ok)
    return EvalResult(
        env_id=env_id,
        split=split,
        episodes=n,
        success_rate=sum(t.success for t in ok) / n if n else 0.0,
        mean_return=sum(t.episode_return for t in ok) / n if n else 0.0,
        invalid_action_rate=sum(t.num_invalid for t in ok) / actions if actions else 0.0,
        mean_turns=actions / n if n else 0.0,
        infra_failures=len(trajectories) - n,
    )
