"""Multi-turn text environments: the Env contract, the registry, check_env, built-in games."""

from turnforge.envs.base import Env, EnvSnapshot, InvalidAction, Outcome
from turnforge.envs.registry import list_envs, make, make_batch, register

__all__ = ["Env", "EnvSnapshot", "InvalidAction", "Outcome", "list_envs", "make", "make_batch", "register"]
