"""The env contract: a multi-turn text environment in two methods.

A minimal env (see ``examples/`` for a complete one)::

    class GuessNumber(turnforge.Env):
        instructions = "Guess the secret number between 1 and 100; answer with the number."
        tasks = TaskGenerator(lambda rng: {"secret": rng.randint(1, 100)})

        def reset(self, task, seed):
            self.secret, self.guesses = task.data["secret"], 0
            return "Guess a number between 1 and 100."

        def step(self, action):
            ...
            return StepResult(observation, reward, terminated, truncated, invalid_action=..., success=...)

``reset(task, seed) -> observation`` starts an episode of ``task`` (a ``turnforge.types.Task``;
dataset and generated tasks carry their fields in ``task.data``), with ``seed`` for the env's
own randomness; ``step(action) -> StepResult`` applies the model's text. Text in, text out.
Tasks come from ``tasks`` (a ``TaskSource``: a dataset with its own train/held-out split, a
generator, or ``env.tasks=PATH.jsonl`` in the recipe). Invalid actions are part of the game:
``step`` returns ``invalid_action=True`` with an observation that says what was wrong, and
never raises for them. The rollout engine ends episodes at ``rollout.max_turns``, so an env
needs no step limit of its own.

Everything else is an optional capability, found by ``capabilities(env)``; an option that
needs a missing one stops the run at start with a one-line error naming the method:

- ``snapshot() -> EnvSnapshot`` (``turnforge.types``) and ``restore(snapshot)``: Monte-Carlo values (MC-critic,
  MC-GRPO) and resuming an episode in a restarted env worker;
- ``anchor_key() -> str``: a key of the current state (GiGPO's step-level groups);
- ``potential() -> float``: potential-based reward shaping;
- ``expert_action() -> str``: behaviour-cloning demonstrations;
- ``expert_summary() -> str``: what a summary of the episode so far must carry, the expert's
  summary in demonstrations with ``rollout.context=summarize``;
- ``action_names`` (a small discrete action set) or ``random_action(rng) -> str``: random
  actions (noisy demonstrators, random-policy Monte-Carlo rollouts, ``check_env``);
- ``reseed(seed)``: a fresh future after ``restore`` (Monte-Carlo rollouts of stochastic envs);
- ``guidance_levels`` (non-empty): hints of graded strength (Agent-RLVR-style guidance),
  turned on by the env's ``guidance=LEVEL`` option. A guided observation is the plain one
  plus lines ``HINT_PREFIX + hint``; ``strip_guidance`` recovers the plain one. Hints that ran
  the env's solver, and guard notes, are counted in ``info["n_expert_queries"]`` (and, for the first
  observation, ``env.reset_expert_queries``, also added to the first step's count);
- ``derive_tasks(task, n, seed) -> list[Task]``: easier train tasks derived from ``task``
  (a self-evolving curriculum, as in WebRL); they carry their level in ``task.data``;
- ``final_answer(action_text) -> str | None``: the answer an action gives, which best-of-N
  majority voting compares across attempts (``turnforge eval --best-of N --select vote``);
- ``close()``: release what the env holds outside Python objects (an MCP env's server
  process); env backends call it when they close;
- ``task_label(task) -> str``: a category of the task (a MiniWoB task, a mix member, a gui-click
  kind); evaluations then report success per label too (``EvalResult.by_label``);
- ``observation_images() -> tuple[bytes, ...]``: PNG bytes of the images shown with the latest
  observation (after ``reset``, ``restore`` and ``step``); the env host puts them in
  ``StepResult.images`` and a vision-language policy sees each one, rendered by its processor,
  before the observation's text (``turnforge.policy.vision``); a text-only model refuses such an env.

``turnforge.envs.levels.LevelEnv`` implements snapshots, anchor keys and reseeding for
procedurally generated levels from a handful of hooks, and the plumbing of guidance and
derived tasks (the game writes the hints and the derivations); the built-in games use it.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Sequence

from turnforge.errors import UserError
from turnforge.types import SPLITS, StepResult, Task

if TYPE_CHECKING:
    from turnforge.envs.tasks import TaskSource


class InvalidAction(Exception):
    """Raised by a ``LevelEnv``'s ``parse_action``/``apply`` hooks; ``step`` turns it into an observation."""


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)


