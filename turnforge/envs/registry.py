"""Env registry: ``register(id, factory)``, ``make(id, **kwargs)``, ``list_envs()``.

Third-party packages register envs with a Python entry point in the group
``turnforge.envs``; the entry point's name is the env id and its value the env class or
factory, e.g. in ``pyproject.toml``::

    [project.entry-points."turnforge.envs"]
    "mygame-v0" = "mypkg.envs:MyGameEnv"

Entry points are read lazily, on the first ``make``/``list_envs`` call.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable

from turnforge.envs.base import Env
from turnforge.envs.levels import LevelEnv
from turnforge.errors import UserError, choices

ENTRY_POINT_GROUP = "turnforge.envs"


@dataclass(frozen=True)
class EnvSpec:
    env_id: str
    factory: Callable[..., Env] | str  # a callable or "module:attr"
    kwargs: dict[str, Any] = field(default_factory=dict)  # defaults, overridable in make()
    source: str = "builtin"

    def load(self) -> Callable[..., Env]:
        if callable(self.factory):
            return self.factory
        module, _, attr = self.factory.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj


_REGISTRY: dict[str, EnvSpec] = {}
_entry_points_loaded = False


def register(env_id: str, factory: Callable[..., Env] | str, *, overwrite: bool = False, **kwargs: Any) -> None:
    """Register an env id. ``kwargs`` become defaults that ``make`` may override."""
    if env_id in _REGISTRY and not overwrite:
        raise ValueError(f"env id {env_id!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[env_id] = EnvSpec(env_id, factory, dict(kwargs))


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _REGISTRY:
            _REGISTRY[ep.name] = EnvSpec(ep.name, ep.value, {}, source=f"entry point ({ep.value})")


def list_envs() -> dict[str, EnvSpec]:
    """All registered env ids (built-ins and entry points), sorted."""
    _load_entry_points()
    return dict(sorted(_REGISTRY.items()))


def make(env_id: str, **kwargs: Any) -> Env:
    """Build a registered env. Unknown ids or keyword arguments raise ``UserError``
    naming the valid choices."""
    _load_entry_points()
    spec = _REGISTRY.get(env_id)
    if spec is None:
        raise UserError(f"unknown env {env_id!r}; valid envs: {choices(_REGISTRY)}")
    try:
        factory = spec.load()
    except Exception as err:  # a plugin that does not import: name the env and where it points
        where = spec.source if spec.source != "builtin" else f"factory {spec.factory!r}"
        raise UserError(f"env {env_id!r} ({where}) could not be imported: {type(err).__name__}: {err}") from None
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not takes_any:
        valid = {n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and n != "self"}
        unknown = sorted(set(kwargs) - valid)
        if unknown:
            raise UserError(f"env {env_id!r} has no option {unknown[0]!r}; valid options: {choices(valid)}")
    try:
        env = factory(**{**spec.kwargs, **kwargs})
    except UserError:
        raise
    except Exception as err:  # a broken factory or a bad option value: one line, before any worker starts
        raise UserError(f"env {env_id!r} could not be built with options {dict(kwargs)}: {type(err).__name__}: {err}") from None
    if not isinstance(env, Env):
        raise TypeError(f"factory of env {env_id!r} returned {type(env).__name__}; it must return a turnforge Env")
    env.env_id = env_id
    env.made_with = dict(kwargs)  # so check_env can build a second env of the same options
    return env


def make_batch(env_id: str, n: int, **kwargs: Any) -> list[Env]:
    """``n`` envs of one id. ``LevelEnv``s of a batch share one level cache, so the G
    rollouts of a task (and repeated evaluations) generate each level once."""
    return share_levels([make(env_id, **kwargs) for _ in range(n)])


def share_levels(envs: list[Env]) -> list[Env]:
    """Let ``LevelEnv``s of one batch share the first one's level cache and task source."""
    if envs and all(isinstance(e, LevelEnv) for e in envs):
        size = max(envs[0].level_cache_size, 4 * len(envs))
        for env in envs:
            env.level_cache, env.level_cache_size = envs[0].level_cache, size
            env.tasks = envs[0].tasks
    return envs


def build_env(env_id: str, env_kwargs: dict[str, Any] | None = None, tasks: str | None = None,
              heldout_fraction: float | None = None) -> Env:
    """``make(env_id, **env_kwargs)`` with its task source replaced by what the env reads from
    ``tasks`` (the recipe's ``env.tasks``: a JSONL file, or what the env's ``read_tasks`` takes,
    e.g. a directory of Harbor tasks for ``terminal``), when given."""
    env = make(env_id, **(env_kwargs or {}))
    if tasks is not None:
        if isinstance(env, LevelEnv) and not getattr(env, "reads_task_data", False):
            raise UserError(f"env {env_id!r} generates its own levels (a LevelEnv); env.tasks applies to envs that read task.data")
        env.tasks = env.read_tasks(tasks, heldout_fraction)
    return env
