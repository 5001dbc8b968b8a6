"""``LevelEnv``: the env contract for procedurally generated levels, from a few hooks.

An env author subclasses ``LevelEnv`` and writes:

- ``generate_level(level_seed)``: build a level (deterministic in the seed);
- ``level_key(level)``: a string that identifies the level's content (its hash decides the split);
- ``initial_state(level, rng)``: the mutable game state for a fresh episode;
- ``render()``: the observation text of ``self.state`` (deterministic);
- ``parse_action(text)``: text -> action, or raise ``InvalidAction(reason)``;
- ``apply(action) -> Outcome``: advance ``self.state``;
- ``instructions`` and ``valid_actions_text``;
- optionally ``expert_action()`` (a solver, for demonstrations), ``potential()`` (shaping),
  ``action_names`` or ``random_action(rng)``.

``LevelEnv`` then provides ``reset``/``step``, tasks (``LevelTasks``: task ``index`` of a split
is the first generated level whose content hash falls in it), and the capabilities
``snapshot``/``restore``, ``anchor_key`` and ``reseed``: everything mutable lives in
``self.state`` and ``self.rng``, so they copy full env state without help from the author.
Invalid actions cost ``invalid_action_penalty``, leave the state unchanged, and produce an
observation that says what was wrong. ``max_steps`` truncates an episode from inside the env
(the rollout's ``max_turns`` usually ends it first).

Tool-using envs (``turnforge.envs.tool``) also set ``tools`` and ``observation_role = "tool"``.
Integer ``info`` values under keys starting with ``n_`` are event counters (tool calls,
truncated outputs, ...), summed per iteration in the metrics.
"""

from __future__ import annotations

import copy
import hashlib
import random
from abc import abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generic, Mapping, TypeVar

from turnforge.envs.base import Env, EnvSnapshot, InvalidAction, stable_hash
from turnforge.envs.tasks import TaskSource
from turnforge.types import Scalar, StepResult, Task

LevelT = TypeVar("LevelT")


@dataclass(frozen=True)
class Outcome:
    """What an ``apply`` hook reports about one valid action."""

    reward: float
    terminated: bool = False
    success: bool = False
    info: Mapping[str, Scalar] = field(default_factory=dict)


class LevelTasks(TaskSource):
    """Tasks of a ``LevelEnv``: ``(split, index)`` only; the env generates the level."""

    def __init__(self, env: "LevelEnv") -> None:
        self.env = env

    def task(self, split: str, index: int) -> Task:
        return Task("", split, index)  # type: ignore[arg-type]

    def size(self, split: str) -> None:
        return None

    def key(self, task: Task) -> str:
        return self.env.level_key(self.env.level_for(task))


