"""The trainer's Monte-Carlo critic (ProAct's MC-Critic): values and MC-GRPO groups from
env snapshots, on top of the estimators in ``turnforge.critic.mc``.

- ``MonteCarlo.turn_values``: ``V_MC(s_k)`` for every turn of the iteration's episodes, from
  ``critic.mc_rollouts`` rollouts per distinct state (with the env's ``anchor_key``, states
  are deduplicated by task, anchor key and turn index, so the G episodes of a group share
  their first state's estimate). Rollouts run for the turns the episode had left, played by
  uniform random actions or by the frozen BC policy (``critic.mc_policy``).
- ``MonteCarlo.grpo_batch``: MC-GRPO. At ``rl.mc_grpo.states`` states drawn from the rollouts,
  the current policy samples G actions from the state's prompt; each distinct action is
  scored once by ``Q_MC(s, a) = mean_m [r_m + gamma * G_m(s'_m)]`` with tails played by
  ``critic.mc_policy`` (``mc_q_values``); Q values are normalised within the state's group
  like GRPO rewards.

Departures from ProAct: its MC-Critic calibrates a learned value with rollouts of the
policy being trained; here the rollout policy is random or the frozen BC policy (cheap
and stationary), and the blend with a learned critic is a fixed weight
(``critic.mc_weight``). BC-policy rollouts start from the snapshot's observation only,
so with ``history_window > 0`` they see no history on their first turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from turnforge.algos import grpo
from turnforge.config import TrainConfig
from turnforge.critic.mc import MCEstimate, MCStart, estimate
from turnforge.envpool.host import AfterState
from turnforge.errors import RunStopped
from turnforge.policy.model import Policy
from turnforge.rollout.actors import Actor, ActorInput, PolicyActor, RandomActor
from turnforge.rollout.engine import RolloutEngine
from turnforge.seeding import generator, rng, stable_hash
from turnforge.train.metrics import MCStats
from turnforge.train.run_dir.failures import check_failures
from turnforge.types import Sample, Trajectory


@dataclass(frozen=True)
class MonteCarlo:
    """Monte-Carlo estimates for the RL stage: ``engine`` plays the rollouts from env snapshots,
    ``policy`` is the policy MC-GRPO samples actions from, ``bc_policy`` the frozen BC policy
    that plays the tails with ``critic.mc_policy=bc``."""

    engine: RolloutEngine
    cfg: TrainConfig
    policy: Policy
    bc_policy: Policy | None = None

    def actor(self, tag: object) -> Actor:
        """Who plays Monte-Carlo rollouts (``critic.mc_policy``): uniform random actions or the frozen BC policy."""
        cfg = self.cfg
        seed = stable_hash(cfg.seed, "mc-actor", tag) if cfg.critic.mc_policy == "random" else stable_hash(cfg.seed, "mc", tag)
        return tail_actor(self.engine, cfg.critic.mc_policy, self.bc_policy, cfg.rollout.max_new_tokens, cfg.rollout.temperature, seed,
                          cfg.episode_seed("mc", tag))

    def turn_values(self, trajs: Sequence[Trajectory], it: int) -> tuple[dict[str, np.ndarray], MCStats]:
        """``V_MC(s_k)`` per turn (``trajectory_id -> [num_turns]``) and counters to log.
        With potential shaping the values are of the shaped return: ``V - c * Phi(s)``."""
        cfg = self.cfg
        states = distinct_states(trajs, dedup=self.engine.caps.anchor_key)
        starts = [MCStart(t.task, t.snapshots[k], cfg.rollout.max_turns - k) for t, k in states.first]
        index = states.index
        est = estimate(self.engine, starts, self.actor(("values", it)), rollouts=cfg.critic.mc_rollouts,
                       gamma=cfg.rl.gamma, seed=stable_hash(cfg.seed, "mc", ("values", it)), prefix=f"mc-{it}")
        check_failures(f"rl iteration {it + 1}, Monte-Carlo values", self.engine.env.env_id, est.failed, est.episodes, est.first_error,
                       cfg.max_failure_share, kind="Monte-Carlo rollouts")
        v = known_values(est, f"rl iteration {it + 1}, Monte-Carlo values", self.engine.env.env_id)
        out = {}
        for t in trajs:
            values = v[index[t.trajectory_id]].astype(np.float32)
            if cfg.rl.shaping == "potential":
                values = values - cfg.rl.shaping_coef * np.array([turn.potential for turn in t.turns], np.float32)
            out[t.trajectory_id] = values
        return out, mc_stats(est, len(starts))

    def grpo_batch(self, trajs: Sequence[Trajectory], it: int) -> tuple[list[tuple[Sample, float]], dict[str, str], MCStats]:
        """MC-GRPO samples with their advantages, each sample's group, and counters to log."""
        cfg, rl, policy = self.cfg, self.cfg.rl, self.policy
        turns = [(t, k) for t in trajs for k in range(t.num_turns)]
        if not turns:
            return [], {}, MCStats(states=0, env_steps=0, failed=0, value_stderr=0.0)
        pick = np.sort(rng(cfg.seed, "mc-grpo-states", it).choice(len(turns), size=min(rl.mc_grpo.states, len(turns)), replace=False))
        states = [turns[i] for i in pick]
        prompts = []
        for t, k in states:
            x = t.samples[k]
            prompts.append(tuple(x.token_ids[: int(np.argmax(x.loss_mask))].tolist()))
        g = rl.group_size
        sampler = PolicyActor(policy, cfg.rollout.max_new_tokens, cfg.rollout.temperature, generator(cfg.seed, "mc-grpo-sample", it))
        gens = sampler.act([ActorInput(p, t.task, t.trajectory_id, k, AfterState()) for (t, k), p in zip(states, prompts) for _ in range(g)])
        texts = policy.tokenizer.batch_decode([x.ids for x in gens], skip_special_tokens=True)

        # Q_MC of each distinct action at each state, all rollouts in one engine call
        starts, where = [], []  # where[i][j]: the start of state i's j-th sample
        for i, (t, k) in enumerate(states):
            distinct = list(dict.fromkeys(texts[i * g:(i + 1) * g]))
            first = len(starts)
            starts.extend(MCStart(t.task, t.snapshots[k], cfg.rollout.max_turns - k, (text,)) for text in distinct)
            where.append([first + distinct.index(text) for text in texts[i * g:(i + 1) * g]])
        est = estimate(self.engine, starts, self.actor(("q", it)), rollouts=cfg.critic.mc_rollouts, gamma=rl.gamma,
                       seed=stable_hash(cfg.seed, "mc-q", it), prefix=f"mcq-{it}")
        check_failures(f"rl iteration {it + 1}, MC-GRPO Q values", self.engine.env.env_id, est.failed, est.episodes, est.first_error,
                       cfg.max_failure_share, kind="Monte-Carlo rollouts")
        q = known_values(est, f"rl iteration {it + 1}, MC-GRPO Q values", self.engine.env.env_id)[np.concatenate(where)]  # [states * G]
        adv = grpo(torch.from_numpy(q), torch.arange(len(texts)) // g, std_normalize=rl.std_normalize).numpy()

        out_samples, group_of = [], {}
        for j, gen in enumerate(gens):
            i = j // g
            prompt = prompts[i]
            n = len(prompt)
            tid = f"mcg-{it}-{i}-{j % g}"
            x = Sample(
                token_ids=np.asarray(prompt + tuple(gen.ids), dtype=np.int64),
                loss_mask=np.concatenate([np.zeros(n, np.int8), np.ones(len(gen.ids), np.int8)]),
                logprobs=np.asarray([float("nan")] * n + list(gen.logprobs), dtype=np.float32),
                versions=np.asarray([-1] * n + [policy.version] * len(gen.ids), dtype=np.int32),
                trajectory_id=tid,
                turn_index=0,
            )
            out_samples.append((x, float(adv[j])))
            group_of[tid] = f"mcg-{it}-{i}"
        stats = mc_stats(est, len(states), distinct_actions=len(starts) / max(len(states), 1),
                       q_std=float(np.mean([np.std(q[i * g:(i + 1) * g]) for i in range(len(states))])))
        return out_samples, group_of, stats


@dataclass(frozen=True)
class DistinctStates:
    """The distinct states of a set of episodes (``distinct_states``)."""

    keys: list[tuple[str, str, int]]  # per state: (task id, anchor key, turn), or (trajectory id, "", turn)
    first: list[tuple[Trajectory, int]]  # per state: the first (episode, turn) found in it
    index: dict[str, np.ndarray]  # trajectory id -> [num_turns] int64, the state of each turn


def distinct_states(trajs: Sequence[Trajectory], *, dedup: bool) -> DistinctStates:
    """The states the episodes' turns were taken in, each once: with ``dedup`` (envs with an
    ``anchor_key``) turns of one task with equal anchor keys at one turn index are one state
    (the G episodes of a group share their first state), without it every turn is its own.
    The turn index stays in the key: it sets the turns left of the episode's budget."""
    unique: dict[tuple[str, str, int], int] = {}
    keys, first, index = [], [], {}
    for t in trajs:
        if len(t.snapshots) != t.num_turns:
            raise ValueError(f"trajectory {t.trajectory_id!r} has no env snapshots; roll out with keep_snapshots=True")
        idx = []
        for k, turn in enumerate(t.turns):
            key = (t.task.task_id, turn.anchor_key, k) if dedup else (t.trajectory_id, "", k)
            if key not in unique:
                unique[key] = len(keys)
                keys.append(key)
                first.append((t, k))
            idx.append(unique[key])
        index[t.trajectory_id] = np.asarray(idx, dtype=np.int64)
    return DistinctStates(keys, first, index)


def tail_actor(engine: RolloutEngine, who: str, policy: Policy | None, max_new_tokens: int, temperature: float,
               seed: int, episode_seed: int | None = None) -> Actor:
    """The actor of Monte-Carlo rollouts: ``who`` is 'random' (uniform random actions of the env's
    ``action_names``) or names a policy ('bc', 'policy'): ``policy``, sampled at ``temperature``
    (with ``episode_seed``, each rollout's draws from its own seed: ``TrainConfig.episode_seed``)."""
    if who == "random":
        return RandomActor(seed, engine.env.action_names)
    if policy is None:
        raise ValueError(f"Monte-Carlo rollouts played by {who!r} need that policy")
    return PolicyActor(policy, max_new_tokens, temperature, torch.Generator().manual_seed(seed), episode_seed=episode_seed)


def known_values(est: MCEstimate, stage: str, env_id: str) -> np.ndarray:
    """``est.values``, after refusing any start point whose rollouts all failed: its value is
    unknown, and scoring it 0 would be silently wrong, so the run stops (``RunStopped``)."""
    unknown = int(np.isnan(est.values).sum())
    if unknown:
        raise RunStopped(f"{stage}: {unknown} of {len(est.values)} start points on env {env_id!r} have no value "
                         f"(every Monte-Carlo rollout from them failed in the env machinery); first error: {est.first_error}")
    return est.values


def mc_stats(est: MCEstimate, states: int, **extra: float) -> MCStats:
    stderr = float(np.nanmean(est.stderr)) if len(est.stderr) and not np.all(np.isnan(est.stderr)) else 0.0
    return MCStats(states=states, env_steps=est.env_steps, failed=est.failed, value_stderr=stderr, rollouts=est.episodes, **extra)
