"""Advantage estimators (``rl.advantage``): one class each, in one registry, ``ESTIMATORS``.

Each class owns its math and its settings, and declares what it needs, so the config, the rules,
the start checks and the RL loop ask the object instead of comparing names:

- ``Settings``: its own typed keys, a config section ``rl.<name>`` (``rl.gigpo.omega``); None
  when it has none. The config schema (``turnforge.config``) holds one such section per
  estimator, so ``turnforge keys`` lists them and a typo is an unknown key;
- ``returns_baseline``: advantages from the episodes' rewards and a group baseline alone
  (what agent runs and the flywheel's ``rl`` stage take);
- ``reads_values``: state values from the ``critic`` section (``critic.enabled``,
  ``critic.mc_weight`` apply to it and to no other);
- ``monte_carlo(cfg)``: Monte-Carlo rollouts from env snapshots;
- ``with_images``: works with a vision-language policy;
- ``single_states``: samples actions at single states (needs one sample per turn: the app's rules
  ask the context policy);
- ``conflict(cfg)``: its own cross-key rules (one line, or None);
- ``requirements(cfg)``: the env capabilities it needs (checked at start, before any model work);
- ``credit(trajs, cfg, inputs)``: per-turn advantages (and, for GAE, the values and critic
  targets; for MC-GRPO, its own sample groups).

The estimators read the per-turn rewards through ``turn_rewards`` (the env's reward, plus
potential-based shaping, minus a KL penalty) and GAE reads its values through ``state_values``;
what only the training stage can compute (a learned critic's values, Monte-Carlo rollouts, the
KL penalties) comes in ``CreditInputs`` (``turnforge.train.credit`` builds it). ``cfg`` is the
run's ``TrainConfig``; it is not imported here, since the config imports this module for the
settings. Adding an estimator is one class here, registered in ``ESTIMATORS``, plus its test
(docs/guide.md has a worked example).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol, Sequence

import numpy as np
import torch
from pydantic import Field

from turnforge.algos.advantages import (
    blend,
    decoupled_gae,
    gigpo,
    grpo,
    length_adaptive_lam,
    pass_at_k_advantage,
    reinforce_pp,
    rloo,
    w_reinforce,
)
from turnforge.settings import Section
from turnforge.types import Sample, Trajectory

Penalties = dict[str, np.ndarray]  # trajectory_id -> [num_turns], subtracted from turn rewards


class Requirement(NamedTuple):
    """An env capability an option needs (``turnforge.envs.base.Capabilities.require``)."""

    capability: str
    what: str  # the option that needs it, as the error names it
    fix: str | None = None  # the option to change instead of implementing the method


class MonteCarloSource(Protocol):
    """Monte-Carlo estimates from env snapshots (``turnforge.train.mc.MonteCarlo``)."""

    def turn_values(self, trajs: list[Trajectory], it: int) -> tuple[dict[str, np.ndarray], Any]: ...

    def grpo_batch(self, trajs: list[Trajectory], it: int) -> tuple[list[tuple[Sample, float]], dict[str, str], Any]: ...


@dataclass(frozen=True)
class CreditInputs:
    """What the training stage supplies beside the trajectories."""

    iteration: int
    penalties: Penalties | None = None  # rl.kl_mode=reward: per-turn KL penalties
    critic_values: dict[str, np.ndarray] | None = None  # a learned critic's V(s_k) at rollout time (reads_values)
    monte_carlo: MonteCarloSource | None = None  # Monte-Carlo rollouts (monte_carlo(cfg))


@dataclass
class EstimatorCredit:
    """What an estimator computed for one iteration's trajectories."""

    per_turn: dict[str, np.ndarray]  # trajectory_id -> [num_turns] (empty for mc_grpo)
    pairs: list[tuple[Sample, float | np.ndarray]] | None = None  # mc_grpo's own (sample, advantage) pairs
    group_of: dict[str, str] | None = None  # mc_grpo: sample's trajectory_id -> its state group
    values: dict[str, np.ndarray] | None = None  # gae: the V(s_k) GAE used (learned, MC or blended)
    targets: dict[str, np.ndarray] | None = None  # gae: the critic's targets per turn
    critic_values: dict[str, np.ndarray] | None = None  # gae with a learned critic: its values at rollout time
    mc: Any = None  # counters of the Monte-Carlo rollouts (turnforge.train.metrics.MCStats)