class LevelEnv(Env, Generic[LevelT]):
    """Base class of envs with generated levels (see the module docstring for the hooks)."""

    #: Share of generated levels that fall in the held-out split (by content hash).
    heldout_fraction: float = 0.1
    #: How many generated levels to keep in memory (generation may run a solver).
    level_cache_size: int = 4096

    def __init__(self, *, invalid_action_penalty: float = -0.1, max_steps: int = 100) -> None:
        self.invalid_action_penalty = float(invalid_action_penalty)
        self.max_steps = int(max_steps)
        self.state: Any = None
        self.rng = random.Random(0)
        self.current_task: Task | None = None
        self.steps = 0
        self.done = True
        self._levels: OrderedDict[tuple[str, int], LevelT] = OrderedDict()
        self.tasks = LevelTasks(self)

    # ------------------------------------------------------------------ hooks
    @property
    @abstractmethod
    def instructions(self) -> str:  # type: ignore[override]
        """Rules and action format, shown to the policy as the system prompt."""

    @property
    @abstractmethod
    def valid_actions_text(self) -> str:
        """Short text naming the valid actions, quoted in invalid-action observations."""

    @abstractmethod
    def generate_level(self, level_seed: int) -> LevelT:
        """Build one level, deterministically from ``level_seed``."""

    @abstractmethod
    def level_key(self, level: LevelT) -> str:
        """A string identifying the level's content; its hash decides the split."""

    @abstractmethod
    def initial_state(self, level: LevelT, rng: random.Random) -> Any:
        """The mutable episode state at the start of ``level``."""

    @abstractmethod
    def render(self) -> str:
        """Observation text of the current state. Must be deterministic."""

    @abstractmethod
    def parse_action(self, text: str) -> Any:
        """Parse model output into an action; raise ``InvalidAction(reason)`` if it is not one."""

    @abstractmethod
    def apply(self, action: Any) -> Outcome:
        """Advance ``self.state`` by one valid action."""

    def invalid_observation(self, reason: str) -> str:
        """The observation after an invalid action (``reason`` says what was wrong)."""
        return f"Invalid action: {reason}. Valid actions: {self.valid_actions_text}.\n{self.render()}"

    # ------------------------------------------------------------------ levels
    def split_of(self, level: LevelT) -> str:
        """Which split a level belongs to, from a hash of its content."""
        bucket = stable_hash("split", self.level_key(level)) % 10_000
        return "heldout" if bucket < self.heldout_fraction * 10_000 else "train"

    def level_for(self, task: Task) -> LevelT:
        """The level of ``task``: the first generated level whose content falls in the task's split."""
        key = (task.split, task.index)
        if key in self._levels:
            self._levels.move_to_end(key)
            return self._levels[key]
        for attempt in range(10_000):
            level = self.generate_level(stable_hash(self.env_id, task.split, task.index, attempt))
            if self.split_of(level) == task.split:
                break
        else:  # pragma: no cover - only with a degenerate heldout_fraction
            raise RuntimeError(f"{self.env_id}: no level for {task.task_id} after 10000 attempts")
        self._levels[key] = level
        if len(self._levels) > self.level_cache_size:
            self._levels.popitem(last=False)
        return level

    # ------------------------------------------------------------------ the contract
    def reset(self, task: Task | None = None, seed: int | None = None) -> str:  # type: ignore[override]
        """Start an episode of ``task`` (default: train task ``seed``); ``seed`` drives the
        env's own randomness (slippery ice, tile spawns). Returns the first observation."""
        seed = 0 if seed is None else int(seed)
        if task is None:
            task = self.task("train", seed)
        self.current_task = task
        self.rng = random.Random(stable_hash("dynamics", seed))
        self.state = self.initial_state(self.level_for(task), self.rng)
        self.steps = 0
        self.done = False
        return self.render()

    def step(self, action: str) -> StepResult:
        """Apply one action. Invalid actions cost ``invalid_action_penalty`` and never raise."""
        if self.done:
            raise RuntimeError(f"{self.env_id}: step() after the episode ended; call reset() first")
        self.steps += 1
        truncated = self.steps >= self.max_steps
        try:
            parsed = self.parse_action(action)
            outcome = self.apply(parsed)
        except InvalidAction as err:
            self.done = truncated
            return StepResult(self.invalid_observation(str(err)), self.invalid_action_penalty, False, truncated, invalid_action=True)
        self.done = outcome.terminated or truncated
        return StepResult(
            self.render(),
            float(outcome.reward),
            bool(outcome.terminated),
            bool(truncated and not outcome.terminated),
            invalid_action=False,
            success=bool(outcome.success),
            info=dict(outcome.info),
        )

    # ------------------------------------------------------------------ capabilities
    def snapshot(self) -> EnvSnapshot:
        """A full, independent copy of the episode state (including the env's RNG)."""
        payload = (copy.deepcopy(self.state), self.rng.getstate(), self.current_task, self.steps, self.done)
        return EnvSnapshot(self.env_id, payload)

    def restore(self, snapshot: EnvSnapshot) -> str:
        """Return to a state taken by ``snapshot()`` (the snapshot stays reusable); returns
        the observation of that state."""
        if not isinstance(snapshot, EnvSnapshot) or snapshot.env_id != self.env_id:
            raise TypeError(f"{self.env_id}: restore() needs an EnvSnapshot taken from this env id")
        state, rng_state, task, steps, done = snapshot.payload
        self.state = copy.deepcopy(state)
        self.rng.setstate(rng_state)
        self.current_task, self.steps, self.done = task, steps, done
        return self.render()

    def reseed(self, seed: int) -> None:
        """Draw the env's dynamics from ``seed`` from now on (a fresh future after ``restore``)."""
        self.rng.seed(seed)

    def anchor_key(self) -> str:
        """A key of the current state: equal keys mean the same state (GiGPO anchors)."""
        return hashlib.blake2b(self.render().encode(), digest_size=12).hexdigest()


__all__ = ["InvalidAction", "LevelEnv", "LevelTasks", "Outcome"]
