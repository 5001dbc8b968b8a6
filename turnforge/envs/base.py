"""The environment contract: multi-turn text environments.

``reset(seed, task) -> observation`` and ``step(action_text) -> StepResult``. Text in, text
out. An env author subclasses ``Env`` and writes a few hooks:

- ``generate_level(level_seed)``: build a level (deterministic in the seed);
- ``level_key(level)``: a string that identifies the level's content (decides its split);
- ``initial_state(level, rng)``: the mutable game state for a fresh episode;
- ``render()``: the observation text of ``self.state`` (deterministic);
- ``parse_action(text)``: text -> action, or raise ``InvalidAction(reason)``;
- ``apply(action) -> Outcome``: advance ``self.state``;
- ``expert_action()`` (optional): a solver's next action, for demonstrations.

Tool-using envs (``turnforge.envs.tool``) also set ``tools`` (JSON schemas the chat template
renders into the system prompt) and ``observation_role = "tool"`` (observations after the
first come back as tool messages). Integer ``info`` values under keys starting with ``n_``
are event counters (tool calls, truncated outputs, ...), summed per iteration in the metrics.

Everything mutable lives in ``self.state`` and ``self.rng``, so ``snapshot()``/``restore()``
copy full env state without help from the author. Invalid actions are part of the game:
they cost ``invalid_action_penalty``, leave the state unchanged, and produce an
observation that says what was wrong. They never raise.
"""

from __future__ import annotations

import copy
import hashlib
import random
import re
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generic, Mapping, Sequence, TypeVar

from turnforge.types import SPLITS, Scalar, StepResult, Task

LevelT = TypeVar("LevelT")


class InvalidAction(Exception):
    """Raised by ``parse_action``/``apply`` hooks; ``Env.step`` turns it into an observation."""


@dataclass(frozen=True)
class Outcome:
    """What an ``apply`` hook reports about one valid action."""

    reward: float
    terminated: bool = False
    success: bool = False
    info: Mapping[str, Scalar] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvSnapshot:
    """Opaque full copy of an env's episode state; pass it to ``Env.restore``."""

    env_id: str
    payload: Any


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)


def parse_choice(text: str, names: Sequence[str]) -> int:
    """Index of the action name that ``text`` spells (case-insensitive, whole stripped text).

    If ``text`` contains ``<answer>X</answer>`` tags, the last ``X`` is matched instead.
    Anything else raises ``InvalidAction``.
    """
    tagged = _ANSWER_TAG.findall(text)
    word = (tagged[-1] if tagged else text).strip().lower()
    for i, name in enumerate(names):
        if word == name.lower():
            return i
    shown = repr(text) if len(repr(text)) <= 40 else repr(text)[:36] + "...'"
    raise InvalidAction(f"could not parse {shown} as an action")


def stable_hash(*parts: object) -> int:
    """A 63-bit hash of ``parts`` that is stable across processes (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Env(ABC, Generic[LevelT]):
    """Base class of all turnforge environments (see the module docstring for the hooks)."""

    #: Registry id; ``make`` sets it on the instance.
    env_id: str = "unregistered"
    #: Share of generated levels that fall in the held-out split (by content hash).
    heldout_fraction: float = 0.1
    #: How many generated levels to keep in memory (generation may run a solver).
    level_cache_size: int = 4096
    #: The action texts of a small discrete action set, or () when actions are open text
    #: (tool calls, code). Noisy demonstrators draw their random actions from it.
    action_names: tuple[str, ...] = ()
    #: Chat role of the observations after the first (the first is always the user's
    #: message): "user", or "tool" for the results of tool calls.
    observation_role: str = "user"

    def __init__(self, *, invalid_action_penalty: float = -0.1, max_steps: int = 100) -> None:
        self.invalid_action_penalty = float(invalid_action_penalty)
        self.max_steps = int(max_steps)
        self.state: Any = None
        self.rng = random.Random(0)
        self.current_task: Task | None = None
        self.steps = 0
        self.done = True
        self._levels: OrderedDict[tuple[str, int], LevelT] = OrderedDict()

    # ------------------------------------------------------------------ hooks
    @property
    @abstractmethod
    def instructions(self) -> str:
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

    @property
    def tools(self) -> tuple[dict[str, Any], ...]:
        """JSON schemas of the tools the agent may call (HF ``apply_chat_template(tools=...)``
        format); () for envs without tools."""
        return ()

    def invalid_observation(self, reason: str) -> str:
        """The observation after an invalid action (``reason`` says what was wrong)."""
        return f"Invalid action: {reason}. Valid actions: {self.valid_actions_text}.\n{self.render()}"

    def potential(self) -> float:
        """Potential Phi of the current state for potential-based reward shaping (Ng et al.
        1999); higher = closer to success. 0 by default (no shaping)."""
        return 0.0

    def expert_action(self) -> str:
        """The expert's next action text from the current state (for demonstrations)."""
        raise NotImplementedError(f"{type(self).__name__} has no expert policy")

    # ------------------------------------------------------------------ tasks
    def task(self, split: str, index: int) -> Task:
        """The task ``index`` of ``split`` ('train' or 'heldout')."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if index < 0:
            raise ValueError(f"task index must be >= 0, got {index}")
        return Task(self.env_id, split, int(index))  # type: ignore[arg-type]

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

    # ------------------------------------------------------------------ API
    def reset(self, seed: int | None = None, task: Task | None = None) -> str:
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

    def step(self, action_text: str) -> StepResult:
        """Apply one action. Invalid actions cost ``invalid_action_penalty`` and never raise."""
        if self.done:
            raise RuntimeError(f"{self.env_id}: step() after the episode ended; call reset() first")
        self.steps += 1
        truncated = self.steps >= self.max_steps
        try:
            action = self.parse_action(action_text)
            outcome = self.apply(action)
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

    def snapshot(self) -> EnvSnapshot:
        """A full, independent copy of the episode state (including the env's RNG)."""
        payload = (copy.deepcopy(self.state), self.rng.getstate(), self.current_task, self.steps, self.done)
        return EnvSnapshot(self.env_id, payload)

    def restore(self, snapshot: EnvSnapshot) -> None:
        """Return to a state taken by ``snapshot()`` (the snapshot stays reusable)."""
        if not isinstance(snapshot, EnvSnapshot) or snapshot.env_id != self.env_id:
            raise TypeError(f"{self.env_id}: restore() needs an EnvSnapshot taken from this env id")
        state, rng_state, task, steps, done = snapshot.payload
        self.state = copy.deepcopy(state)
        self.rng.setstate(rng_state)
        self.current_task, self.steps, self.done = task, steps, done

    def anchor_key(self) -> str:
        """A key of the current state: equal keys mean the same state (GiGPO anchors)."""
        return hashlib.blake2b(self.render().encode(), digest_size=12).hexdigest()