def turn_rewards(traj: Trajectory, rl: Any, gamma: float, penalties: Penalties | None = None) -> np.ndarray:
    """The per-turn rewards the estimators see: the env's, plus potential-based shaping
    (``rl.shaping=potential``: ``r_k + c * (gamma * Phi(s_k+1) - Phi(s_k))``, ``Phi`` the env's
    ``potential()``, 0 at terminal states), minus ``penalties`` (the KL penalty of
    ``rl.kl_mode=reward``). Step-level estimators (gigpo, gae) shape with ``rl.gamma``;
    episode-level ones sum rewards undiscounted and shape with gamma = 1, where the sum
    telescopes to ``Phi(s_T) - Phi(s_0)`` and cannot change which policy is optimal (Ng et al. 1999)."""
    r = np.array([turn.reward for turn in traj.turns], np.float64)
    if penalties is not None:
        r = r - penalties[traj.trajectory_id]
    if rl.shaping == "potential":
        phi = np.array([turn.potential for turn in traj.turns], np.float64)
        phi_next = np.array([turn.next_potential for turn in traj.turns], np.float64)
        r = r + rl.shaping_coef * (gamma * phi_next - phi)
    return r


class Estimator:
    """One advantage estimator. Subclasses set the class attributes and override ``credit``
    (or ``turn_advantages``, which the default ``credit`` calls)."""

    name: ClassVar[str]
    help: ClassVar[str]  # a few words for the config key's description
    Settings: ClassVar[type[Section] | None] = None  # its own keys, the config section rl.<name>
    returns_baseline: ClassVar[bool] = False
    reads_values: ClassVar[bool] = False
    with_images: ClassVar[bool] = True
    single_states: ClassVar[bool] = False

    def settings(self, rl: Any) -> Any:
        """Its settings in the run's ``rl`` section (``rl.<name>``)."""
        return getattr(rl, self.name)

    def monte_carlo(self, cfg: Any) -> bool:
        return False

    def conflict(self, cfg: Any) -> str | None:
        return None

    def requirements(self, cfg: Any) -> list[Requirement]:
        return []

    def turn_advantages(self, trajs: Sequence[Trajectory], rl: Any, penalties: Penalties | None = None) -> dict[str, np.ndarray]:
        raise NotImplementedError(f"rl.advantage={self.name} assigns credit with more than the episodes' rewards")

    def credit(self, trajs: Sequence[Trajectory], cfg: Any, inputs: CreditInputs) -> EstimatorCredit:
        return EstimatorCredit(self.turn_advantages(trajs, cfg.rl, inputs.penalties))


def _groups(trajs: Sequence[Trajectory]) -> tuple[dict[str, int], torch.Tensor]:
    """Each group id's index (in order of first appearance) and every trajectory's group index."""
    groups = {g: i for i, g in enumerate(dict.fromkeys(t.group_id for t in trajs))}
    return groups, torch.tensor([groups[t.group_id] for t in trajs])


def _on_every_turn(trajs: Sequence[Trajectory], per_episode) -> dict[str, np.ndarray]:
    return {t.trajectory_id: np.full(t.num_turns, float(a), np.float32) for t, a in zip(trajs, per_episode)}


class _EpisodeReturn(Estimator):
    """Critic-free: the undiscounted (shaped, penalised) episode return against a group baseline,
    the same value on every turn."""

    returns_baseline = True

    def per_episode(self, returns: torch.Tensor, group_of: torch.Tensor, rl: Any) -> torch.Tensor:
        raise NotImplementedError

    def turn_advantages(self, trajs, rl, penalties=None):
        if not trajs:
            return {}
        _, group_of = _groups(trajs)
        returns = torch.tensor([turn_rewards(t, rl, 1.0, penalties).sum() for t in trajs], dtype=torch.float64)
        return _on_every_turn(trajs, self.per_episode(returns, group_of, rl))


