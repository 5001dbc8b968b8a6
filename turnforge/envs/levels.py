"""``LevelEnv``: the env contract for procedurally generated levels, from a few hooks.

An env author subclasses ``LevelEnv`` and writes:

- ``generate_level(level_seed)``: build a level (deterministic in the seed; a generator that
  can fail, e.g. an unsolvable room, redraws from derived seeds with ``redraw``);
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

Guidance (optional): set ``guidance_levels`` (one description per level) and write
``hints(level) -> list[str]``, hints about ``self.state`` for guidance level ``level``; a hint
that needs the solver adds 1 to ``self.expert_queries``. A guard (undoing a losing move) lives
in ``apply``, which may set ``self.guard_note`` to say what it undid; each note shown counts as
one expert query too. With ``guidance=k > 0``,
``reset`` and ``step`` append the note and the hints to the observation (``add_guidance``);
``render``, ``anchor_key`` and snapshots stay unguided. Hints must be weaker than the expert's
moves: never the next move itself.

Derived tasks (optional, capability "derive"): write ``derive_tasks(task, n, seed)`` from
``derived_tasks`` (below) and ``level_from_data(data)``. A derived task is a train task whose
``task.data["level"]`` holds the level's ``level_key`` text; ``level_for`` reads it from there.

Tool-using envs (``turnforge.envs.tool``) also set ``tools`` and ``observation_role = "tool"``.
Integer ``info`` values under keys starting with ``n_`` are event counters (tool calls,
truncated outputs, ``n_expert_queries`` of guidance, ...), summed per iteration in the metrics.
"""

from __future__ import annotations

import copy
import hashlib
import random
from abc import abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterable, Mapping, TypeVar

from turnforge.envs.base import Env, InvalidAction, add_guidance
from turnforge.envs.tasks import TaskSource
from turnforge.errors import UserError
from turnforge.seeding import stable_hash
from turnforge.types import EnvSnapshot, Scalar, StepResult, Task

LevelT = TypeVar("LevelT")
T = TypeVar("T")