def parse_choice(text: str, names: Sequence[str], first_word: bool = False) -> int:
    """Index of the action name that ``text`` spells (case-insensitive, whole stripped text).

    If ``text`` contains ``<answer>X</answer>`` tags, the last ``X`` is matched instead. With
    ``first_word``, only the first word of the text counts ("Down, because..." is Down): for
    pretrained chat models that explain their move. Anything else raises ``InvalidAction``.
    """
    tagged = _ANSWER_TAG.findall(text)
    word = (tagged[-1] if tagged else text).strip().lower()
    if first_word and not tagged:
        match = _FIRST_WORD.match(word)
        word = match.group(0) if match else word
    for i, name in enumerate(names):
        if word == name.lower():
            return i
    shown = repr(text) if len(repr(text)) <= 40 else repr(text)[:36] + "...'"
    raise InvalidAction(f"could not parse {shown} as an action")


_FIRST_WORD = re.compile(r"[a-z0-9]+")


#: Start of each hint line that guidance appends to an observation.
HINT_PREFIX = "Hint: "


def add_guidance(observation: str, hints: Sequence[str]) -> str:
    """``observation`` with one ``HINT_PREFIX`` line per hint appended (unchanged when there are none)."""
    for hint in hints:
        if "\n" in hint or "\r" in hint:
            raise ValueError(f"a hint must be one line; got {hint!r}")
    if not hints:
        return observation
    return observation + "\n" + "\n".join(HINT_PREFIX + h for h in hints)


def strip_guidance(observation: str) -> str:
    """The unguided observation: ``observation`` without the hint lines that guidance appended
    (the trailing lines starting with ``HINT_PREFIX``; the first line is always kept). Exact
    for every observation whose own last line does not start with ``HINT_PREFIX``."""
    lines = observation.split("\n")
    keep = len(lines)
    while keep > 1 and lines[keep - 1].startswith(HINT_PREFIX):
        keep -= 1
    return "\n".join(lines[:keep])


#: Hooks of turnforge's first env contract (now ``LevelEnv``'s): an ``Env`` subclass that
#: defines them but not ``reset``/``step`` was written for it.
OLD_HOOKS = ("generate_level", "level_key", "initial_state", "render", "parse_action", "apply", "valid_actions_text")


