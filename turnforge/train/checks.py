"""Checks a run makes at start, before any model work: options against the env's capabilities,
and the cheap part of ``check_env``.

Every option that needs an optional env capability (``turnforge.envs.base``) is checked here,
so a missing one is a one-line error naming the method to implement (or the option to change)
instead of a failure minutes into the run; so is an env that breaks the contract in a way
``check_env(quick=True)`` sees (shared state between resets or envs, invalid actions that
change state, restores that do not restore, a tiny held-out split).
"""

from __future__ import annotations

from turnforge.algos.estimators import ESTIMATORS, names_where
from turnforge.config import TrainConfig
from turnforge.envs.base import Env, capabilities
from turnforge.envs.checker import EnvCheckError, check_env
from turnforge.errors import UserError, spoken_list
from turnforge.rollout.context import CONTEXTS
from turnforge.train.mechanisms import enabled


def check_options(cfg: TrainConfig, env: Env) -> None:
    """Raise ``UserError`` when ``cfg`` asks ``env`` for something it cannot do."""
    caps, env_id, rl = capabilities(env), cfg.env.id, cfg.rl
    limit = getattr(env, "turn_limit", None)  # an env that ends (and scores) its episodes itself at a turn count
    if limit is not None and cfg.rollout.max_turns < limit:
        raise UserError(f"env {env_id!r} ends and scores an episode at its max_turns={limit}, but rollout.max_turns="
                        f"{cfg.rollout.max_turns} would cut it first, unscored; set rollout.max_turns >= {limit} or "
                        f"env.kwargs.max_turns <= {cfg.rollout.max_turns}")
    context = CONTEXTS[cfg.rollout.context]
    problem = context.env_conflict(cfg, env)
    if problem:
        raise UserError(problem)
    if cfg.bc.enabled:
        caps.require("expert", env_id, "the BC warm start (bc.enabled=true)", "set bc.enabled=false")
        if context.writes_summaries:
            caps.require("expert_summary", env_id, f"BC demonstrations with rollout.context={context.name} (the expert "
                         "writes the summaries)", "set bc.enabled=false")
        if cfg.bc.expert_noise > 0:
            caps.require("random_action", env_id, f"a noisy demonstrator (bc.expert_noise={cfg.bc.expert_noise})",
                         "set bc.expert_noise=0")
    if rl.iterations > 0:
        for req in ESTIMATORS[rl.advantage].requirements(cfg):
            caps.require(req.capability, env_id, req.what, req.fix)
        if rl.shaping == "potential":
            caps.require("potential", env_id, "potential-based shaping (rl.shaping=potential)", "set rl.shaping=none")
    fw = cfg.flywheel
    if fw.rounds > 0:
        for mechanism in enabled(fw.mechanisms):  # what each mechanism needs (turnforge.train.mechanisms)
            for req in mechanism.requirements(cfg):
                caps.require(req.capability, env_id, req.what, req.fix)
            problem = mechanism.env_conflict(cfg, env)
            if problem:
                raise UserError(problem)
        if fw.weighting == "mc_awr":  # restarts from env snapshots, each with a fresh future of the dynamics
            what = "advantage-weighted regression on Monte-Carlo Q values (flywheel.weighting=mc_awr)"
            for cap in ("snapshot", "reseed"):
                caps.require(cap, env_id, what, "set flywheel.weighting=success")
            if fw.mc_tails == "random":
                caps.require("random_action", env_id, f"{what} with random tails (flywheel.mc_tails=random)",
                             "set flywheel.mc_tails=policy")
        if fw.weighting == "group_awr":
            caps.require("anchor_key", env_id, "advantage-weighted regression on anchor-state groups (flywheel.weighting=group_awr)",
                         "set flywheel.weighting=success")
        if "loops" in fw.filters:
            caps.require("anchor_key", env_id, "the flywheel filter 'loops'", "drop loops from flywheel.filters")
        if "rl" in fw.stages and not ESTIMATORS[rl.advantage].returns_baseline:
            raise UserError(f"flywheel stage 'rl' runs a critic-free update; rl.advantage={rl.advantage} is not one "
                            f"(use {spoken_list(names_where('returns_baseline'))}, or drop rl from flywheel.stages)")
    source = env.task_source()  # an env without tasks fails here
    for split in ("train", cfg.eval.split):
        if source.size(split) == 0:
            raise UserError(f"env {env_id!r} has no {split} tasks; add some to its task source (env.tasks)")


def check_env_at_start(cfg: TrainConfig) -> None:
    """``check_env(quick=True)`` on the run's env; a violation is a one-line ``UserError``."""
    try:
        check_env(cfg.env.id, env_kwargs=cfg.env.kwargs, tasks=cfg.env.tasks, heldout_fraction=cfg.env.heldout_fraction, quick=True,
                  min_heldout=cfg.eval.min_heldout_tasks, allow_no_actions=True)  # RL needs no scripted actions
    except EnvCheckError as err:
        raise UserError(f"env {cfg.env.id!r} fails check_env: {err}") from None