def redraw(draw: Callable[[int], T | None], attempts: int, failure: str) -> T:
    """``draw(attempt)`` for attempt 0, 1, ... until it gives something (None: rejected, draw
    again); ``RuntimeError(failure)`` after ``attempts`` rejections. Each draw derives its own
    random stream from the attempt (``stable_hash(..., attempt)``), so what is drawn depends on the
    seed alone."""
    for attempt in range(attempts):
        got = draw(attempt)
        if got is not None:
            return got
    raise RuntimeError(failure)


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
    #: First index of derived tasks: above any generated task's, so their ids never collide.
    derived_index_base: int = 2**40

    def __init__(self, *, invalid_action_penalty: float = -0.1, max_steps: int = 100, guidance: int = 0,
                 first_word: bool = False) -> None:
        self.invalid_action_penalty = float(invalid_action_penalty)
        self.max_steps = int(max_steps)
        self.first_word = bool(first_word)  # parse_choice(..., first_word): the action is the answer's first word
        if isinstance(guidance, bool) or not isinstance(guidance, int) or not 0 <= guidance <= len(self.guidance_levels):
            levels = "; ".join(["0 = off", *(f"{k} = {d}" for k, d in enumerate(self.guidance_levels, 1))])
            raise UserError(f"{type(self).__name__}: guidance={guidance!r} is not a guidance level; valid levels: {levels}")
        #: Guidance level (0 = off; see ``guidance_levels``).
        self.guidance = guidance
        self.state: Any = None
        self.rng = random.Random(0)
        self.current_task: Task | None = None
        self.steps = 0
        self.done = True
        #: What a guard in ``apply`` undid this step ("" = nothing); shown as the first hint.
        self.guard_note = ""
        #: Solver-backed hints computed for the observation being built (``hints`` adds to it).
        self.expert_queries = 0
        #: Solver-backed hints in the observation the last ``reset`` returned.
        self.reset_expert_queries = 0
        #: Levels generated or read from task data, least recently used first (the envs of one
        #: ``make_batch`` share one cache; ``level_cache_size`` bounds it).
        self.level_cache: OrderedDict[tuple[str, Any], LevelT] = OrderedDict()
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

    def hints(self, level: int) -> list[str]:
        """Hints (one line each) about ``self.state`` at guidance level ``level`` >= 1; add 1
        to ``self.expert_queries`` for each hint that ran the solver. Default: none."""
        return []

    def level_from_data(self, data: Mapping[str, Any]) -> LevelT:
        """The level that ``data["level"]`` (a ``level_key`` text) describes, for derived tasks."""
        raise UserError(
            f"{type(self).__name__} cannot read a level from task.data; implement level_from_data(data) "
            "to use tasks that carry their level (derived tasks)"
        )

    def invalid_observation(self, reason: str) -> str:
        """The observation after an invalid action (``reason`` says what was wrong)."""
        return f"Invalid action: {reason}. Valid actions: {self.valid_actions_text}.\n{self.render()}"

    # ------------------------------------------------------------------ levels
    def split_of(self, level: LevelT) -> str:
        """Which split a level belongs to, from a hash of its content."""
        bucket = stable_hash("split", self.level_key(level)) % 10_000
        return "heldout" if bucket < self.heldout_fraction * 10_000 else "train"

    def level_for(self, task: Task) -> LevelT:
        """The level of ``task``: ``task.data["level"]`` when the task carries one (derived tasks,
        cached by content), else the first generated level whose content falls in the task's split."""
        if task.data is not None and "level" in task.data:
            return self._level_in_data(task)
        key = (task.split, task.index)
        if key in self.level_cache:
            self.level_cache.move_to_end(key)
            return self.level_cache[key]
        level = redraw(lambda attempt: self._level_in_split(task, attempt), 10_000,  # (only a degenerate heldout_fraction fails)
                       f"{self.env_id}: no level for {task.task_id} after 10000 attempts")
        self._cache_level(key, level)
        return level

    def _level_in_split(self, task: Task, attempt: int) -> LevelT | None:
        """The level generated for ``task`` at ``attempt``, or None when it falls in the other split."""
        level = self.generate_level(stable_hash(self.env_id, task.split, task.index, attempt))
        return level if self.split_of(level) == task.split else None

    def _level_in_data(self, task: Task) -> LevelT:
        text = task.data["level"]  # type: ignore[index]
        key = ("level", text if isinstance(text, str) else repr(text))
        if key in self.level_cache:
            self.level_cache.move_to_end(key)
            level = self.level_cache[key]
        else:
            try:
                level = self.level_from_data(task.data)  # type: ignore[arg-type]
            except (ValueError, TypeError, KeyError) as err:
                raise UserError(f"{self.env_id}: task {task.task_id} carries a level that does not parse: {err}") from None
            self._cache_level(key, level)
        if task.split == "train" and self.split_of(level) == "heldout":
            raise UserError(f"{self.env_id}: train task {task.task_id} carries a held-out level; held-out levels must stay unseen")
        return level

    def _cache_level(self, key: tuple[str, Any], level: LevelT) -> None:
        self.level_cache[key] = level
        if len(self.level_cache) > self.level_cache_size:
            self.level_cache.popitem(last=False)

    def derived_tasks(
        self,
        parent: Task,
        candidates: Iterable[tuple[LevelT, str, int]],
        n: int,
        easier: Callable[[LevelT], bool],
    ) -> list[Task]:
        """Up to ``n`` derived train tasks of ``parent`` from ``candidates`` (``(level, how, k)``,
        tried in order, lazily): a candidate is skipped when its level is held out, equals the
        parent's or an earlier one's, or fails ``easier`` (which should check with the solver that
        it is solvable and easier). Task ``index`` is ``derived_index_base + stable_hash(parent id,
        how, k) % derived_index_base``; ``data`` holds ``level`` (the ``level_key`` text), ``parent``
        (the parent's task id) and ``how``. A held-out parent raises: its variants would leak
        held-out content into training."""
        if parent.split != "train":
            raise ValueError(f"{self.env_id}: derive tasks from train tasks only, not {parent.task_id}")
        seen = {self.level_key(self.level_for(parent))}
        out: list[Task] = []
        indices: set[int] = set()
        for level, how, k in candidates:
            if len(out) >= n:
                break
            text = self.level_key(level)
            if text in seen or self.split_of(level) == "heldout":
                continue
            seen.add(text)
            index = self.derived_index_base + stable_hash(parent.task_id, how, k) % self.derived_index_base
            if index in indices or not easier(level):
                continue
            indices.add(index)
            out.append(Task(self.env_id, "train", index, {"level": text, "parent": parent.task_id, "how": how}))
        return out

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
        self.guard_note = ""
        observation, self.reset_expert_queries = self._guided(self.render())
        return observation

    def _unreported(self) -> int:
        """The reset observation's expert queries, reported with the first step (a reset has
        no info where the env pool could carry them)."""
        n = self.reset_expert_queries if self.steps == 1 else 0
        return n

    def step(self, action: str) -> StepResult:
        """Apply one action. Invalid actions cost ``invalid_action_penalty`` and never raise."""
        if self.done:
            raise RuntimeError(f"{self.env_id}: step() after the episode ended; call reset() first")
        self.steps += 1
        truncated = self.steps >= self.max_steps
        self.guard_note = ""
        try:
            parsed = self.parse_action(action)
            outcome = self.apply(parsed)
        except InvalidAction as err:
            self.done = truncated
            observation, queries = self._guided(self.invalid_observation(str(err)))
            info = {"n_expert_queries": queries + self._unreported()} if self.guidance else {}
            return StepResult(observation, self.invalid_action_penalty, False, truncated, invalid_action=True, info=info)
        self.done = outcome.terminated or truncated
        observation, queries = self._guided(self.render())
        info = dict(outcome.info)
        if self.guidance:
            info["n_expert_queries"] = queries + self._unreported()
        return StepResult(
            observation,
            float(outcome.reward),
            bool(outcome.terminated),
            bool(truncated and not outcome.terminated),
            invalid_action=False,
            success=bool(outcome.success),
            info=info,
        )

    def _guided(self, observation: str) -> tuple[str, int]:
        """``observation`` with the guard's note and the hints of ``self.guidance`` appended, and
        the number of expert queries they cost: each solver-backed hint, and the guard's note
        (the guard knows the room can no longer be solved: it is counted as one query even
        where a rule rather than the solver decides). No hints once the episode has ended
        (nobody acts on them); the guard's note is still shown."""
        if not self.guidance:
            return observation, 0
        self.expert_queries = 0
        hints = [self.guard_note] if self.guard_note else []
        if not self.done:
            hints += self.hints(self.guidance)
        return add_guidance(observation, hints), self.expert_queries + bool(self.guard_note)

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
