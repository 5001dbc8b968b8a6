"""Thin bridges to Gymnasium: ``to_gymnasium`` (turnforge Env -> gymnasium.Env with text
spaces) and ``from_gymnasium`` (gymnasium env with a Discrete action space -> turnforge Env).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import gymnasium
import numpy as np
from gymnasium.spaces import Discrete, Text

from turnforge.envs.base import Env, parse_choice
from turnforge.envs.levels import LevelEnv, Outcome
from turnforge.types import StepResult, Task

#: Characters the Text spaces allow: printable ASCII (newlines and tabs included).
CHARSET = frozenset(string.printable)


class TurnforgeGymEnv(gymnasium.Env):
    """A turnforge Env seen through the Gymnasium API (text observations and actions).

    ``reset(seed, options={"task": Task})`` picks the task (default: train task ``seed``;
    ``seed=None`` draws one from the wrapper's ``np_random``); ``info`` of ``step`` carries
    ``invalid_action``, ``success`` and the env's own info.
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, env: Env, *, max_length: int = 8192, render_mode: str | None = None) -> None:
        self.env = env
        self.render_mode = render_mode
        self.observation_space = Text(max_length, min_length=0, charset=CHARSET)
        self.action_space = Text(1024, min_length=0, charset=CHARSET)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is None:  # Gymnasium's convention: continue the wrapper's own random stream
            seed = int(self.np_random.integers(2**31))
        task = (options or {}).get("task")
        if task is not None and not isinstance(task, Task):
            raise TypeError(f"options['task'] must be a turnforge Task, got {type(task).__name__}")
        task = task or self.env.task("train", seed)
        obs = self.env.reset(task=task, seed=seed)
        return obs, {"task_id": task.task_id}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        r = self.env.step(action)
        info = {**r.info, "invalid_action": r.invalid_action, "success": r.success}
        return r.observation, r.reward, r.terminated, r.truncated, info

    def render(self) -> str | None:
        render = getattr(self.env, "render", None)  # a LevelEnv's render(); light envs have none
        return render() if self.render_mode == "ansi" and callable(render) else None


def to_gymnasium(env: Env, *, max_length: int = 8192, render_mode: str | None = None) -> TurnforgeGymEnv:
    """Wrap a turnforge Env as a ``gymnasium.Env`` with ``Text`` observation and action spaces."""
    return TurnforgeGymEnv(env, max_length=max_length, render_mode=render_mode)


@dataclass
class GymState:
    """Episode state of a wrapped Gymnasium env: the env itself (deep-copied by snapshots)."""

    env: gymnasium.Env
    obs: Any
    truncated: bool = False


class GymnasiumEnv(LevelEnv[int]):
    """A Gymnasium env with a Discrete action space as a turnforge Env.

    A level is a Gymnasium reset seed: train task ``i`` resets with seed ``2*i``, held-out
    task ``i`` with ``2*i + 1`` (disjoint by seed; a fixed-map env such as FrozenLake-v1
    has the same map in both). After that reset the turnforge ``seed`` reseeds the wrapped
    env's ``np_random``, so it drives the dynamics (slippery ice) as in built-in envs.
    ``snapshot()`` deep-copies the wrapped env, so only deep-copyable envs (toy_text, pure
    Python) support it. A Gymnasium truncation (TimeLimit) becomes ``truncated``.
    ``tasks_may_be_alike`` is set: a deterministic fixed-map env is one task under many
    seeds, which ``check_env`` reports as a warning (held-out success is then train success).
    """

    tasks_may_be_alike = True

    def __init__(
        self,
        gym_env: gymnasium.Env,
        action_names: Sequence[str],
        *,
        render: Callable[[Any], str] | None = None,
        instructions: str | None = None,
        invalid_action_penalty: float = -0.1,
        max_steps: int | None = None,
    ) -> None:
        spec_steps = gym_env.spec.max_episode_steps if gym_env.spec is not None else None
        super().__init__(invalid_action_penalty=invalid_action_penalty, max_steps=max_steps or spec_steps or 100)
        if not isinstance(gym_env.action_space, Discrete):
            raise TypeError(f"from_gymnasium needs a Discrete action space, got {gym_env.action_space}")
        if len(action_names) != gym_env.action_space.n:
            raise ValueError(f"{len(action_names)} action names for {gym_env.action_space.n} actions")
        self.gym_env, self.action_names = gym_env, tuple(action_names)
        self._render_obs = render or str
        self._instructions = instructions or f"Answer with one of {', '.join(self.action_names)}."

    @property
    def instructions(self) -> str:
        return self._instructions

    @property
    def valid_actions_text(self) -> str:
        return ", ".join(self.action_names)

    def level_for(self, task: Task) -> int:
        return 2 * task.index + (task.split == "heldout")

    def split_of(self, level: int) -> str:
        return "heldout" if level % 2 else "train"

    def generate_level(self, level_seed: int) -> int:
        return int(level_seed)

    def level_key(self, level: int) -> str:
        return f"seed={level}"

    def initial_state(self, level: int, rng: random.Random) -> GymState:
        obs, _ = self.gym_env.reset(seed=level)
        self.gym_env.unwrapped.np_random = np.random.default_rng(rng.getrandbits(64))
        return GymState(self.gym_env, obs)

    def render(self) -> str:
        return self._render_obs(self.state.obs)

    def parse_action(self, text: str) -> int:
        return parse_choice(text, self.action_names)

    def apply(self, action: int) -> Outcome:
        obs, reward, terminated, truncated, info = self.state.env.step(action)
        self.state.obs, self.state.truncated = obs, bool(truncated)
        scalars = {k: v for k, v in info.items() if isinstance(v, (bool, int, float, str))}
        success = bool(terminated and reward > 0)
        return Outcome(float(reward), terminated=bool(terminated), success=success, info=scalars)

    def step(self, action_text: str) -> StepResult:
        result = super().step(action_text)
        if self.state.truncated and not result.terminated and not result.truncated:
            self.done = True
            result = replace(result, truncated=True)
        return result


def from_gymnasium(
    gym_env_or_id: gymnasium.Env | str,
    action_names: Sequence[str],
    render: Callable[[Any], str] | None = None,
    instructions: str | None = None,
    *,
    invalid_action_penalty: float = -0.1,
    max_steps: int | None = None,
    **make_kwargs: Any,
) -> GymnasiumEnv:
    """Wrap a Gymnasium env (or id, made with ``make_kwargs``) as a turnforge Env.

    Action texts match ``action_names`` (index = Discrete action) case-insensitively,
    optionally inside ``<answer>`` tags; observations are ``render(obs)`` or ``str(obs)``.
    Success means terminated with a positive last reward (true for toy_text goals).
    """
    gym_env = gymnasium.make(gym_env_or_id, **make_kwargs) if isinstance(gym_env_or_id, str) else gym_env_or_id
    return GymnasiumEnv(
        gym_env,
        action_names,
        render=render,
        instructions=instructions,
        invalid_action_penalty=invalid_action_penalty,
        max_steps=max_steps,
    )


__all__ = ["GymnasiumEnv", "TurnforgeGymEnv", "from_gymnasium", "to_gymnasium"]