class GRPO(_EpisodeReturn):
    name, help = "grpo", "group-normalised episode return"

    def per_episode(self, returns, group_of, rl):
        return grpo(returns, group_of, std_normalize=rl.std_normalize)


class RLOO(_EpisodeReturn):
    name, help = "rloo", "leave-one-out baseline"

    def per_episode(self, returns, group_of, rl):
        return rloo(returns, group_of)


class ReinforcePP(_EpisodeReturn):
    name, help = "reinforce_pp", "group baseline, batch std"

    def per_episode(self, returns, group_of, rl):
        return reinforce_pp(returns, group_of)


class GiGPOSettings(Section):
    omega: float = Field(1.0, ge=0, description="Weight of GiGPO's step-level advantage")


class GiGPO(Estimator):
    """GRPO's episode term plus a step-level term from the turns of the group that acted in the
    same env state (``anchor_key``), each turn its own value. Exact anchor matching only."""

    name, help = "gigpo", "grpo plus step-level anchor-state groups"
    Settings = GiGPOSettings
    returns_baseline = True

    def requirements(self, cfg):
        return [Requirement("anchor_key", "GiGPO's step-level groups (rl.advantage=gigpo)")]

    def turn_advantages(self, trajs, rl, penalties=None):
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
            gamma=rl.gamma, omega=self.settings(rl).omega, std_normalize=rl.std_normalize,
        ).numpy()
        out, k = {}, 0
        for t in trajs:
            out[t.trajectory_id] = adv[k:k + t.num_turns]
            k += t.num_turns
        return out


def _monte_carlo_requirements(cfg: Any, what: str) -> list[Requirement]:
    reqs = [Requirement("snapshot", what)]
    if cfg.critic.mc_policy == "random":
        reqs.append(Requirement("random_action", f"{what} with random rollouts", "set critic.mc_policy=bc"))
    return reqs


class GAESettings(Section):
    """GAE's lambdas (VAPO's decoupled and length-adaptive GAE) and its whitening."""

    lam_policy: float = Field(0.95, ge=0, le=1, description="GAE lambda of the policy's advantages")
    lam_critic: float = Field(
        1.0, ge=0, le=1, description="GAE lambda of the critic's targets (VAPO's decoupled GAE: 1.0 = Monte-Carlo returns)"
    )
    length_adaptive: bool = Field(
        False, description="VAPO's length-adaptive lambda for the policy: 1 - 1/(alpha * turns of the episode)"
    )
    alpha: float = Field(
        0.5, gt=0, description="Length-adaptive alpha; lengths here count turns, so VAPO's token-level 0.05 becomes ~0.5"
    )
    whiten: bool = Field(True, description="Normalise GAE advantages to mean 0, std 1 over the batch")


