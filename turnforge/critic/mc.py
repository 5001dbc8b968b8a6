"""Monte-Carlo state and action values from env snapshots: the MC-Critic of ProAct.

ProAct (Yu et al. 2026, arXiv:2602.05327) calibrates the values that PPO and GRPO use
with cheap environment rollouts: from a state the agent visited, restore the real env,
play M short rollouts (at most T turns each; a uniformly random policy is the cheap
surrogate) and average their discounted returns. That value is parameter-free and
grounded in the true dynamics, so it has no simulation drift and, averaged over M, low
variance. Here, with every rollout played by the rollout engine (``RolloutEngine.play``,
on whatever env backend the run uses):

- ``mc_values``: V(s) of snapshots under any actor (``RandomActor``, a frozen BC policy's
  ``PolicyActor``);
- ``mc_q_values``: Q(s, a) = r + gamma V(s') for candidate actions (MC-GRPO): each rollout
  plays the candidate first (``EpisodeRequest.first_actions``), then the actor;
- ``blend``: a convex mix of a learned critic's values and MC values.

Where we depart from (or fill in) the paper:

- A snapshot carries the env's RNG, so restoring it as-is would replay one future M times.
  Every rollout reseeds the env's dynamics (``EpisodeRequest.reseed``, for envs with the
  ``reseed`` capability) from its own key, so M rollouts of a stochastic env (2048, slippery
  ice) sample M independent futures (Q rollouts take a fresh transition s' each). Deterministic
  envs are unaffected.
- A rollout cut by its turn budget contributes its partial return, no bootstrap: the
  value is that of the turns left, as the agent faces them.
- Rollouts that hit an infrastructure failure are left out of the means and counted (with
  the first error, for the trainer's ``max_failure_share`` check); a state whose rollouts all
  failed gets NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from turnforge.rollout.actors import Actor
from turnforge.rollout.engine import EpisodeRequest, RolloutEngine
from turnforge.seeding import stable_hash
from turnforge.types import EnvSnapshot, Task


@dataclass(frozen=True, eq=False)
class MCEstimate:
    """Monte-Carlo estimates of N states (or state-action pairs) and what they cost."""

    values: np.ndarray  # [N] float64, mean discounted return; NaN where every episode failed
    stderr: np.ndarray  # [N] float64, standard error of the mean (NaN with fewer than 2 returns)
    env_steps: int  # env steps (turns) played in all rollouts
    failed: int = 0  # episodes lost to infrastructure failures (excluded from the means)
    episodes: int = 0  # episodes played, failed ones included
    first_error: str | None = None  # the first failed episode's Trajectory.infra_failure


@dataclass(frozen=True)
class MCStart:
    """One value to estimate: from ``snapshot`` (a state of an episode of ``task``), play
    ``first_actions`` then the actor, for at most ``max_turns`` turns in all."""

    task: Task
    snapshot: EnvSnapshot
    max_turns: int
    first_actions: tuple[str, ...] = ()
    noise_key: object = None  # starts with one key share their restarts' env draws (None: the start's own)


def mc_values(
    engine: RolloutEngine,
    snapshots: Sequence[EnvSnapshot],
    tasks: Sequence[Task],
    actor: Actor,
    *,
    rollouts: int,
    gamma: float,
    max_turns: int | Sequence[int],
    seed: int,
    prefix: str = "mc",
) -> MCEstimate:
    """V(s) of each snapshot (of an episode of ``tasks[i]``) under ``actor``: the mean over
    ``rollouts`` episodes of sum_k gamma^k r_k, each for at most ``max_turns`` more turns (one
    int, or one per snapshot) or until the episode ends. A budget of 0 has value 0."""
    budgets = _budgets(max_turns, len(snapshots))
    starts = [MCStart(t, s, b) for s, t, b in zip(snapshots, tasks, budgets)]
    return estimate(engine, starts, actor, rollouts=rollouts, gamma=gamma, seed=seed, prefix=prefix)


def mc_q_values(
    engine: RolloutEngine,
    snapshot: EnvSnapshot,
    task: Task,
    action_texts: Sequence[str],
    actor: Actor,
    *,
    rollouts: int,
    gamma: float,
    max_turns: int,
    seed: int,
    prefix: str = "mcq",
) -> MCEstimate:
    """Q(s, a) of each action text from the state of ``snapshot``: the mean over ``rollouts``
    of r + gamma V(s'), where each rollout takes the action (with a fresh env future) and then
    lets ``actor`` play at most ``max_turns - 1`` more turns (0 if the action ended the episode)."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1 to take an action; got {max_turns}")
    starts = [MCStart(task, snapshot, max_turns, (text,)) for text in action_texts]
    return estimate(engine, starts, actor, rollouts=rollouts, gamma=gamma, seed=seed, prefix=prefix)


