"""Credit assignment of the RL stage: trajectories -> per-turn advantages -> per-sample advantages.

``assign_credit`` is step 2 of an RL iteration, infrastructure failures already excluded. It
asks the estimator ``rl.advantage`` names (one class each in ``turnforge.algos.estimators``,
which owns its math and settings: grpo, rloo, reinforce_pp, gigpo, gae, mc_grpo, pass_at_k,
w_reinforce, psr), after computing what only the training stage can: a learned critic's values
(estimators that ``reads_values``), the KL penalties of ``rl.kl_mode=reward`` (``kl_penalties``)
and the Monte-Carlo rollouts from env snapshots (``turnforge.train.mc``). It then maps each
turn's advantage onto the samples (``sample_advantage``: one sample per turn, or a per-token
array for a sample of several turns), leaves out void and overlong episodes and, with
``rl.skip_zero_variance_groups``, groups whose advantages are all zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from turnforge.algos import discounted_returns, kl_estimate
from turnforge.algos.estimators import ESTIMATORS, CreditInputs, Penalties, turn_rewards
from turnforge.config import RLConfig, TrainConfig
from turnforge.critic.value import ValueModel, turn_values
from turnforge.rollout.context import CONTEXTS
from turnforge.train.common import score_samples
from turnforge.train.mc import MonteCarlo
from turnforge.train.metrics import MCStats
from turnforge.types import Sample, Trajectory


def monte_carlo_returns(trajs: Sequence[Trajectory], rl: RLConfig) -> dict[str, np.ndarray]:
    """Discounted return from every turn (``sum_j>=k gamma^(j-k) r_j``, shaped like the
    estimators see it): the critic's pretraining targets."""
    return {
        t.trajectory_id: discounted_returns(
            torch.from_numpy(turn_rewards(t, rl, rl.gamma)), torch.zeros(t.num_turns, dtype=torch.long), rl.gamma
        ).numpy().astype(np.float32)
        for t in trajs
    }


def action_turns(sample: Sample) -> np.ndarray:
    """Per token: the turn whose action it belongs to (the sample's ``turn_index`` for a
    per-turn sample; for a sample of several turns, ``first_turn + k`` on its k-th run of
    action tokens), -1 on context. A segment's trained summary is its last run: it counts as
    part of the turn it precedes, whose action is taken in the state it was written in."""
    mask = sample.loss_mask.astype(bool)
    if sample.turn_index >= 0:
        return np.where(mask, sample.turn_index, -1)
    starts = mask & ~np.concatenate([[False], mask[:-1]])
    run = np.cumsum(starts) - 1
    if sample.run_turns:  # fold: the runs' turns are recorded (a meta-action counts for the turn it precedes)
        if int(starts.sum()) != len(sample.run_turns):
            raise ValueError(f"sample {sample.trajectory_id!r}: {int(starts.sum())} action runs but {len(sample.run_turns)} run turns")
        return np.where(mask, np.asarray(sample.run_turns, dtype=np.int64)[np.clip(run, 0, None)], -1)
    return np.where(mask, sample.first_turn + run, -1)


def sample_advantage(sample: Sample, per_turn: np.ndarray) -> float | np.ndarray:
    """The advantage of one sample: its turn's value (one sample per turn), or, for a sample
    of several turns (a whole episode, a segment), a per-token array with each turn's value on
    that turn's run of action tokens (a segment's summary: the value of the turn after it, or
    of the last turn when the episode ended before that one)."""
    if sample.turn_index >= 0:
        return float(per_turn[sample.turn_index])
    turn = action_turns(sample)
    last = turn.max(initial=sample.first_turn - 1)
    # a sample without a summary ends with the episode; one with a summary ends before its next turn
    # a fold segment may end before the episode's last turn (a sub-task), or on a meta-action before it
    if sample.run_turns and last > len(per_turn) or not sample.run_turns and (
            (last + 1 != len(per_turn)) if sample.summary_tokens == 0 else last > len(per_turn)):
        raise ValueError(
            f"sample {sample.trajectory_id!r}: action runs up to turn {last} but {len(per_turn)} turns"
        )
    turn = np.minimum(turn, len(per_turn) - 1)
    return np.where(turn >= 0, np.asarray(per_turn, np.float32)[np.clip(turn, 0, None)], 0.0).astype(np.float32)


def drop_void(trajs: Sequence[Trajectory], rl: RLConfig) -> tuple[list[Trajectory], int]:
    """``rl.malformed=void``: the trajectories without an invalid action, and how many were left
    out (SimpleTIR filters whole trajectories with a void turn; this departs from it only in
    what counts as void, the env's ``invalid_action`` flag). ``penalty``: all of them, 0."""
    if rl.malformed != "void":
        return list(trajs), 0
    kept = [t for t in trajs if t.num_invalid == 0]
    return kept, len(trajs) - len(kept)


