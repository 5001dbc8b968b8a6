"""Monte-Carlo state values from env snapshots: the MC-Critic of ProAct.

ProAct (Yu et al. 2026, arXiv:2602.05327) calibrates the values that PPO and GRPO use
with cheap environment rollouts: from a state the agent visited, restore the real env,
play M short rollouts (at most T turns each; a uniformly random policy is the cheap
surrogate) and average their discounted returns. That value is parameter-free and
grounded in the true dynamics, so it has no simulation drift and, averaged over M, low
variance. Here:

- ``mc_values``: V(s) under the uniform random policy over ``env.action_names``, in plain
  Python (no LM), inline or in a process pool;
- ``mc_values_policy``: V(s) under any rollout ``Actor`` (a frozen BC policy, the expert),
  all N*M episodes batched through ``rollout()``;
- ``mc_q_values``: Q(s, a) = r + gamma V(s') for candidate actions (MC-GRPO);
- ``blend``: a convex mix of a learned critic's values and MC values.

Where we depart from (or fill in) the paper:

- A snapshot carries the env's RNG, so restoring it as-is would replay one future M times.
  Every rollout reseeds the env's dynamics RNG from its own key instead, so M rollouts
  of a stochastic env (2048, slippery ice) sample M independent futures. Deterministic
  envs are unaffected.
- ``mc_q_values`` takes a fresh transition s' for every rollout (Q = mean over m of
  r_m + gamma G_m) rather than one s' per action, for the same reason.
- A rollout cut by its turn budget contributes its partial return, no bootstrap: the
  value is that of the turns left, as the agent faces them.
"""

from __future__ import annotations

import atexit
import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from turnforge.config import RolloutConfig
from turnforge.envs import make
from turnforge.envs.base import Env, EnvSnapshot, stable_hash
from turnforge.envs.registry import list_envs
from turnforge.policy.model import Policy
from turnforge.rollout.runner import Actor, EpisodeRequest, rollout


@dataclass(frozen=True, eq=False)
class MCEstimate:
    """Monte-Carlo estimates of N states (or actions) and what they cost."""

    values: np.ndarray  # [N] float64, mean discounted return; NaN where every episode failed
    stderr: np.ndarray  # [N] float64, standard error of the mean (NaN with fewer than 2 returns)
    env_steps: int  # env steps (turns) played in all rollouts
    failed: int = 0  # episodes lost to infrastructure failures (excluded from the means)


# ---------------------------------------------------------------------- random policy
def mc_values(
    env_id: str,
    env_kwargs: dict[str, Any],
    snapshots: Sequence[EnvSnapshot],
    *,
    rollouts: int,
    gamma: float,
    max_turns: int | Sequence[int],
    seed: int,
    workers: int = 1,
) -> MCEstimate:
    """V(s) of each snapshot under the uniform random policy over ``env.action_names``:
    the mean over ``rollouts`` episodes of sum_k gamma^k r_k, each for at most
    ``max_turns`` more turns (one int, or one per snapshot) or until the episode ends.

    Rollout m of snapshot i draws its actions and its env dynamics from
    ``random.Random(stable_hash(seed, "mc", i, m))``, so the result does not depend on
    ``workers``. ``workers > 1`` plays chunks of snapshots in a process pool (forked, kept
    for later calls); each worker builds its env once with ``make(env_id, **env_kwargs)``.
    """
    returns, steps = _random_returns(env_id, env_kwargs, snapshots, rollouts, gamma, max_turns, seed, workers)
    return _estimate(returns, steps)


def mc_q_values(
    env_id: str,
    env_kwargs: dict[str, Any],
    snapshot: EnvSnapshot,
    action_texts: Sequence[str],
    *,
    rollouts: int,
    gamma: float,
    max_turns: int,
    seed: int,
    workers: int = 1,
) -> MCEstimate:
    """Q(s, a) of each action text from the state of ``snapshot`` (for MC-GRPO): the mean
    over ``rollouts`` of r + gamma V(s'), where r and s' come from one step of the action
    (with a fresh env RNG per rollout) and V(s') is one random-policy rollout of at most
    ``max_turns - 1`` turns (0 if the step ended the episode). ``env_steps`` counts the
    first steps too. All next states go through one ``mc_values``-style batch."""
    _check(rollouts, gamma)
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1 to take an action; got {max_turns}")
    env = _env(env_id, env_kwargs)
    rewards = np.zeros((len(action_texts), rollouts))  # [A, M]
    nexts: list[EnvSnapshot] = []
    where: list[tuple[int, int]] = []  # (action, rollout) of each next state that goes on
    for a, text in enumerate(action_texts):
        for m in range(rollouts):
            env.restore(snapshot)
            env.rng.seed(stable_hash(seed, "q", a, m))
            rewards[a, m] = env.step(text).reward
            if not env.done:
                nexts.append(env.snapshot())
                where.append((a, m))
    future = np.zeros_like(rewards)  # [A, M], 0 after a step that ended the episode
    steps = rewards.size
    if nexts and max_turns > 1:
        tails, tail_steps = _random_returns(env_id, env_kwargs, nexts, 1, gamma, max_turns - 1, seed, workers)
        for (a, m), g in zip(where, tails[:, 0]):
            future[a, m] = g
        steps += tail_steps
    return _estimate(rewards + gamma * future, steps)