class Env(ABC):
    """Base class of turnforge environments: ``reset(task, seed)`` and ``step(action)``
    (see the module docstring for the optional capabilities)."""

    #: Registry id; ``make`` sets it on the instance.
    env_id: str = "unregistered"
    #: The options ``make`` built this env with (None = not built by ``make``); ``check_env``
    #: builds a second env of the same options from them.
    made_with: dict[str, Any] | None = None
    #: Rules and action format, shown to the policy as the system prompt ("" = none).
    instructions: str = ""
    #: Chat role of the observations after the first (the first is always the user's
    #: message): "user", or "tool" for the results of tool calls.
    observation_role: str = "user"
    #: JSON schemas of the tools the agent may call (HF ``apply_chat_template(tools=...)``
    #: format); () for envs without tools.
    tools: tuple[dict[str, Any], ...] = ()
    #: The action texts of a small discrete action set, or () when actions are open text.
    action_names: tuple[str, ...] = ()
    #: Where tasks come from (``turnforge.envs.tasks``); None = given by the recipe (``env.tasks``).
    tasks: TaskSource | None = None
    #: One line describing each guidance level (level k is ``guidance_levels[k - 1]``);
    #: () = the env gives no hints. Envs with levels take a ``guidance=k`` option (0 = off).
    guidance_levels: tuple[str, ...] = ()
    #: True when all tasks may be one and the same game (a fixed-map Gymnasium env): the
    #: checker then warns, instead of failing, when every task it draws plays alike.
    tasks_may_be_alike: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> "Env":
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        old = [hook for hook in OLD_HOOKS if callable(getattr(cls, hook, None))]
        if missing and old:
            raise UserError(
                f"{cls.__name__} is written for turnforge's old env hooks ({', '.join(old)}) and lacks "
                f"{' and '.join(m + '()' for m in missing)}: subclass turnforge.envs.LevelEnv, which builds reset(task, "
                "seed) and step(action) from those hooks, or implement the two methods on turnforge.Env (README, "
                "'Bring your own env')"
            )
        return super().__new__(cls)

    @abstractmethod
    def reset(self, task: Task, seed: int) -> str:
        """Start an episode of ``task``; ``seed`` drives the env's own randomness. Returns
        the first observation."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the model's action text. Invalid actions return ``invalid_action=True``
        (with an observation saying what was wrong); they never raise."""

    def task(self, split: str, index: int) -> Task:
        """Task ``index`` of ``split`` ('train' or 'heldout') from ``self.tasks``."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if index < 0:
            raise ValueError(f"task index must be >= 0, got {index}")
        return replace(self.task_source().task(split, int(index)), env_id=self.env_id)

    def read_tasks(self, path: str, heldout_fraction: float | None = None) -> TaskSource:
        """The task source ``env.tasks=PATH`` gives this env: a JSONL file of task dicts (each with
        a 'split', or split by content with ``heldout_fraction``). An env that reads another format
        (the terminal env: Harbor task directories) overrides it."""
        from turnforge.envs.tasks import TaskDataset

        return TaskDataset.from_jsonl(path, heldout_fraction=heldout_fraction)

    def task_source(self) -> TaskSource:
        """``self.tasks``, or a one-line error saying how to give the env tasks."""
        if self.tasks is None:
            raise UserError(
                f"env {self.env_id!r} has no tasks: set env.tasks=PATH.jsonl (one task per line, with a 'split' of "
                f"'train' or 'heldout') or give {type(self).__name__} a `tasks` source (turnforge.envs.tasks)"
            )
        return self.tasks


# ---------------------------------------------------------------------------- capabilities
#: Capability name -> the methods/attributes that provide it (quoted in error messages).
CAPABILITY_METHODS: dict[str, str] = {
    "snapshot": "snapshot() and restore(snapshot)",
    "anchor_key": "anchor_key()",
    "potential": "potential()",
    "expert": "expert_action()",
    "expert_summary": "expert_summary()",
    "random_action": "action_names or random_action(rng)",
    "reseed": "reseed(seed)",
    "guidance": "guidance_levels (one description per hint level) and hints(level), turned on by a guidance=LEVEL option",
    "derive": "derive_tasks(task, n, seed)",
    "final_answer": "final_answer(action_text) (the answer an action gives, for majority voting)",
}


@dataclass(frozen=True)
class Capabilities:
    """The optional capabilities an env implements (``capabilities(env)``)."""

    snapshot: bool
    anchor_key: bool
    potential: bool
    expert: bool
    expert_summary: bool
    random_action: bool
    reseed: bool
    guidance: bool
    derive: bool
    final_answer: bool = False
    images: bool = False

    def require(self, name: str, env_id: str, needed_by: str, otherwise: str = "") -> None:
        """Raise ``UserError`` naming the method to add (and ``otherwise``, another fix)
        unless capability ``name`` is present."""
        if not getattr(self, name):
            alt = f", or {otherwise}" if otherwise else ""
            raise UserError(f"{needed_by} needs env {env_id!r} to implement {CAPABILITY_METHODS[name]}{alt}")

    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if getattr(self, f.name))


def close_env(env: object) -> None:
    """Call ``env``'s optional ``close()`` (an MCP env's server, a browser env's browser); no-op without one."""
    close = getattr(env, "close", None)
    if callable(close):
        close()


def capabilities(env: Env) -> Capabilities:
    """Which optional capabilities ``env`` implements (methods present on the object)."""

    def has(name: str) -> bool:
        return callable(getattr(env, name, None))

    return Capabilities(
        snapshot=has("snapshot") and has("restore"),
        anchor_key=has("anchor_key"),
        potential=has("potential"),
        expert=has("expert_action"),
        expert_summary=has("expert_summary"),
        random_action=bool(env.action_names) or has("random_action"),
        reseed=has("reseed"),
        guidance=bool(getattr(env, "guidance_levels", ())),
        derive=has("derive_tasks"),
        final_answer=has("final_answer"),
        images=has("observation_images"),
    )

