"""Held-out evaluation: success rate, mean return, invalid-action rate, mean turns.

Evaluation episodes are the tasks ``0..episodes-1`` of a split with env seed = task
index, so every evaluation of every run sees the same tasks. Infrastructure failures
are excluded from the rates and counted separately.
"""

from __future__ import annotations

from typing import Sequence

from turnforge.policy.model import Policy
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest, RolloutEngine
from turnforge.train.common import generator
from turnforge.types import EvalResult, Trajectory


def evaluate(
    engine: RolloutEngine,
    policy: Policy,
    *,
    episodes: int,
    split: str = "heldout",
    temperature: float = 0.0,
    seed: int = 0,
) -> tuple[EvalResult, list[Trajectory]]:
    """Play ``episodes`` tasks of ``split`` with the policy (greedy when temperature is 0)."""
    env = engine.env
    actor = PolicyActor(policy, engine.cfg.max_new_tokens, temperature, generator(seed, "eval", split, episodes))
    requests = [EpisodeRequest(env.task(split, i), i, f"eval-{i}", f"eval-{split}-{i}") for i in range(episodes)]
    trajectories, _ = engine.play(requests, actor)
    return summarize(env.env_id, split, trajectories), trajectories


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
