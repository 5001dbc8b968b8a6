"""Advantage estimators (``rl.advantage``): one class each, in one registry, ``ESTIMATORS``.

Each class declares what it needs and owns its math, so the config, the start checks, the
set-up and the RL loop ask the object instead of comparing names:

- ``returns_baseline``: advantages from the episodes' rewards and a group baseline alone
  (what agent runs and the flywheel's ``rl`` stage take);
- ``reads_values``: state values from the ``critic`` section (``critic.enabled``,
  ``critic.mc_weight`` apply to it and to no other);
- ``monte_carlo(cfg)``: Monte-Carlo rollouts from env snapshots;
- ``with_images``: works with a vision-language policy;
- ``conflict(cfg)``: its own cross-key rules (one line, or None);
- ``requirements(cfg)``: the env capabilities it needs (checked at start, before any model work);
- ``credit(...)``: per-turn advantages (and, for GAE, the values and critic targets; for
  MC-GRPO, its own sample groups).

The config imports this module to validate ``rl.advantage`` and to run the rules, so the
declarations import nothing heavy; the math imports torch when it runs. Adding an estimator is
one class here, registered in ``ESTIMATORS``, plus its test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

    from turnforge.config import RLConfig, TrainConfig
    from turnforge.critic.value import ValueModel
    from turnforge.train.mc import MonteCarlo
    from turnforge.train.metrics import MCStats
    from turnforge.types import Sample, Trajectory

Penalties = dict[str, np.ndarray]  # trajectory_id -> [num_turns], subtracted from turn rewards


class Requirement(NamedTuple):
    """An env capability an option needs (``turnforge.envs.base.Capabilities.require``)."""

    capability: str
    what: str  # the option that needs it, as the error names it
    fix: str | None = None  # the option to change instead of implementing the method


@dataclass
class EstimatorCredit:
    """What an estimator computed for one iteration's trajectories."""

    per_turn: dict[str, np.ndarray]  # trajectory_id -> [num_turns] (empty for mc_grpo)
    pairs: list[tuple[Sample, float | np.ndarray]] | None = None  # mc_grpo's own (sample, advantage) pairs
    group_of: dict[str, str] | None = None  # mc_grpo: sample's trajectory_id -> its state group
    values: dict[str, np.ndarray] | None = None  # gae: the V(s_k) GAE used (learned, MC or blended)
    targets: dict[str, np.ndarray] | None = None  # gae: the critic's targets per turn
    critic_values: dict[str, np.ndarray] | None = None  # gae with a learned critic: its values at rollout time
    mc: MCStats | None = None  # counters of the Monte-Carlo rollouts


class Estimator:
    """One advantage estimator. Subclasses set the class attributes and override ``credit``
    (or ``turn_advantages``, which the default ``credit`` calls)."""

    name: ClassVar[str]
    help: ClassVar[str]  # a few words for the config key's description
    returns_baseline: ClassVar[bool] = False
    reads_values: ClassVar[bool] = False
    with_images: ClassVar[bool] = True

    def monte_carlo(self, cfg: TrainConfig) -> bool:
        return False

    def conflict(self, cfg: TrainConfig) -> str | None:
        return None

    def requirements(self, cfg: TrainConfig) -> list[Requirement]:
        return []

    def turn_advantages(self, trajs: Sequence[Trajectory], rl: RLConfig,
                        penalties: Penalties | None = None) -> dict[str, np.ndarray]:
        raise NotImplementedError(f"rl.advantage={self.name} assigns credit with more than the episodes' rewards")

    def credit(self, trajs: Sequence[Trajectory], cfg: TrainConfig, it: int, *, penalties: Penalties | None,
               critic: ValueModel | None, mc: MonteCarlo | None, pad_id: int) -> EstimatorCredit:
        return EstimatorCredit(self.turn_advantages(trajs, cfg.rl, penalties))


def _groups(trajs: Sequence[Trajectory]) -> tuple[dict[str, int], torch.Tensor]:
    """Each group id's index (in order of first appearance) and every trajectory's group index."""
    import torch

    groups = {g: i for i, g in enumerate(dict.fromkeys(t.group_id for t in trajs))}
    return groups, torch.tensor([groups[t.group_id] for t in trajs])


def _on_every_turn(trajs: Sequence[Trajectory], per_episode) -> dict[str, np.ndarray]:
    return {t.trajectory_id: np.full(t.num_turns, float(a), np.float32) for t, a in zip(trajs, per_episode)}


class _EpisodeReturn(Estimator):
    """Critic-free: the undiscounted (shaped, penalised) episode return against a group baseline,
    the same value on every turn."""

    returns_baseline = True

    def per_episode(self, returns: torch.Tensor, group_of: torch.Tensor, rl: RLConfig) -> torch.Tensor:
        raise NotImplementedError

    def turn_advantages(self, trajs, rl, penalties=None):
        import torch

        from turnforge.train.credit import turn_rewards

        if not trajs:
            return {}
        _, group_of = _groups(trajs)
        returns = torch.tensor([turn_rewards(t, rl, 1.0, penalties).sum() for t in trajs], dtype=torch.float64)
        return _on_every_turn(trajs, self.per_episode(returns, group_of, rl))