def _random_returns(
    env_id: str,
    env_kwargs: dict[str, Any],
    snapshots: Sequence[EnvSnapshot],
    rollouts: int,
    gamma: float,
    max_turns: int | Sequence[int],
    seed: int,
    workers: int,
) -> tuple[np.ndarray, int]:
    """Discounted returns [N, M] of the random policy and the env steps they took."""
    _check(rollouts, gamma)
    budgets = _budgets(max_turns, len(snapshots))
    names = _env(env_id, env_kwargs).action_names
    if not names:
        raise ValueError(
            f"mc_values plays uniformly random actions, but env {env_id!r} has no discrete action set "
            "(Env.action_names is empty); use mc_values_policy with an actor instead"
        )
    if workers <= 1 or len(snapshots) <= 1:
        return _play_chunk(env_id, env_kwargs, list(snapshots), 0, budgets, rollouts, gamma, seed)
    size = -(-len(snapshots) // (4 * workers))  # 4 chunks per worker balance uneven episode lengths
    pool = _pool(workers)
    jobs = [
        pool.submit(_play_chunk, env_id, env_kwargs, list(snapshots[s : s + size]), s, budgets[s : s + size],
                    rollouts, gamma, seed)
        for s in range(0, len(snapshots), size)
    ]
    parts = [job.result() for job in jobs]
    return np.concatenate([p[0] for p in parts]), sum(p[1] for p in parts)


def _play_chunk(
    env_id: str,
    env_kwargs: dict[str, Any],
    snapshots: list[EnvSnapshot],
    offset: int,
    budgets: list[int],
    rollouts: int,
    gamma: float,
    seed: int,
) -> tuple[np.ndarray, int]:
    """Random-policy returns [len(snapshots), rollouts] of snapshots ``offset``, ``offset+1``, ..."""
    env = _env(env_id, env_kwargs)
    names = env.action_names
    returns = np.zeros((len(snapshots), rollouts))  # [n, M]
    steps = 0
    for j, (snapshot, budget) in enumerate(zip(snapshots, budgets)):
        for m in range(rollouts):
            rng = random.Random(stable_hash(seed, "mc", offset + j, m))
            env.restore(snapshot)
            env.rng.seed(rng.getrandbits(64))  # a fresh future, not the snapshot's
            total, discount, turn = 0.0, 1.0, 0
            while not env.done and turn < budget:
                total += discount * env.step(rng.choice(names)).reward
                discount *= gamma
                turn += 1
            returns[j, m] = total
            steps += turn
    return returns, steps


# ---------------------------------------------------------------------- policy actor
def mc_values_policy(
    actor: Actor,
    envs: Sequence[Env],
    policy: Policy,
    rollout_cfg: RolloutConfig,
    snapshots: Sequence[EnvSnapshot],
    *,
    rollouts: int,
    gamma: float,
    max_turns: int | Sequence[int],
    trajectory_prefix: str,
    seed: int = 0,
) -> MCEstimate:
    """V(s) of each snapshot under ``actor``: ``rollouts`` episodes per snapshot, played by
    ``rollout()`` from ``EpisodeRequest(start=...)`` in batches of ``len(envs)`` (the
    batch is the parallelism), each for at most ``max_turns`` turns (one int, or one
    per snapshot). Rollout m of snapshot i reseeds the env's dynamics RNG from
    ``stable_hash(seed, "mc-policy", i, m)``; the actor's own randomness is its own.

    Episodes that hit an infrastructure failure are left out of the means and counted
    in ``failed``; a state whose episodes all failed gets NaN. A snapshot of a finished
    episode, or a budget of 0, has value 0."""
    _check(rollouts, gamma)
    if not envs:
        raise ValueError("mc_values_policy needs at least one env")
    n = len(snapshots)
    budgets = _budgets(max_turns, n)
    probe = envs[0]
    requests: list[EpisodeRequest] = []
    owner: list[int] = []  # snapshot index of each request
    over = np.zeros(n, dtype=bool)  # [N] nothing left to play: value 0 exactly
    for i, (snapshot, budget) in enumerate(zip(snapshots, budgets)):
        probe.restore(snapshot)
        if probe.done or budget == 0:
            over[i] = True
            continue
        for m in range(rollouts):
            probe.restore(snapshot)
            probe.rng.seed(stable_hash(seed, "mc-policy", i, m))
            task = probe.current_task
            assert task is not None  # a snapshot of a started episode has its task
            tid = f"{trajectory_prefix}-{i}-{m}"
            requests.append(EpisodeRequest(task, -1, f"{trajectory_prefix}-{i}", tid, probe.snapshot(), budget))
            owner.append(i)
    returns: list[list[float]] = [[] for _ in range(n)]  # [N][<= M], infra failures left out
    steps = failed = 0
    for lo in range(0, len(requests), len(envs)):
        chunk = requests[lo : lo + len(envs)]
        trajectories, _ = rollout(actor, envs[: len(chunk)], chunk, rollout_cfg, policy)
        for i, traj in zip(owner[lo : lo + len(chunk)], trajectories):
            steps += traj.num_turns
            if traj.infra_failure is not None:
                failed += 1
            else:
                returns[i].append(sum(gamma**k * turn.reward for k, turn in enumerate(traj.turns)))
    values, stderr = np.full(n, np.nan), np.full(n, np.nan)  # [N] each
    for i, g in enumerate(returns):
        if over[i]:
            values[i] = stderr[i] = 0.0
        elif g:
            values[i] = np.mean(g)
            stderr[i] = np.std(g, ddof=1) / np.sqrt(len(g)) if len(g) > 1 else np.nan
    return MCEstimate(values, stderr, steps, failed)


# ---------------------------------------------------------------------- blending
def blend(v_critic: torch.Tensor | np.ndarray, v_mc: torch.Tensor | np.ndarray, w: float) -> torch.Tensor | np.ndarray:
    """(1 - w) * v_critic + w * v_mc: w = 0 is the learned critic alone, w = 1 the MC values."""
    if not 0.0 <= w <= 1.0:
        raise ValueError(f"blend weight w must be in [0, 1]; got {w}")
    return (1.0 - w) * v_critic + w * v_mc


# ---------------------------------------------------------------------- helpers
def _check(rollouts: int, gamma: float) -> None:
    if rollouts < 1:
        raise ValueError(f"rollouts must be >= 1; got {rollouts}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1]; got {gamma}")


def _budgets(max_turns: int | Sequence[int], n: int) -> list[int]:
    """One turn budget per snapshot (an int is shared by all)."""
    budgets = [int(max_turns)] * n if isinstance(max_turns, (int, np.integer)) else [int(b) for b in max_turns]
    if len(budgets) != n:
        raise ValueError(f"max_turns has {len(budgets)} budgets for {n} snapshots")
    if any(b < 0 for b in budgets):
        raise ValueError(f"max_turns must be >= 0; got {min(budgets)}")
    return budgets


def _estimate(returns: np.ndarray, steps: int) -> MCEstimate:
    """Means and standard errors of returns [N, M] (rows = states)."""
    m = returns.shape[1]
    stderr = returns.std(axis=1, ddof=1) / np.sqrt(m) if m > 1 else np.full(returns.shape[0], np.nan)
    return MCEstimate(returns.mean(axis=1), stderr, steps)


_ENVS: dict[tuple[str, str], Env] = {}  # per process: one env per (id, kwargs)


def _env(env_id: str, env_kwargs: dict[str, Any]) -> Env:
    key = (env_id, repr(sorted(env_kwargs.items())))
    if key not in _ENVS:
        _ENVS[key] = make(env_id, **env_kwargs)
    return _ENVS[key]


_POOL: ProcessPoolExecutor | None = None
_POOL_KEY: tuple[int, dict] | None = None  # (workers, registry at fork time)


def _pool(workers: int) -> ProcessPoolExecutor:
    """The process pool of ``workers`` forked workers, made on first use and kept; forked
    again if the env registry changed since (workers only know envs registered before the
    fork). Forked workers run env code only (no torch, no CUDA)."""
    global _POOL, _POOL_KEY
    key = (workers, list_envs())
    if _POOL is None or _POOL_KEY != key:
        _shutdown_pool()
        _POOL = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
        _POOL_KEY = key
    return _POOL


@atexit.register
def _shutdown_pool() -> None:
    global _POOL, _POOL_KEY
    if _POOL is not None:
        _POOL.shutdown(wait=True, cancel_futures=True)
    _POOL, _POOL_KEY = None, None


__all__ = ["MCEstimate", "blend", "mc_q_values", "mc_values", "mc_values_policy"]
