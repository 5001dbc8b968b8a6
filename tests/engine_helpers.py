"""Test helpers shared by several test modules (not fixtures, so not in conftest.py)."""

from __future__ import annotations


def inline_engine(policy, env, cfg, n: int = 1, **env_kwargs):
    """A rollout engine on in-process envs: ``env`` is a registered id (``n`` envs made with
    ``env_kwargs``) or a list of env objects."""
    from turnforge.envpool import InlineEnvs
    from turnforge.envs import make
    from turnforge.rollout.engine import RolloutEngine

    if isinstance(env, str):
        return RolloutEngine(InlineEnvs(env, n, env_kwargs), cfg, policy, make(env, **env_kwargs))
    return RolloutEngine(InlineEnvs.from_envs(env), cfg, policy, env[0])