class GRPO(_EpisodeReturn):
    name, help = "grpo", "group-normalised episode return"

    def per_episode(self, returns, group_of, rl):
        from turnforge.algos import grpo

        return grpo(returns, group_of, std_normalize=rl.std_normalize)


class RLOO(_EpisodeReturn):
    name, help = "rloo", "leave-one-out baseline"

    def per_episode(self, returns, group_of, rl):
        from turnforge.algos import rloo

        return rloo(returns, group_of)


class ReinforcePP(_EpisodeReturn):
    name, help = "reinforce_pp", "group baseline, batch std"

    def per_episode(self, returns, group_of, rl):
        from turnforge.algos import reinforce_pp

        return reinforce_pp(returns, group_of)


class GiGPO(Estimator):
    """GRPO's episode term plus a step-level term from the turns of the group that acted in the
    same env state (``anchor_key``), each turn its own value."""

    name, help = "gigpo", "grpo plus step-level anchor-state groups"
    returns_baseline = True

    def requirements(self, cfg):
        return [Requirement("anchor_key", "GiGPO's step-level groups (rl.advantage=gigpo)")]

    def turn_advantages(self, trajs, rl, penalties=None):
        import torch

        from turnforge.algos import gigpo
        from turnforge.train.credit import turn_rewards

        if not trajs:
            return {}
        groups, _ = _groups(trajs)
        anchors: dict[str, int] = {}
        steps = [(e, t, turn) for e, t in enumerate(trajs) for turn in t.turns]
        adv = gigpo(
            torch.from_numpy(np.concatenate([turn_rewards(t, rl, rl.gamma, penalties) for t in trajs])),
            torch.tensor([e for e, _, _ in steps]),
            torch.tensor([groups[t.group_id] for _, t, _ in steps]),
            torch.tensor([anchors.setdefault(turn.anchor_key, len(anchors)) for _, _, turn in steps]),
            gamma=rl.gamma, omega=rl.gigpo_omega, std_normalize=rl.std_normalize,
        ).numpy()
        out, k = {}, 0
        for t in trajs:
            out[t.trajectory_id] = adv[k:k + t.num_turns]
            k += t.num_turns
        return out


def _monte_carlo_requirements(cfg: TrainConfig, what: str) -> list[Requirement]:
    reqs = [Requirement("snapshot", what)]
    if cfg.critic.mc_policy == "random":
        reqs.append(Requirement("random_action", f"{what} with random rollouts", "set critic.mc_policy=bc"))
    return reqs


class GAE(Estimator):
    """PPO's GAE over the turns of each episode with state values from the learned critic,
    Monte-Carlo rollouts from env snapshots, or their blend (``critic`` section)."""

    name, help = "gae", "PPO: GAE over turns with state values from the critic section"
    reads_values = True

    def monte_carlo(self, cfg):
        return cfg.critic.mc_weight > 0

    def conflict(self, cfg):
        if not cfg.critic.enabled and cfg.critic.mc_weight == 0:
            return ("rl.advantage=gae needs state values: set critic.enabled=true (learned critic) or "
                    "critic.mc_weight=1 (MC-critic)")
        return None

    def requirements(self, cfg):
        if not self.monte_carlo(cfg):
            return []
        return _monte_carlo_requirements(cfg, f"Monte-Carlo values (critic.mc_weight={cfg.critic.mc_weight})")

    def credit(self, trajs, cfg, it, *, penalties, critic, mc, pad_id):
        from turnforge.critic.value import turn_values
        from turnforge.train.credit import gae_turn_advantages, state_values

        critic_values = turn_values(critic, trajs, pad_id) if critic is not None else None
        values, mc_stats = state_values(list(trajs), it, critic_values, cfg.critic.mc_weight, mc)
        per_turn, targets = gae_turn_advantages(trajs, values, cfg.rl, cfg.critic, penalties)
        return EstimatorCredit(per_turn, values=values, targets=targets, critic_values=critic_values, mc=mc_stats)


