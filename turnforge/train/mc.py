"""The trainer's Monte-Carlo critic (ProAct's MC-Critic): values and MC-GRPO groups from
env snapshots, on top of the estimators in ``turnforge.critic.mc``.

- ``mc_turn_values``: ``V_MC(s_k)`` for every turn of the iteration's episodes, from
  ``critic.mc_rollouts`` rollouts per distinct state (states are deduplicated by task,
  anchor key and turn index, so the G episodes of a group share their first state's
  estimate). Rollouts run for the turns the episode had left, played by uniform random
  actions or by the frozen BC policy (``critic.mc_policy``).
- ``mc_grpo_batch``: MC-GRPO. At ``rl.mc_grpo_states`` states drawn from the rollouts,
  the current policy samples G actions from the state's prompt; each distinct action is
  scored once by ``Q_MC(s, a) = mean_m [r_m + gamma * G_m(s'_m)]`` with random-policy
  tails (``mc_q_values``); Q values are normalised within the state's group like GRPO
  rewards.

Departures from ProAct: its MC-Critic calibrates a learned value with rollouts of the
policy being trained; here the rollout policy is random or the frozen BC policy (cheap
and stationary), and the blend with a learned critic is a fixed weight
(``critic.mc_weight``). BC-policy rollouts start from the snapshot's observation only,
so with ``history_window > 0`` they see no history on their first turn.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from turnforge.algos import grpo
from turnforge.critic.mc import MCEstimate, mc_q_values, mc_values, mc_values_policy
from turnforge.envs.base import EnvSnapshot, stable_hash
from turnforge.policy.generate import sample
from turnforge.policy.model import Policy
from turnforge.rollout.runner import PolicyActor
from turnforge.train.common import generator, rng
from turnforge.train.session import Session
from turnforge.types import Sample, Trajectory


def estimate_values(
    s: Session, snapshots: Sequence[EnvSnapshot], remaining: Sequence[int], tag: object, bc_policy: Policy | None
) -> MCEstimate:
    """``V_MC`` of each snapshot under ``critic.mc_policy``, ``remaining[i]`` turns left."""
    cfg, c = s.cfg, s.cfg.critic
    if c.mc_policy == "random":
        return mc_values(
            cfg.env.id, cfg.env.kwargs, snapshots, rollouts=c.mc_rollouts, gamma=cfg.rl.gamma, max_turns=list(remaining),
            seed=stable_hash(cfg.seed, "mc", tag), workers=c.mc_workers,
        )
    if bc_policy is None:
        raise ValueError("critic.mc_policy=bc needs the frozen BC policy")
    actor = PolicyActor(bc_policy, cfg.rollout.max_new_tokens, cfg.rollout.temperature, generator(cfg.seed, "mc", tag))
    return mc_values_policy(
        actor, s.envs, bc_policy, cfg.rollout, snapshots, rollouts=c.mc_rollouts, gamma=cfg.rl.gamma,
        max_turns=list(remaining), trajectory_prefix=f"mc-{tag}",
    )


def mc_turn_values(
    s: Session, trajs: Sequence[Trajectory], it: int, bc_policy: Policy | None
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """``V_MC(s_k)`` per turn (``trajectory_id -> [num_turns]``) and counters to log.
    With potential shaping the values are of the shaped return: ``V - c * Phi(s)``."""
    cfg = s.cfg
    unique: dict[tuple[str, str, int], int] = {}
    snapshots, remaining, index = [], [], {}
    for t in trajs:
        if len(t.snapshots) != t.num_turns:
            raise ValueError(f"trajectory {t.trajectory_id!r} has no env snapshots; roll out with keep_snapshots=True")
        idx = []
        for k, (turn, snap) in enumerate(zip(t.turns, t.snapshots)):
            key = (t.task.task_id, turn.anchor_key, k)
            if key not in unique:
                unique[key] = len(snapshots)
                snapshots.append(snap)
                remaining.append(cfg.rollout.max_turns - k)
            idx.append(unique[key])
        index[t.trajectory_id] = np.asarray(idx, dtype=np.int64)
    est = estimate_values(s, snapshots, remaining, ("values", it), bc_policy)
    v = np.nan_to_num(est.values, nan=0.0)
    out = {}
    for t in trajs:
        values = v[index[t.trajectory_id]].astype(np.float32)
        if cfg.rl.shaping == "potential":
            values = values - cfg.rl.shaping_coef * np.array([turn.potential for turn in t.turns], np.float32)
        out[t.trajectory_id] = values
    stats = {
        "mc_states": float(len(snapshots)),
        "mc_env_steps": float(est.env_steps),
        "mc_value_stderr": float(np.nanmean(est.stderr)) if len(snapshots) else 0.0,
    }
    return out, stats


def mc_grpo_batch(
    s: Session, trajs: Sequence[Trajectory], it: int
) -> tuple[list[tuple[Sample, float]], dict[str, str], dict[str, float]]:
    """MC-GRPO samples with their advantages, each sample's group, and counters to log."""
    cfg, rl, policy = s.cfg, s.cfg.rl, s.policy
    turns = [(t, k) for t in trajs for k in range(t.num_turns)]
    if not turns:
        return [], {}, {"mc_states": 0.0, "mc_env_steps": 0.0}
    pick = np.sort(rng(cfg.seed, "mc-grpo-states", it).choice(len(turns), size=min(rl.mc_grpo_states, len(turns)), replace=False))
    states = [turns[i] for i in pick]
    prompts = []
    for t, k in states:
        x = t.samples[k]
        prompts.append(x.token_ids[: int(np.argmax(x.loss_mask))].tolist())
    g = rl.group_size
    gens = sample(
        policy.model, [p for p in prompts for _ in range(g)], max_new_tokens=cfg.rollout.max_new_tokens,
        stop_ids=policy.stop_ids, pad_id=policy.pad_id, temperature=cfg.rollout.temperature,
        generator=generator(cfg.seed, "mc-grpo-sample", it),
    )
    texts = policy.tokenizer.batch_decode([x.ids for x in gens], skip_special_tokens=True)

    # Q_MC of each distinct action at each state (turnforge.critic.mc.mc_q_values)
    q, steps, distinct_actions = np.zeros(len(texts)), 0, 0
    for i, (t, k) in enumerate(states):
        group = texts[i * g:(i + 1) * g]
        distinct = list(dict.fromkeys(group))
        est = mc_q_values(
            cfg.env.id, cfg.env.kwargs, t.snapshots[k], distinct, rollouts=cfg.critic.mc_rollouts, gamma=rl.gamma,
            max_turns=cfg.rollout.max_turns - k, seed=stable_hash(cfg.seed, "mc-q", it, i), workers=cfg.critic.mc_workers,
        )
        q[i * g:(i + 1) * g] = [est.values[distinct.index(text)] for text in group]
        steps += est.env_steps
        distinct_actions += len(distinct)
    adv = grpo(torch.from_numpy(q), torch.arange(len(texts)) // g, std_normalize=rl.std_normalize).numpy()

    out_samples, group_of = [], {}
    for j, gen in enumerate(gens):
        i = j // g
        prompt = prompts[i]
        n = len(prompt)
        tid = f"mcg-{it}-{i}-{j % g}"
        x = Sample(
            token_ids=np.asarray(prompt + list(gen.ids), dtype=np.int64),
            loss_mask=np.concatenate([np.zeros(n, np.int8), np.ones(len(gen.ids), np.int8)]),
            logprobs=np.asarray([float("nan")] * n + list(gen.logprobs), dtype=np.float32),
            versions=np.asarray([-1] * n + [policy.version] * len(gen.ids), dtype=np.int32),
            trajectory_id=tid,
            turn_index=0,
        )
        out_samples.append((x, float(adv[j])))
        group_of[tid] = f"mcg-{it}-{i}"
    stats = {
        "mc_states": float(len(states)),
        "mc_env_steps": float(steps),
        "mc_distinct_actions": distinct_actions / max(len(states), 1),
        "mc_q_std": float(np.mean([np.std(q[i * g:(i + 1) * g]) for i in range(len(states))])),
    }
    return out_samples, group_of, stats