@dataclass(frozen=True)
class Credit:
    """One RL iteration's credit assignment (``assign_credit``)."""

    samples: list[tuple[Sample, float | np.ndarray]]  # what the update trains: (sample, advantage) pairs
    per_turn: dict[str, np.ndarray]  # trajectory_id -> [num_turns] advantages (empty for mc_grpo)
    groups: int  # groups the samples came from
    flat_groups: int  # of them, groups whose advantages are all zero (left out with rl.skip_zero_variance_groups)
    values: dict[str, np.ndarray] | None = None  # gae: the V(s_k) GAE used (learned, MC or blended)
    targets: dict[str, np.ndarray] | None = None  # gae: the critic's targets per turn
    critic_values: dict[str, np.ndarray] | None = None  # gae with a learned critic: its values at rollout time
    mc: MCStats | None = None  # counters of the Monte-Carlo rollouts (gae with critic.mc_weight > 0, mc_grpo)
    kl_penalty: float | None = None  # rl.kl_mode=reward: mean KL penalty per turn
    void_episodes: int = 0  # rl.malformed=void: episodes with a malformed turn, left out
    overlong_episodes: int = 0  # rollout.overlong_mask: episodes ended by rollout.max_summaries, no gradient
    by_policy: dict[str, "Credit"] | None = None  # agent.policies: each policy's own (turnforge.train.policies)


def assign_credit(
    trajs: list[Trajectory],
    cfg: TrainConfig,
    it: int,
    *,
    pad_id: int,
    critic: ValueModel | None = None,
    reference: torch.nn.Module | None = None,
    mc: MonteCarlo | None = None,
) -> Credit:
    """Advantages for iteration ``it``'s trajectories (no infrastructure failures among them) by
    ``rl.advantage`` (see the module docstring). ``critic``: the learned value model (``gae``);
    ``reference``: the frozen BC model (its KL is a reward penalty with ``rl.kl_mode=reward``);
    ``mc``: Monte-Carlo estimates from env snapshots (``gae`` with ``critic.mc_weight > 0``,
    ``mc_grpo``)."""
    rl = cfg.rl
    trajs, void = drop_void(trajs, rl)
    penalties = None
    if reference is not None and rl.kl_mode == "reward":
        penalties = kl_penalties(reference, trajs, pad_id, cfg.rollout.temperature, rl.kl_estimator, rl.kl_coef)
    estimator = ESTIMATORS[rl.advantage]
    critic_values = turn_values(critic, trajs, pad_id) if estimator.reads_values and critic is not None else None
    got = estimator.credit(trajs, cfg, CreditInputs(it, penalties, critic_values, mc))
    kl_penalty = float(np.mean(np.concatenate([penalties[t.trajectory_id] for t in trajs]))) if penalties and trajs else None
    pairs, group_of = got.pairs, got.group_of
    if pairs is None:
        pairs = [(x, sample_advantage(x, got.per_turn[t.trajectory_id])) for t in trajs for x in t.samples]
        group_of = {x.trajectory_id: t.group_id for t in trajs for x in t.samples}
    assert group_of is not None
    groups = set(group_of.values())
    flat = {g for g in groups if all(np.all(np.abs(a) < 1e-8) for x, a in pairs if group_of[x.trajectory_id] == g)}
    kept = [(x, a) for x, a in pairs if not (rl.skip_zero_variance_groups and group_of[x.trajectory_id] in flat)]
    overlong = overlong_episodes(trajs, cfg)
    kept = [(x, a) for x, a in kept if x.trajectory_id not in overlong]
    return Credit(kept, got.per_turn, len(groups), len(flat), got.values, got.targets, got.critic_values, got.mc, kl_penalty,
                  void, len(overlong))


def overlong_episodes(trajs: Sequence[Trajectory], cfg: TrainConfig) -> set[str]:
    """``rollout.overlong_mask`` (SUPO): the ids of the episodes a ``summarize`` context ended at
    ``rollout.max_summaries``. Their advantages still enter their group's baseline above; their
    samples get no gradient, so writing summaries forever is not reinforced (nor punished)."""
    r = cfg.rollout
    if not CONTEXTS[r.context].writes_summaries or not r.overlong_mask:
        return set()
    return {t.trajectory_id for t in trajs if t.truncation_reason == "summary_limit"}


def kl_penalties(
    reference: torch.nn.Module, trajs: list[Trajectory], pad_id: int, temperature: float, estimator: str, coef: float,
) -> Penalties:
    """``rl.kl_mode=reward``: per turn, ``coef`` times the KL estimate to the reference
    summed over the turn's action tokens (sampling logprobs against the reference's)."""
    out = {t.trajectory_id: np.zeros(t.num_turns) for t in trajs}
    for scored in score_samples(reference, [x for t in trajs for x in t.samples], pad_id, temperature):
        batch = scored.batch
        kl = (kl_estimate(batch.old_logprobs, scored.logprobs, estimator) * batch.mask).numpy()
        for i, x in enumerate(scored.samples):
            turn = np.minimum(action_turns(x), len(out[x.trajectory_id]) - 1)  # a summary whose turn never came: the last
            np.add.at(out[x.trajectory_id], turn[turn >= 0], coef * kl[i, : len(x)][turn >= 0])
    return out
