"""The flywheel's step-level weighting (``flywheel.weighting=mc_awr`` or ``group_awr``):
advantage-weighted regression on the round's own episodes.

The success filter keeps the episodes that succeeded; on stochastic dynamics (slippery ice,
2048's tiles) that imitates luck: a success does not mean its moves were good. Here every turn
of every scored episode of the round is trained on, weighted by how much better its action
was than the state's value, ``min(exp(A / awr_beta), awr_max_weight)`` (``turnforge.algos.awr``,
where the departures from the paper are listed). Two estimates of ``A(s, a)``:

- ``mc_awr``: after each wave of collection, the wave's distinct states
  (``turnforge.train.mc.distinct_states``: task, ``anchor_key`` and turn where the env has
  anchor keys) are restarted from their env snapshots, ``flywheel.mc_restarts`` times each, with
  a fresh future of the dynamics (``EpisodeRequest.reseed``): ``V(s)`` lets the tail policy play
  from the state, ``Q(s, a)`` plays the action taken there first (each distinct action once per
  state), both for the turns the episode had left (``turnforge.critic.mc.estimate``). V and Q
  restarts of one state share their env draws (common random numbers), so their difference holds
  the action's effect, not the dice's. The tails are played by the policy being trained
  (``mc_tails=policy``, at the collection temperature or ``mc_tail_temperature``), the frozen
  BC policy, or random actions.
  Every restart's env steps count in the round's budget (``env_steps_per_round``) and in the
  run's ``env_steps``: at one budget, mc_awr collects far fewer episodes than the success filter.
- ``group_awr`` (GiGPO's anchor-state grouping, no restarts): over the turns of the task's
  group taken in the same state (task and ``anchor_key``, pooled over turn indices as GiGPO
  pools them), ``V(s)`` is their mean return and ``Q(s, a)`` the mean return of those that took
  action a, a return counted from the turn to the end of its episode. It costs no env steps; a
  state visited once has no baseline and its turn is left out.

No replay buffer, no filters: the rft stage fits the weighted log-likelihood of the samples'
action tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from turnforge.algos.awr import anchor_state_advantages, awr_weights, effective_sample_size
from turnforge.critic.mc import MCStart, estimate
from turnforge.policy.model import Policy, load_policy, resolve_device
from turnforge.seeding import stable_hash
from turnforge.train.mc import distinct_states, known_values, tail_actor
from turnforge.train.metrics import AWRStats
from turnforge.train.run_dir.failures import check_failures
from turnforge.train.session import Session
from turnforge.types import Sample, Trajectory


@dataclass
class AWRRound:
    """One flywheel round's advantages, estimated wave by wave (``estimate``; mc_awr's restarts)
    and turned into weighted samples at the end (``training_data``)."""

    s: Session
    round: int
    tails: Policy | None  # who plays the restarts' tails (None: random actions)
    samples: list[Sample] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    episodes: list[Trajectory] = field(default_factory=list)  # group_awr: the round's scored episodes
    waves: int = 0
    states: int = 0
    actions: int = 0
    restarts: int = 0
    failed: int = 0
    env_steps: int = 0
    stderr: list[float] = field(default_factory=list)

    @classmethod
    def start(cls, s: Session, r: int) -> AWRRound:
        """Round ``r``'s estimator; with ``mc_tails=bc`` the frozen BC policy (``checkpoints/bc``) plays the tails."""
        who = s.cfg.flywheel.mc_tails
        tails = {"policy": s.policy, "random": None}.get(who)
        if who == "bc" and s.cfg.flywheel.weighting == "mc_awr":
            tails = load_policy(s.run.checkpoint("bc"), s.cfg.model.dtype, resolve_device(s.cfg.model.device))
            tails.model.eval()
        return cls(s, r, tails)

    def estimate(self, trajs: list[Trajectory]) -> int:
        """Advantages of every turn of ``trajs`` (a wave's episodes; infrastructure failures are
        left out); returns the env steps the restarts played (0 for group_awr, which only keeps
        the episodes until ``training_data``)."""
        cfg, fw, engine = self.s.cfg, self.s.cfg.flywheel, self.s.rollout_engine
        ok = [t for t in trajs if t.infra_failure is None and t.num_turns > 0]
        if fw.weighting == "group_awr":
            self.episodes.extend(ok)
            return 0
        if not ok:
            return 0
        states = distinct_states(ok, dedup=engine.caps.anchor_key)
        # V(s): one start per state; Q(s, a): one per distinct action taken in it; both share the state's env draws
        starts = [MCStart(t.task, t.snapshots[k], cfg.rollout.max_turns - k, noise_key=key)
                  for key, (t, k) in zip(states.keys, states.first)]
        q_start: dict[tuple[int, str], int] = {}
        for t in ok:
            for k, turn in enumerate(t.turns):
                i = int(states.index[t.trajectory_id][k])
                if (i, turn.action_text) not in q_start:
                    q_start[(i, turn.action_text)] = len(starts)
                    starts.append(MCStart(t.task, t.snapshots[k], cfg.rollout.max_turns - k, (turn.action_text,),
                                          noise_key=states.keys[i]))
        wave, stage = self.waves, f"flywheel round {self.round + 1}, mc_awr restarts"
        temperature = fw.mc_tail_temperature if fw.mc_tail_temperature is not None else fw.temperature
        actor = tail_actor(engine, fw.mc_tails, self.tails, cfg.rollout.max_new_tokens, temperature,
                           stable_hash(cfg.seed, "flywheel-awr-tails", self.round, wave),
                           cfg.episode_seed("flywheel-awr-tails", self.round, wave))
        est = estimate(engine, starts, actor, rollouts=fw.mc_restarts, gamma=fw.awr_gamma,
                       seed=stable_hash(cfg.seed, "flywheel-awr", self.round, wave), prefix=f"awr-{self.round}-{wave}")
        check_failures(stage, engine.env.env_id, est.failed, est.episodes, est.first_error, cfg.max_failure_share,
                       kind="Monte-Carlo restarts")
        values = known_values(est, stage, engine.env.env_id)  # [states + actions]: V first, then Q
        for t in ok:
            by_turn = {x.turn_index: x for x in t.samples}
            for k, turn in enumerate(t.turns):
                if k not in by_turn:
                    continue
                i = int(states.index[t.trajectory_id][k])
                self.samples.append(by_turn[k])
                self.advantages.append(float(values[q_start[(i, turn.action_text)]] - values[i]))
        self.waves += 1
        self.states += len(states.keys)
        self.actions += len(q_start)
        self.restarts += est.episodes
        self.failed += est.failed
        self.env_steps += est.env_steps
        self.stderr.extend(x for x in est.stderr.tolist() if np.isfinite(x))
        return est.env_steps

    def training_data(self) -> tuple[list[Sample], list[float], AWRStats]:
        """The round's samples, their weights ``min(exp(A / beta), max_weight)`` and the round's counters."""
        fw = self.s.cfg.flywheel
        if fw.weighting == "group_awr":
            self._group_advantages()
        adv = torch.tensor(self.advantages, dtype=torch.float64)  # [N]
        weights = awr_weights(adv, fw.awr_beta, fw.awr_max_weight)  # [N]
        n = len(self.samples)
        stats = AWRStats(
            states=self.states, actions=self.actions, restarts=self.restarts, failed=self.failed, env_steps=self.env_steps,
            samples=n, value_stderr=round(float(np.mean(self.stderr)), 4) if self.stderr else 0.0,
            mean_abs_advantage=round(float(adv.abs().mean()), 4) if n else 0.0,
            positive_share=round(float((adv > 0).double().mean()), 4) if n else 0.0,
            mean_weight=round(float(weights.mean()), 4) if n else 0.0,
            clipped_share=round(float((weights >= fw.awr_max_weight * (1 - 1e-6)).double().mean()), 4) if n else 0.0,
            ess=round(effective_sample_size(weights), 4) if n else 0.0,
        )
        return list(self.samples), weights.tolist(), stats


    def _group_advantages(self) -> None:
        """group_awr: every turn of the round's episodes taken in a state the group visited more than
        once, with ``Q(s, a) - V(s)`` from the returns of those visits."""
        rewards, episode, state, action, samples = [], [], [], [], []
        states: dict[tuple[str, str], int] = {}
        actions: dict[str, int] = {}
        for e, t in enumerate(self.episodes):
            by_turn = {x.turn_index: x for x in t.samples}
            for k, turn in enumerate(t.turns):
                rewards.append(turn.reward)
                episode.append(e)
                state.append(states.setdefault((t.task.task_id, turn.anchor_key), len(states)))
                action.append(actions.setdefault(turn.action_text, len(actions)))
                samples.append(by_turn.get(k))
        if not rewards:
            return
        adv, visits = anchor_state_advantages(torch.tensor(rewards), torch.tensor(episode), torch.tensor(state),
                                              torch.tensor(action), self.s.cfg.flywheel.awr_gamma)
        used = set()
        for i, (x, a, n) in enumerate(zip(samples, adv.tolist(), visits.tolist())):
            if x is not None and n > 1:
                self.samples.append(x)
                self.advantages.append(a)
                used.add((state[i], action[i]))
        self.states = len({sid for sid, _ in used})
        self.actions = len(used)

__all__ = ["AWRRound"]