def estimate(
    engine: RolloutEngine, starts: Sequence[MCStart], actor: Actor, *, rollouts: int, gamma: float, seed: int, prefix: str,
) -> MCEstimate:
    """The Monte-Carlo estimate of every start: ``rollouts`` episodes each, all played in one
    ``engine.play`` call. Rollout m of start i reseeds the env's dynamics from
    ``stable_hash(seed, "mc", i, m)``, or with ``MCStart.noise_key`` from
    ``stable_hash(seed, "mc", ("key", noise_key), m)``: starts that share a key (V(s) and Q(s, a)
    of one state) see the same env draws, common random numbers that take the dynamics' noise
    out of their difference. The actor's draws are its own."""
    if rollouts < 1:
        raise ValueError(f"rollouts must be >= 1; got {rollouts}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1]; got {gamma}")
    reseed = engine.caps.reseed
    requests, owner = [], []
    for i, st in enumerate(starts):
        if st.max_turns == 0:
            continue
        for m in range(rollouts):
            requests.append(EpisodeRequest(
                st.task, -1, f"{prefix}-{i}", f"{prefix}-{i}-{m}", start=st.snapshot, max_turns=st.max_turns,
                reseed=stable_hash(seed, "mc", i if st.noise_key is None else ("key", st.noise_key), m) if reseed else None,
                first_actions=st.first_actions,
            ))
            owner.append(i)
    trajectories, stats = engine.play(requests, actor, tokens=actor.needs_tokens)
    returns: list[list[float]] = [[] for _ in starts]
    errors = []
    for i, traj in zip(owner, trajectories):
        if traj.infra_failure is not None:
            errors.append(traj.infra_failure)
        else:
            returns[i].append(sum(gamma**k * turn.reward for k, turn in enumerate(traj.turns)))
    values, stderr = np.full(len(starts), np.nan), np.full(len(starts), np.nan)  # [N] each
    for i, (st, g) in enumerate(zip(starts, returns)):
        if st.max_turns == 0:
            values[i] = stderr[i] = 0.0
        elif g:
            values[i] = np.mean(g)
            stderr[i] = np.std(g, ddof=1) / np.sqrt(len(g)) if len(g) > 1 else np.nan
    return MCEstimate(values, stderr, stats.turns, len(errors), len(trajectories), errors[0] if errors else None)


def _budgets(max_turns: int | Sequence[int], n: int) -> list[int]:
    """One turn budget per snapshot (an int is shared by all)."""
    budgets = [int(max_turns)] * n if isinstance(max_turns, (int, np.integer)) else [int(b) for b in max_turns]
    if len(budgets) != n:
        raise ValueError(f"max_turns has {len(budgets)} budgets for {n} snapshots")
    if any(b < 0 for b in budgets):
        raise ValueError(f"max_turns must be >= 0; got {min(budgets)}")
    return budgets


__all__ = ["MCEstimate", "MCStart", "estimate", "mc_q_values", "mc_values"]
