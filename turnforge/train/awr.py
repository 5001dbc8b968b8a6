"""The flywheel's step-level weighting (``flywheel.weighting=mc_awr``): advantage-weighted
regression on Monte-Carlo Q values from restarts of env snapshots.

The success filter keeps the episodes that succeeded; on stochastic dynamics (slippery ice,
2048's tiles) that imitates luck: a success does not mean its moves were good. Here every turn
of every scored episode of the round is trained on, weighted by how much better its action
was than the state's value:

1. after each wave of collection, the wave's distinct states (``turnforge.train.mc.distinct_states``:
   task, ``anchor_key`` and turn where the env has anchor keys) are restarted from their env
   snapshots, ``flywheel.mc_restarts`` times each, with a fresh future of the dynamics
   (``EpisodeRequest.reseed``): ``V(s)`` lets the tail policy play from the state, ``Q(s, a)``
   plays the action taken there first (each distinct action once per state), both for the turns
   the episode had left (``turnforge.critic.mc.estimate``). V and Q restarts of one state share
   their env draws (common random numbers), so their difference holds the action's effect, not
   the dice's. The tails are played by the policy being trained (``mc_tails=policy``, at the
   collection temperature), the frozen BC policy, or random actions. Every restart's env steps
   count in the round's budget (``env_steps_per_round``) and in the run's ``env_steps``, so a
   run with mc_awr collects fewer episodes than one with the success filter at the same budget;
2. ``A(s, a) = Q(s, a) - V(s)``, weight ``min(exp(A / awr_beta), awr_max_weight)``
   (``turnforge.algos.awr``, where the departures from the paper are listed);
3. the rft stage fits the weighted log-likelihood of the samples' action tokens.

Only the turns of the round's own plain episodes are used: no replay buffer, no filters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from turnforge.algos.awr import awr_weights, effective_sample_size
from turnforge.critic.mc import MCStart, estimate
from turnforge.policy.model import Policy, load_policy
from turnforge.seeding import stable_hash
from turnforge.train.mc import distinct_states, known_values, tail_actor
from turnforge.train.metrics import AWRStats
from turnforge.train.run_dir.failures import check_failures
from turnforge.train.run_dir.session import Session
from turnforge.types import Sample, Trajectory


@dataclass
class AWRRound:
    """One flywheel round's Monte-Carlo advantages, estimated wave by wave (``estimate``) and
    turned into weighted samples at the end (``training_data``)."""

    s: Session
    round: int
    tails: Policy | None  # who plays the restarts' tails (None: random actions)
    samples: list[Sample] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
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
        if who == "bc":
            tails = load_policy(s.run_dir / "checkpoints" / "bc", s.cfg.model.dtype)
            tails.model.eval()
        return cls(s, r, tails)

    def estimate(self, trajs: list[Trajectory]) -> int:
        """Advantages of every turn of ``trajs`` (a wave's episodes; infrastructure failures are
        left out); returns the env steps the restarts played."""
        cfg, fw, engine = self.s.cfg, self.s.cfg.flywheel, self.s.rollout_engine
        ok = [t for t in trajs if t.infra_failure is None and t.num_turns > 0]
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
        actor = tail_actor(engine, fw.mc_tails, self.tails, cfg.rollout.max_new_tokens, fw.temperature,
                           stable_hash(cfg.seed, "flywheel-awr-tails", self.round, wave))
        est = estimate(engine, starts, actor, rollouts=fw.mc_restarts, gamma=fw.mc_gamma,
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


__all__ = ["AWRRound"]