def gae_turn_advantages(
    trajs: Sequence[Trajectory], values: dict[str, np.ndarray], rl: Any, gae: GAESettings,
    penalties: Penalties | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """GAE over the turns of each episode: ``(advantages, critic targets)`` per turn.

    Episodes become rows of a ``[E, K]`` tensor (K = most turns) with a mask on real
    turns; VAPO's decoupled GAE gives the policy ``lam_policy`` (per episode with
    ``length_adaptive``) and the critic ``lam_critic``. An episode cut by the turn limit
    is treated as ended (value 0 after it): the agent's horizon is ``max_turns``, so no
    reward can follow. With ``whiten`` the advantages are normalised over all turns of the batch.
    """
    if not trajs:
        return {}, {}
    k = max(t.num_turns for t in trajs)
    shape = (len(trajs), k)
    r, v, m = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64), torch.zeros(shape)
    for i, t in enumerate(trajs):
        n = t.num_turns
        r[i, :n] = torch.from_numpy(turn_rewards(t, rl, rl.gamma, penalties))
        v[i, :n] = torch.from_numpy(np.asarray(values[t.trajectory_id], np.float64))
        m[i, :n] = 1.0
    lam_policy = length_adaptive_lam(m, gae.alpha) if gae.length_adaptive else gae.lam_policy
    adv, ret = decoupled_gae(r, v, m.double(), rl.gamma, lam_policy, gae.lam_critic)
    if gae.whiten:
        real = adv[m.bool()]
        if real.numel() > 1:
            adv = torch.where(m.bool(), (adv - real.mean()) / (real.std() + 1e-8), adv)
    adv_out = {t.trajectory_id: adv[i, :t.num_turns].numpy().astype(np.float32) for i, t in enumerate(trajs)}
    ret_out = {t.trajectory_id: ret[i, :t.num_turns].numpy().astype(np.float32) for i, t in enumerate(trajs)}
    return adv_out, ret_out


def state_values(
    trajs: list[Trajectory], it: int, critic_values: dict[str, np.ndarray] | None, mc_weight: float,
    mc: MonteCarloSource | None,
) -> tuple[dict[str, np.ndarray], Any]:
    """V(s_k) per turn for GAE: the learned critic's, Monte-Carlo values, or the blend
    ``(1 - w) V_phi + w V_MC`` (``w = critic.mc_weight``); plus the Monte-Carlo counters."""
    if mc_weight == 0:
        assert critic_values is not None  # the config guarantees a value source
        return critic_values, None
    assert mc is not None
    v_mc, stats = mc.turn_values(trajs, it)
    if critic_values is None:
        return v_mc, stats
    return {k: np.asarray(blend(critic_values[k], v_mc[k], mc_weight), np.float32) for k in critic_values}, stats


class GAE(Estimator):
    """PPO's GAE over the turns of each episode with state values from the learned critic,
    Monte-Carlo rollouts from env snapshots, or their blend (``critic`` section)."""

    name, help = "gae", "PPO: GAE over turns with state values from the critic section"
    Settings = GAESettings
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

    def credit(self, trajs, cfg, inputs):
        values, mc_stats = state_values(list(trajs), inputs.iteration, inputs.critic_values, cfg.critic.mc_weight,
                                        inputs.monte_carlo)
        per_turn, targets = gae_turn_advantages(trajs, values, cfg.rl, self.settings(cfg.rl), inputs.penalties)
        return EstimatorCredit(per_turn, values=values, targets=targets, critic_values=inputs.critic_values, mc=mc_stats)


class MCGRPOSettings(Section):
    states: int = Field(64, ge=1, description="States per iteration at which the policy samples G actions")


class MCGRPO(Estimator):
    """The rollouts only supply states: at ``rl.mc_grpo.states`` of them the policy samples G
    actions, each scored by ``Q_MC(s, a)`` from env snapshots and normalised within the state's
    group (``turnforge.train.mc``, which ``inputs.monte_carlo`` is)."""

    name = "mc_grpo"
    help = "G sampled actions at one state scored by Monte-Carlo Q values, normalised within the state"
    Settings = MCGRPOSettings
    with_images = False
    single_states = True

    def monte_carlo(self, cfg):
        return True

    def conflict(self, cfg):
        if cfg.rl.kl_mode == "reward":
            return "rl.kl_mode=reward penalises episode turns; rl.advantage=mc_grpo scores single actions: use rl.kl_mode=loss"
        if cfg.rl.shaping != "none":
            return "rl.shaping=potential does not apply to rl.advantage=mc_grpo (its Q values come from env rollouts)"
        if cfg.reward.judge.enabled or (cfg.agent.entrypoint is not None and cfg.agent.reward == "judge"):
            return "rl.advantage=mc_grpo scores single actions by env rollouts; a judge scores whole episodes (use grpo)"
        return None

    def requirements(self, cfg):
        return _monte_carlo_requirements(cfg, "MC-GRPO (rl.advantage=mc_grpo)")

    def credit(self, trajs, cfg, inputs):
        assert inputs.monte_carlo is not None  # the config and the start checks guarantee snapshots
        pairs, group_of, mc_stats = inputs.monte_carlo.grpo_batch(list(trajs), inputs.iteration)
        return EstimatorCredit({}, pairs=pairs, group_of=group_of, mc=mc_stats)


