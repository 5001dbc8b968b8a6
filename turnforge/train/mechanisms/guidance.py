"""``guidance`` (Agent-RLVR): re-attempts of unsolved tasks with the env's hints in the observations."""

from __future__ import annotations

from dataclasses import dataclass, replace

from turnforge.train.mechanisms.base import ExpertUse, Mechanism


@dataclass
class GuidanceState:
    hints: int = 0  # solver-backed hints shown so far (the env's n_expert_queries)


def guided_config(cfg):
    """The run's config with the env's hints on (``flywheel.guidance_level``)."""
    out = cfg.model_copy(deep=True)
    out.env.kwargs = {**dict(cfg.env.kwargs), "guidance": cfg.flywheel.guidance_level}
    return out


class Guidance(Mechanism):
    """``guided_rollouts`` re-attempts of each of a wave's still unsolved tasks, on an engine of
    its own with the env's hints (``guidance_level``) in the observations. The hints are stripped
    from the contexts before training (``turnforge.rollout.context.rerender``; same action tokens
    and sampling logprobs); with ``guided_training=is`` each guided sample is weighted by
    pi(a | unguided context) / mu(a | guided context), truncated at 1. Departs from Agent-RLVR,
    which trains guided trajectories with RL: here with RFT (or importance-weighted RFT)."""

    name, source = "guidance", "guided"
    help = "re-attempts of unsolved tasks with the env's hints, trained with the hints stripped"
    trains_as_played = False  # re-written without the hints first (candidates)
    remembered = False  # found with hints the memory would not show

    @classmethod
    def requirements(cls, cfg):
        return [cls.needs("guidance", "flywheel guidance")]

    @classmethod
    def env_conflict(cls, cfg, env):
        fw, levels = cfg.flywheel, getattr(env, "guidance_levels", ())
        if fw.guidance_level > len(levels):
            return (f"flywheel.guidance_level={fw.guidance_level}: env {cfg.env.id!r} has guidance levels "
                    f"1..{len(levels)}: " + "; ".join(f"{i} = {d}" for i, d in enumerate(levels, 1)))
        return None

    def initial_state(self):
        return GuidanceState()

    def open(self, policy):
        from turnforge.rollout.engine import make_engine

        self.engine = make_engine(guided_config(self.cfg), policy)

    def close(self):
        self.engine.close()

    def begin(self, col):
        self.played = []

    def after_wave(self, col, failed):
        if failed:
            got = col.play(col.requests(failed, self.cfg.flywheel.guided_rollouts, "g"), self.source, engine=self.engine)
            self.played += got
            self.state.hints += sum(int(turn.info.get("n_expert_queries", 0)) for t in got for turn in t.turns)
        return failed

    def candidates(self, col):
        return [c for c in (unguided(col, t, self.source) for t in self.played) if c is not None]

    def sample_weights(self, policy, samples):
        if self.cfg.flywheel.guided_training != "is":
            return None
        return is_weights(policy, samples, self.cfg.flywheel.temperature)

    def expert_use(self):
        return ExpertUse(hints=self.state.hints)


def unguided(col, traj, source: str):
    """A guided episode as training data: its samples re-written with the hints stripped from
    every observation (same action tokens and sampling logprobs); None when it cannot be."""
    from turnforge.data.filters import Candidate
    from turnforge.envs.base import strip_guidance
    from turnforge.rollout.context import rerender

    if traj.infra_failure is not None or not traj.samples:
        return None
    engine = col.engine
    samples = rerender(traj, [strip_guidance(t.observation) for t in traj.turns], col.policy.chat, col.cfg.rollout,
                       engine.prompt, engine.marker)
    if samples is None:
        return None
    turns = tuple(replace(t, observation=strip_guidance(t.observation)) for t in traj.turns)
    return Candidate.of(replace(traj, samples=tuple(samples), turns=turns), source)


def is_weights(policy, samples, temperature: float) -> list[float]:
    """Per sample, min(1, pi(a | its context) / mu(a | the context it was sampled in)) over its
    action tokens, pi at ``temperature`` (one forward pass for all of them)."""
    import torch

    from turnforge.policy.generate import token_logprobs
    from turnforge.train.common import collate

    if not samples:
        return []
    with torch.no_grad():
        batch = collate(samples, policy.pad_id, vision=policy.vision)
        lp, _ = token_logprobs(policy.model, batch.ids, batch.attention, temperature, positions=batch.mask,
                               vision=batch.vision)
        log_ratio = ((lp - batch.old_logprobs) * batch.mask).sum(dim=1)
        return torch.exp(log_ratio).clamp(max=1.0).tolist()