class MCGRPO(Estimator):
    """The rollouts only supply states: at ``rl.mc_grpo_states`` of them the policy samples G
    actions, each scored by ``Q_MC(s, a)`` from env snapshots and normalised within the state's
    group (``turnforge.train.mc``)."""

    name = "mc_grpo"
    help = "G sampled actions at one state scored by Monte-Carlo Q values, normalised within the state"
    with_images = False

    def monte_carlo(self, cfg):
        return True

    def conflict(self, cfg):
        if cfg.rollout.context != "window":
            return f"rl.advantage=mc_grpo samples actions at single states and needs rollout.context=window (got {cfg.rollout.context})"
        if cfg.rl.kl_mode == "reward":
            return "rl.kl_mode=reward penalises episode turns; rl.advantage=mc_grpo scores single actions: use rl.kl_mode=loss"
        if cfg.rl.shaping != "none":
            return "rl.shaping=potential does not apply to rl.advantage=mc_grpo (its Q values come from env rollouts)"
        if cfg.reward.judge.enabled or (cfg.agent.entrypoint is not None and cfg.agent.reward == "judge"):
            return "rl.advantage=mc_grpo scores single actions by env rollouts; a judge scores whole episodes (use grpo)"
        return None

    def requirements(self, cfg):
        return _monte_carlo_requirements(cfg, "MC-GRPO (rl.advantage=mc_grpo)")

    def credit(self, trajs, cfg, it, *, penalties, critic, mc, pad_id):
        assert mc is not None  # the config and the start checks guarantee snapshots
        pairs, group_of, mc_stats = mc.grpo_batch(list(trajs), it)
        return EstimatorCredit({}, pairs=pairs, group_of=group_of, mc=mc_stats)


class _SuccessFlag(Estimator):
    """Critic-free on the env's success flag (binary), not the return: rewards that shaping,
    a KL penalty or a judge change are not what it reads."""

    def per_episode(self, success: torch.Tensor, group_of: torch.Tensor, rl: RLConfig) -> torch.Tensor:
        raise NotImplementedError

    def conflict(self, cfg):
        rl = cfg.rl
        if rl.shaping != "none" or rl.kl_mode == "reward":
            what = "rl.shaping=potential" if rl.shaping != "none" else "rl.kl_mode=reward"
            return f"{what} changes rewards; rl.advantage={self.name} scores the env's success flag only (use grpo or rl.kl_mode=loss)"
        if cfg.reward.judge.enabled:
            return f"rl.advantage={self.name} scores the env's success flag, not the judge's reward (use grpo)"
        return None

    def turn_advantages(self, trajs, rl, penalties=None):
        import torch

        if not trajs:
            return {}
        _, group_of = _groups(trajs)
        return _on_every_turn(trajs, self.per_episode(torch.tensor([t.success for t in trajs]), group_of, rl))


class PassAtK(_SuccessFlag):
    name, help = "pass_at_k", "the closed-form pass@k advantage of the group's successes, k = rl.pass_k"

    def conflict(self, cfg):
        rl, fw = cfg.rl, cfg.flywheel
        if rl.pass_k > rl.group_size:
            return (f"rl.pass_k={rl.pass_k} is larger than rl.group_size={rl.group_size}: pass@k is estimated from the "
                    f"group's samples; set rl.pass_k <= {rl.group_size} or raise rl.group_size")
        if fw.rounds > 0 and "rl" in fw.stages and rl.pass_k > fw.group_size:
            return (f"rl.pass_k={rl.pass_k} is larger than flywheel.group_size={fw.group_size}, the groups of the "
                    f"flywheel's 'rl' stage; set rl.pass_k <= {fw.group_size} or raise flywheel.group_size")
        return super().conflict(cfg)

    def per_episode(self, success, group_of, rl):
        from turnforge.algos import pass_at_k_advantage

        return pass_at_k_advantage(success, group_of, rl.pass_k)


class WReinforce(_SuccessFlag):
    name, help = "w_reinforce", "+rl.w_reinforce_lambda for a success, -1 for a failure, no baseline"

    def per_episode(self, success, group_of, rl):
        from turnforge.algos import w_reinforce

        return w_reinforce(success, rl.w_reinforce_lambda)


class PSR(_SuccessFlag):
    """Positive sample reinforcement (Zhu et al. 2025): REINFORCE on the successes alone, the
    failures weigh nothing. The counterpart of ``w_reinforce`` (and what rejection-sampling
    fine-tuning on one's own successes does with a policy gradient): the paper finds it raises
    pass@1 and lowers pass@k at large k; here for the ablations that measure that."""

    name, help = "psr", "+1 for a success, 0 for a failure (positive samples only)"

    def per_episode(self, success, group_of, rl):
        import torch

        return success.to(torch.float32)


#: Every estimator by its ``rl.advantage`` name, in the order the config lists them.
ESTIMATORS: dict[str, Estimator] = {
    cls.name: cls() for cls in (GRPO, RLOO, ReinforcePP, GiGPO, GAE, MCGRPO, PassAtK, WReinforce, PSR)
}


def names_where(attribute: str) -> list[str]:
    """The estimators whose ``attribute`` is true, in registry order."""
    return [n for n, e in ESTIMATORS.items() if getattr(e, attribute)]


def spoken_list(names: Sequence[str]) -> str:
    """``a, b, c or d``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def description() -> str:
    """``rl.advantage``'s description: every estimator with its few words."""
    return "Credit assignment: " + ", ".join(f"{n} ({e.help})" for n, e in ESTIMATORS.items())


__all__ = ["ESTIMATORS", "Estimator", "EstimatorCredit", "Penalties", "Requirement", "description", "names_where",
           "spoken_list"]