class _SuccessFlag(Estimator):
    """Critic-free on the env's success flag (binary), not the return: rewards that shaping,
    a KL penalty or a judge change are not what it reads."""

    def per_episode(self, success: torch.Tensor, group_of: torch.Tensor, rl: Any) -> torch.Tensor:
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
        if not trajs:
            return {}
        _, group_of = _groups(trajs)
        return _on_every_turn(trajs, self.per_episode(torch.tensor([t.success for t in trajs]), group_of, rl))


class PassAtKSettings(Section):
    k: int = Field(4, ge=1, description="k: the group is scored by its unbiased pass@k, each episode by what it adds "
                   "to it (at most rl.group_size; 1 = grpo with the population std)")


class PassAtK(_SuccessFlag):
    name, help = "pass_at_k", "the closed-form pass@k advantage of the group's successes, k = rl.pass_at_k.k"
    Settings = PassAtKSettings

    def conflict(self, cfg):
        rl, fw, k = cfg.rl, cfg.flywheel, self.settings(cfg.rl).k
        if k > rl.group_size:
            return (f"rl.pass_at_k.k={k} is larger than rl.group_size={rl.group_size}: pass@k is estimated from the "
                    f"group's samples; set rl.pass_at_k.k <= {rl.group_size} or raise rl.group_size")
        if fw.rounds > 0 and "rl" in fw.stages and k > fw.group_size:
            return (f"rl.pass_at_k.k={k} is larger than flywheel.group_size={fw.group_size}, the groups of the "
                    f"flywheel's 'rl' stage; set rl.pass_at_k.k <= {fw.group_size} or raise flywheel.group_size")
        return super().conflict(cfg)

    def per_episode(self, success, group_of, rl):
        return pass_at_k_advantage(success, group_of, self.settings(rl).k)


class WReinforceSettings(Section):
    success_weight: float = Field(
        0.1, ge=0, description="lambda, the weight of a success (a failure weighs -1; 1 = plain REINFORCE)")


class WReinforce(_SuccessFlag):
    name, help = "w_reinforce", "+rl.w_reinforce.success_weight for a success, -1 for a failure, no baseline"
    Settings = WReinforceSettings

    def per_episode(self, success, group_of, rl):
        return w_reinforce(success, self.settings(rl).success_weight)


class PSR(_SuccessFlag):
    """Positive sample reinforcement (Zhu et al. 2025): REINFORCE on the successes alone, the
    failures weigh nothing. The counterpart of ``w_reinforce`` (and what rejection-sampling
    fine-tuning on one's own successes does with a policy gradient): the paper finds it raises
    pass@1 and lowers pass@k at large k; here for the ablations that measure that."""

    name, help = "psr", "+1 for a success, 0 for a failure (positive samples only)"

    def per_episode(self, success, group_of, rl):
        return success.to(torch.float32)


#: Every estimator by its ``rl.advantage`` name, in the order the config lists them.
ESTIMATORS: dict[str, Estimator] = {
    cls.name: cls() for cls in (GRPO, RLOO, ReinforcePP, GiGPO, GAE, MCGRPO, PassAtK, WReinforce, PSR)
}


def names_where(attribute: str) -> list[str]:
    """The estimators whose ``attribute`` is true, in registry order."""
    return [n for n, e in ESTIMATORS.items() if getattr(e, attribute)]


__all__ = ["CreditInputs", "ESTIMATORS", "Estimator", "EstimatorCredit", "MonteCarloSource", "Penalties", "Requirement",
           "gae_turn_advantages", "names_where", "state_values", "turn_rewards"]
