"""``check_env``: run an env through the contract and name the fix for each violation.

Works on any ``Env`` (light or ``LevelEnv``, built-in or third-party). It plays the env with
the actions it can find (``action_names``, ``random_action(rng)``, the expert's, or for a
``LevelEnv`` the words of ``valid_actions_text`` that ``parse_action`` accepts) and checks:

- types: ``reset`` returns a str, ``step`` a ``StepResult`` of the right types;
- tasks: a task source with train and held-out tasks, disjoint by content, and a held-out
  split of at least ``min_heldout`` distinct tasks (evaluation on fewer moves in big steps);
- determinism: the same task and seed give the same episode, also after another episode of
  the task was played (an env that hands the same mutable level object to every reset
  fails here);
- independence: two envs of one batch playing the same task at once do not change each
  other (shared mutable state corrupts the G parallel rollouts of a group);
- tasks differ: the same actions from the same seed play differently on different tasks
  (first observation and results); an env whose tasks all play alike (a library keyed by a
  seed it ignores) fails, and held-out tasks that play like train tasks are warned about;
- invalid actions: runs of 1, 2 and 3 garbage actions in a row, at the start and in the
  middle of an episode, are each flagged invalid and change nothing: the episode goes on
  exactly as if they had not been sent (hidden state included, e.g. a count of errors that
  ends the game at the second one, not only the anchor key);
- snapshots (when the env has them): ``restore`` brings back the state, in the same env and
  in another one, again and again, and snapshots pickle (env workers ship them);
- the expert (when there is one): its actions are valid, and on a deterministic env it wins;
- action lengths (given a tokenizer and ``max_new_tokens``): an action that needs more
  tokens than the rollout allows would always be cut, so it fails the check, naming the
  ``rollout.max_new_tokens`` it needs.

Failures raise ``EnvCheckError`` (an ``AssertionError``) whose message says what to change;
an exception raised in the env's own code (a solver's assertion, an unsupported task) is an
``EnvCodeError``, one line naming the env method and the exception (the traceback is its
``__cause__``). ``check_env`` returns a ``CheckReport`` with the checks that ran and the
warnings. An env with no actions the checker can play (no ``action_names``, ``random_action``
or ``expert_action``) fails, since the state checks cannot run, unless ``allow_no_actions``.
"""

from __future__ import annotations

import copy
import hashlib
import io
import pickle
import random
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, NoReturn, Sequence

from turnforge.envs.base import Env, InvalidAction, capabilities, close_env
from turnforge.envs.levels import LevelEnv
from turnforge.errors import UserError
from turnforge.types import THINKING_MARKERS, EnvSnapshot, StepResult, Task

#: An action text no env should accept.
GARBAGE_ACTION = "<<turnforge check_env: this is not an action>>"
#: Lengths of the runs of invalid actions in a row the checker sends (an env may count errors).
INVALID_RUNS = (1, 2, 3)
#: Actions played from each task for the "tasks differ" check.
FINGERPRINT_STEPS = 4
#: The fix ``check_action_lengths`` names, for the budget ``n`` an action needs: the config key.
SET_MAX_NEW_TOKENS = "set rollout.max_new_tokens={n} or more"


class EnvCheckError(AssertionError):
    """The env breaks the contract; the message says what to change."""


class EnvCodeError(EnvCheckError):
    """An exception escaped the env's own code during the check: the message names the env
    method and the exception; the exception itself (with its traceback) is ``__cause__``."""


@dataclass
class CheckReport:
    """What ``check_env`` checked and what it warns about (problems that do not stop a run)."""

    env_id: str
    checks: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check_env(
    env: Env | str,
    *,
    env_kwargs: Mapping[str, Any] | None = None,
    tasks: str | None = None,
    heldout_fraction: float | None = None,
    make_another: Callable[[], Env] | None = None,
    episodes: int = 3,
    max_steps: int = 200,
    split_sample: int = 50,
    min_heldout: int = 10,
    deterministic: bool | None = None,
    invalid_action: str | None = GARBAGE_ACTION,
    expert_solves: bool = True,
    tokenizer: Any = None,
    max_new_tokens: int | None = None,
    quick: bool = False,
    allow_no_actions: bool = False,
    distinct_sample: int | None = None,
    max_new_tokens_fix: str = SET_MAX_NEW_TOKENS,
) -> CheckReport:
    """Check ``env`` (an instance, or a registered id made with ``env_kwargs`` and the task
    file ``tasks``); raise ``EnvCheckError`` at the first contract violation.

    ``make_another`` builds a second env for the batch-independence check (default: the
    registry's ``make_batch`` for an id, a deep copy of a fresh instance; skipped with a
    warning when neither works). ``episodes`` train and held-out tasks are played, each for at
    most ``max_steps`` steps; ``split_sample`` tasks per split are drawn for the split checks of
    a generated (unbounded) task source (the expert: up to the env's own ``max_steps`` where
    that is more). The expert must win every played task when the env
    is deterministic and ``expert_solves``; ``deterministic=None`` decides that by replaying
    with another seed. ``invalid_action`` is a text the env must reject (None skips that check,
    for envs that accept any text). ``tokenizer`` (a ``ChatFormat`` or HF tokenizer) with
    ``max_new_tokens`` adds the action-length check (``max_new_tokens_fix``: how the user raises
    that budget, ``{n}`` the tokens needed; the config key by default). ``quick``: one task per split and no
    expert-wins check (what ``turnforge train`` runs at start). ``allow_no_actions`` turns the
    failure for an env without playable actions into a warning. ``distinct_sample`` tasks per
    split (default 6, 2 when ``quick``) are played for the "tasks differ" check.
    """
    if isinstance(env, str):
        return _check_by_id(env, env_kwargs, tasks, heldout_fraction, make_another, episodes=episodes,
                            max_steps=max_steps, split_sample=split_sample, min_heldout=min_heldout,
                            deterministic=deterministic, invalid_action=invalid_action, expert_solves=expert_solves,
                            tokenizer=tokenizer, max_new_tokens=max_new_tokens, quick=quick,
                            allow_no_actions=allow_no_actions, distinct_sample=distinct_sample,
                            max_new_tokens_fix=max_new_tokens_fix)
    if not isinstance(env, Env):
        _fail(f"{type(env).__name__} is not a turnforge Env; subclass turnforge.Env (or turnforge.envs.LevelEnv)")
    try:
        return _check(env, make_another, episodes=episodes, max_steps=max_steps, split_sample=split_sample,
                      min_heldout=min_heldout, deterministic=deterministic, invalid_action=invalid_action,
                      expert_solves=expert_solves, tokenizer=tokenizer, max_new_tokens=max_new_tokens, quick=quick,
                      allow_no_actions=allow_no_actions, distinct_sample=distinct_sample,
                      max_new_tokens_fix=max_new_tokens_fix)
    except (EnvCheckError, UserError):
        raise
    except Exception as err:
        where = _raised_in(err)
        if where is None:  # raised by the checker itself: a bug, with its traceback
            raise
        text = " ".join(str(err).split())
        raise EnvCodeError(f"{where} raised {type(err).__name__}" + (f": {text[:500]}" if text else "")) from err


def _raised_in(err: BaseException) -> str | None:
    """The env method (or other function) the checker called when ``err`` was raised: the frame
    after the checker's last one in the traceback, as ``Class ('id').method()``; None when the
    checker's own code raised it."""
    tb, callee = err.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == __file__:
            callee = None
        elif callee is None:
            callee = tb.tb_frame
        tb = tb.tb_next
    if callee is None:
        return None
    owner = callee.f_locals.get("self")
    if isinstance(owner, Env):
        return f"{_name(owner)}.{callee.f_code.co_name}()"
    return f"{callee.f_code.co_name}() (in {callee.f_globals.get('__name__', '?')})"


def _check(env: Env, make_another: Callable[[], Env] | None, *, episodes: int, max_steps: int, split_sample: int,
           min_heldout: int, deterministic: bool | None, invalid_action: str | None, expert_solves: bool,
           tokenizer: Any, max_new_tokens: int | None, quick: bool, allow_no_actions: bool,
           distinct_sample: int | None, max_new_tokens_fix: str) -> CheckReport:
    """``check_env`` of an env instance (its options as there)."""
    report = CheckReport(env.env_id)
    if make_another is None:
        make_another = _copier(env, report)
    episodes = 1 if quick else episodes
    _check_text(env)
    tasks = _check_tasks(env, split_sample, min_heldout, report)
    played = [t for split in ("train", "heldout") for t in tasks[split][:episodes]]
    actions = _playable_actions(env, played[0], allow_no_actions, report)
    caps = capabilities(env)
    if not actions.empty:
        report.warnings += _check_tasks_differ(env, tasks, actions, distinct_sample or (2 if quick else 6))
        report.checks.append("tasks differ")
    _check_episodes(env, played, actions, max_steps, invalid_action, make_another, caps.snapshot)
    report.checks += ["types", "tasks", "reset determinism", "invalid actions" if invalid_action else "", "snapshots" if caps.snapshot else ""]
    other = make_another() if make_another is not None else None
    if other is not None and not actions.empty:
        _check_batch(env, other, played[0], actions, max_steps)
        report.checks.append("batch independence")
    if caps.expert:
        # the expert plays up to the env's own step limit where that is longer (long-horizon envs)
        expert_steps = max(max_steps, int(getattr(env, "max_steps", 0) or 0))
        _check_expert(env, played, expert_steps, deterministic if expert_solves and not quick else False)
        report.checks.append("expert")
    if tokenizer is not None and max_new_tokens is not None:
        too_long = check_action_lengths(env, tokenizer, max_new_tokens, played, max_steps, max_new_tokens_fix)
        if too_long:  # every such action would be cut: nothing the policy plays could be right
            _fail(too_long[0])
        report.checks.append("action lengths")
    report.checks = [c for c in report.checks if c]
    return report


def _check_by_id(env_id: str, env_kwargs: Mapping[str, Any] | None, tasks: str | None, heldout_fraction: float | None,
                 make_another: Callable[[], Env] | None, **options: Any) -> CheckReport:
    """``check_env`` of a registered id: two envs of one batch are built (the second for the
    batch-independence check, unless ``make_another``), checked, and closed here (a browser
    env's browsers with them)."""
    from turnforge.envs.registry import build_env, share_levels

    env, second = share_levels([build_env(env_id, dict(env_kwargs or {}), tasks, heldout_fraction) for _ in range(2)])
    try:
        return check_env(env, make_another=make_another or (lambda: second), **options)
    finally:
        for built in (env, second):
            close_env(built)


def _playable_actions(env: Env, first: Task, allow_no_actions: bool, report: CheckReport) -> _Actions:
    """The actions the checker plays (after a reset to ``first``: ``parse_action`` may look at the
    state); none is a failure, or a warning with ``allow_no_actions``."""
    _reset(env, first, 0)
    actions = _Actions(env)
    if actions.empty:
        what = (f"{_name(env)}: check_env found no actions to play, so it could not check determinism, invalid "
                "actions, snapshots or batch independence; give the env action_names, random_action(rng) or "
                "expert_action()")
        if not allow_no_actions:
            _fail(what + " (or accept a check without them: allow_no_actions=True, `turnforge check-env "
                  "--allow-no-actions`)")
        report.warnings.append(what)
    return actions


def _check_episodes(env: Env, played: list[Task], actions: _Actions, max_steps: int, invalid_action: str | None,
                    make_another: Callable[[], Env] | None, snapshots: bool) -> None:
    """Per played task (seed = its position): reset determinism, then invalid actions (unless
    ``invalid_action`` is None), then snapshots (when the env has them)."""
    for seed, task in enumerate(played):
        _check_reset(env, task, seed, actions, max_steps)
        if invalid_action is not None:
            _check_invalid_action(env, task, seed, actions, invalid_action, max_steps)
        if snapshots:
            _check_snapshot(env, task, seed, actions, make_another)


def _fail(message: str) -> NoReturn:
    raise EnvCheckError(message)


def _name(env: Env) -> str:
    return f"{type(env).__name__} ({env.env_id!r})"


def _is_level(env: Env) -> bool:
    """A LevelEnv that generates its levels (not one that reads them from task data)."""
    return isinstance(env, LevelEnv) and not getattr(env, "reads_task_data", False)


def _keep_state_hint(env: Env) -> str:
    if _is_level(env):
        return "keep all mutable episode state in self.state (deep-copyable) and draw all randomness from self.rng"
    return "make snapshot() copy every attribute step() changes, and restore() put each one back"


# ---------------------------------------------------------------------- actions
class _Actions:
    """Action texts for the env's current state: a random one, or the expert's half of the time."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.caps = capabilities(env)
        self.names = tuple(env.action_names) or (_valid_words(env) if _is_level(env) else ())
        self.empty = not (self.names or self.caps.random_action or self.caps.expert)

    def pick(self, rng: random.Random) -> str:
        env, caps = self.env, self.caps
        if caps.expert and (rng.random() < 0.5 or not (self.names or caps.random_action)):
            return _expert(env)
        if self.names:
            return rng.choice(self.names)
        if caps.random_action:
            return env.random_action(rng)
        return GARBAGE_ACTION


def _valid_words(env: LevelEnv) -> tuple[str, ...]:
    """The words of ``valid_actions_text`` that ``parse_action`` accepts (a ``LevelEnv``)."""
    words = [w.strip(" .'\"`") for w in re.split(r",|/|\||\bor\b|\n", env.valid_actions_text)]
    found = []
    for word in words:
        try:
            env.parse_action(word)
        except InvalidAction:
            continue
        except Exception as err:  # any other exception is a contract violation
            _fail(f"{_name(env)}.parse_action({word!r}) raised {type(err).__name__}; raise InvalidAction instead")
        found.append(word)
    return tuple(found)


def _expert(env: Env) -> str:
    """The expert's action as the engine sends it to the env: a thought before it (``<think>...</think>``,
    for reasoning models) removed."""
    action = env.expert_action()
    if not isinstance(action, str):
        _fail(f"{_name(env)}.expert_action() returned {type(action).__name__}; return the action text")
    for _, close in THINKING_MARKERS:
        action = action.rpartition(close)[2].lstrip("\n") if close in action else action
    return action


# ---------------------------------------------------------------------- playing
def _reset(env: Env, task: Task, seed: int) -> str:
    """The first observation; for an env that shows images, with their hashes appended (so that
    the determinism checks compare the images too)."""
    obs = env.reset(task=task, seed=seed)
    if not isinstance(obs, str):
        _fail(f"{_name(env)}.reset() returned {type(obs).__name__}; return the observation str")
    images = _images(env, "reset()")
    return obs if not images else obs + "\n[images " + " ".join(hashlib.sha256(p).hexdigest()[:16] for p in images) + "]"


def _images(env: Env, where: str) -> tuple[bytes, ...]:
    """``env.observation_images()`` (() for an env without it), checked: a tuple of images PIL reads."""
    if not callable(getattr(env, "observation_images", None)):
        return ()
    images = env.observation_images()
    if not isinstance(images, tuple) or not all(isinstance(p, bytes) for p in images):
        _fail(f"{_name(env)}.observation_images() after {where} returned {type(images).__name__}; return a tuple of "
              "PNG bytes")
    from PIL import Image, UnidentifiedImageError

    for k, png in enumerate(images):
        try:
            with Image.open(io.BytesIO(png)) as img:
                img.verify()
        except (UnidentifiedImageError, OSError, ValueError) as err:
            _fail(f"{_name(env)}.observation_images() after {where}: image {k} is not an image PIL can read ({err})")
    return images


def _step(env: Env, action: str) -> StepResult:
    try:
        result = env.step(action)
    except InvalidAction:
        _fail(f"{_name(env)}.step({action!r}) let InvalidAction escape; return a StepResult with invalid_action=True "
              "(a LevelEnv raises it only from parse_action/apply)")
    except Exception as err:
        _fail(
            f"{_name(env)}.step({action!r}) raised {type(err).__name__}: {err}; an action the env cannot use is an "
            "invalid action: return a StepResult with invalid_action=True (a LevelEnv raises InvalidAction in "
            "parse_action/apply)"
        )
    return _check_result(env, result, action)


def _check_result(env: Env, result: object, action: str) -> StepResult:
    where = f"{_name(env)}.step({action!r})"
    if not isinstance(result, StepResult):
        _fail(f"{where} returned a {type(result).__name__}; return a turnforge.types.StepResult")
    if not isinstance(result.observation, str):
        _fail(f"{where}: observation is {type(result.observation).__name__}; return a str")
    if not isinstance(result.reward, float):
        _fail(f"{where}: reward is {type(result.reward).__name__}; return a float")
    for flag in ("terminated", "truncated", "invalid_action", "success"):
        if not isinstance(getattr(result, flag), bool):
            _fail(f"{where}: {flag} is {type(getattr(result, flag)).__name__}; return a bool")
    if result.terminated and result.truncated:
        _fail(f"{where}: terminated and truncated are both True; a game that ended is terminated only")
    if result.success and not result.terminated:
        _fail(f"{where}: success without terminated; end the episode when it is won")
    if not isinstance(result.info, Mapping) or not all(
        isinstance(k, str) and isinstance(v, (float, int, str, bool)) for k, v in result.info.items()
    ):
        _fail(f"{where}: info must map str to scalars (float, int, str, bool), got {result.info!r}")
    if not (result.terminated or result.truncated):
        result = replace(result, images=_images(env, f"step({action!r})"))
    return result


def _draw(env: Env, task: Task, seed: int, actions: _Actions, rng: random.Random, n: int) -> tuple[list[str], list[StepResult]]:
    """Reset, then play up to ``n`` actions drawn in the live state; the actions and results."""
    _reset(env, task, seed)
    played, results = [], []
    while len(played) < n and not (results and (results[-1].terminated or results[-1].truncated)):
        played.append(actions.pick(rng))
        results.append(_step(env, played[-1]))
    return played, results


def _replay(env: Env, played: Sequence[str]) -> list[StepResult]:
    """Step ``played`` from the env's current state, stopping when the episode ends."""
    results: list[StepResult] = []
    for action in played:
        if results and (results[-1].terminated or results[-1].truncated):
            break
        results.append(_step(env, action))
    return results


def _first_difference(a: Sequence[StepResult], b: Sequence[StepResult]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"step {i + 1}: {_short(x.observation)} / reward {x.reward} vs {_short(y.observation)} / reward {y.reward}"
    return f"{len(a)} vs {len(b)} steps"


def _short(text: str) -> str:
    text = text.replace("\n", "\\n")
    return repr(text if len(text) <= 40 else text[:37] + "...")


# ---------------------------------------------------------------------- pieces
def _check_text(env: Env) -> None:
    if not isinstance(env.instructions, str):
        _fail(f"{_name(env)}.instructions is {type(env.instructions).__name__}; make it a str")
    if _is_level(env):
        for hook in ("instructions", "valid_actions_text"):
            value = getattr(env, hook)
            if not isinstance(value, str) or not value.strip():
                _fail(f"{_name(env)}.{hook} is {value!r}; return a non-empty str")
    if env.observation_role not in ("user", "tool"):
        _fail(f"{_name(env)}.observation_role is {env.observation_role!r}; use 'user' or 'tool'")


def _check_tasks(env: Env, sample: int, min_heldout: int, report: CheckReport) -> dict[str, list[Task]]:
    try:
        source = env.task_source()
    except UserError as err:
        _fail(str(err))
    tasks: dict[str, list[Task]] = {}
    keys: dict[str, set[str]] = {}
    for split in ("train", "heldout"):
        size = source.size(split)
        if size == 0:
            _fail(f"{_name(env)} has no {split} tasks; add {split} tasks to its task source")
        n = sample if size is None else min(size, sample)
        tasks[split] = [env.task(split, i) for i in range(n)]
        keys[split] = set()
        for t in tasks[split]:
            key = source.key(t)
            if not isinstance(key, str):
                _fail(f"{_name(env)}: the task source's key() returned {type(key).__name__}; return a str of the task's content")
            keys[split].add(key)
    shared = keys["train"] & keys["heldout"]
    if shared:
        fix = ("make level_key() describe the level's full content (the split is a hash of it)" if _is_level(env)
               else "a held-out task must not also be a train task")
        _fail(f"{_name(env)}: {len(shared)} task(s) appear in both train and heldout, e.g. {sorted(shared)[0]!r}; {fix}")
    distinct = len(keys["heldout"])
    if distinct < min(min_heldout, sample):
        where = f"{distinct} distinct task(s) in {len(tasks['heldout'])} drawn" if source.size("heldout") is None else f"{distinct} task(s)"
        _fail(
            f"{_name(env)}: the held-out split has only {where}; held-out success would move in steps of "
            f"{100 / max(distinct, 1):.0f} points: give it at least {min_heldout} distinct tasks (or lower min_heldout)"
        )
    if _is_level(env):
        for seed in (0, 1):
            a, b = env.level_key(env.generate_level(seed)), env.level_key(env.generate_level(seed))
            if a != b:
                _fail(f"{_name(env)}.generate_level({seed}) gave different levels; draw all randomness from level_seed")
    return tasks


def _check_reset(env: Env, task: Task, seed: int, actions: _Actions, max_steps: int) -> None:
    first = _reset(env, task, seed)
    for _ in range(4):
        if _reset(env, task, seed) != first:
            _fail(
                f"{_name(env)}: reset() with the same seed and task gave different observations; make reset() depend "
                "only on the task and seed (draw randomness from a generator seeded by them, not the global one)"
            )
    rng = random.Random(seed)
    played, results = _draw(env, task, seed, actions, rng, rng.randint(2, 6))
    again = _reset(env, task, seed)
    if again != first:
        _fail(
            f"{_name(env)}: reset() gave another first observation after an episode of the same task was played "
            f"({_short(first)} became {_short(again)}): the episode changed state that reset() reuses (e.g. the "
            "task's level object); copy it in reset() (a LevelEnv's initial_state must return a fresh state)"
        )
    replayed = _replay(env, played)
    if replayed != results:
        _fail(
            f"{_name(env)}: the same actions from the same reset gave different results ({_first_difference(results, replayed)}); "
            "make step() depend only on the state and the env's own seeded randomness"
        )


def _check_invalid_action(env: Env, task: Task, seed: int, actions: _Actions, garbage: str, max_steps: int) -> None:
    """Runs of ``INVALID_RUNS`` invalid actions in a row (the first at the episode's start, the
    others at a random point of it) are each flagged invalid, and the episode then goes on
    exactly as the same actions without them."""
    caps = capabilities(env)
    rng = random.Random(seed + 7)
    played, clean = _draw(env, task, seed, actions, rng, 5)
    for n, run in enumerate(INVALID_RUNS):
        at = 0 if n == 0 or not played else rng.randrange(len(played))
        _reset(env, task, seed)
        _replay(env, played[:at])
        key = env.anchor_key() if caps.anchor_key else None
        where = "at the start" if at == 0 else f"after {at} action(s)"
        for k in range(1, run + 1):
            result = _step(env, garbage)
            nth = f"invalid action {k} of {run} in a row {where}"
            if not result.invalid_action:
                _fail(f"{_name(env)}: step({garbage!r}) ({nth}) was not flagged invalid; return invalid_action=True "
                      "for text the env cannot use (a LevelEnv raises InvalidAction in parse_action)")
            if _is_level(env) and result.reward != env.invalid_action_penalty:
                _fail(f"{_name(env)}: an invalid action gave reward {result.reward}, not invalid_action_penalty")
            if key is not None and env.anchor_key() != key:
                _fail(f"{_name(env)}: an invalid action changed the state (its anchor key; {nth}); leave the state as "
                      "it was (a LevelEnv raises InvalidAction before mutating self.state)")
            if result.terminated:
                _fail(f"{_name(env)}: {nth} ended the episode (terminated); an invalid action must leave all state, "
                      "hidden state too (e.g. a count of errors), as it was: don't end or penalise the game for "
                      "repeated invalid actions (the rollout caps turns with rollout.max_turns)")
            if result.truncated:
                return  # the step budget ran out: nothing left to compare
        after = _replay(env, played[at:])
        if not _same_but_budget(clean[at:], after):
            _fail(
                f"{_name(env)}: {run} invalid action(s) in a row {where} changed the episode: the same actions after "
                f"them gave other results ({_first_difference(clean[at:], after)}); an invalid action must leave all "
                "state, hidden state too, as it was"
            )


def _same_but_budget(clean: Sequence[StepResult], after: Sequence[StepResult]) -> bool:
    """``after`` plays as ``clean``, except that it may be cut short by the env's step budget:
    invalid actions may spend steps of an env's own ``max_steps`` (a ``LevelEnv``'s do), the
    one piece of state they may change."""
    if list(after) == list(clean):
        return True
    if not after or not after[-1].truncated or len(after) > len(clean):
        return False
    last = len(after) - 1
    return list(after[:last]) == list(clean[:last]) and replace(after[last], truncated=False) == replace(clean[last], truncated=False)


def _check_tasks_differ(env: Env, tasks: Mapping[str, list[Task]], actions: _Actions, sample: int) -> list[str]:
    """Different tasks play differently: the first observation and the results of the same
    actions (drawn with one fixed generator, seed 0) from ``sample`` tasks of each split.
    Fails when all play alike (a warning if the env declares ``tasks_may_be_alike``); held-out tasks that play like a train task are warnings (a small
    game has few distinct boards, and four steps may not show what differs)."""
    plays: dict[tuple, Task] = {}
    leaks: list[tuple[Task, Task]] = []
    for split in ("train", "heldout"):
        for task in tasks[split][:sample]:
            first = _reset(env, task, 0)
            _, results = _draw(env, task, 0, actions, random.Random(0), FINGERPRINT_STEPS)
            fingerprint = (first, repr(results))  # info dicts are not hashable
            same = plays.setdefault(fingerprint, task)
            if same.split != task.split:
                leaks.append((task, same))
    drawn = sum(min(sample, len(tasks[s])) for s in ("train", "heldout"))
    if len(plays) == 1 and drawn > 1:
        alike = (f"{_name(env)}: all {drawn} tasks drawn play alike (the same first observation "
                 f"{_short(next(iter(plays))[0])} and the same results for the same actions)")
        if getattr(env, "tasks_may_be_alike", False):
            return [f"{alike}: the env declares tasks_may_be_alike, so train and held-out tasks are one game and "
                    "held-out success measures nothing new"]
        _fail(f"{alike}: the tasks differ only in a seed the env does not use; {_content_hint(env)}")
    if not leaks:
        return []
    task, same = leaks[0]
    return [f"{_name(env)}: {len(leaks)} of {min(sample, len(tasks['heldout']))} held-out tasks drawn play exactly like a "
            f"train task in their first {FINGERPRINT_STEPS} steps (e.g. {_task_name(task)} and {_task_name(same)}); if "
            f"they are the same task, held-out success measures memory of train tasks: {_content_hint(env)}"]


def _task_name(task: Task) -> str:
    return f"{task.split}/{task.index}"


def _content_hint(env: Env) -> str:
    if _is_level(env):
        return ("make generate_level(level_seed) build the level's content from level_seed, and level_key() describe "
                "that content (the split is a hash of it; see docs/guide.md, 'Tasks from a seeded library')")
    return ("give each task its content in task.data (the split is a hash of it), or, for a library that generates "
            "from a seed, a LevelEnv whose level_key() describes the generated content (see docs/guide.md, 'Tasks "
            "from a seeded library')")


def _check_snapshot(env: Env, task: Task, seed: int, actions: _Actions, make_another: Callable[[], Env] | None) -> None:
    rng = random.Random(seed + 13)
    _, results = _draw(env, task, seed, actions, rng, rng.randrange(3))  # snapshot mid-episode, not only at the start
    if results and (results[-1].terminated or results[-1].truncated):
        return
    snap = env.snapshot()
    if not isinstance(snap, EnvSnapshot):
        _fail(f"{_name(env)}.snapshot() returned {type(snap).__name__}; return a turnforge.envs.EnvSnapshot")
    try:
        pickle.loads(pickle.dumps(snap))
    except Exception as err:
        _fail(f"{_name(env)}: its snapshot does not pickle ({type(err).__name__}: {err}); env workers ship snapshots "
              "between processes: keep only plain data in the payload")
    key = env.anchor_key() if capabilities(env).anchor_key else None
    played = []
    for _ in range(8):
        played.append(actions.pick(rng))
        r = _step(env, played[-1])
        if r.terminated or r.truncated:
            break
    _restore(env, snap)
    original = _replay(env, played)  # the snapshot's future, as the env plays it after restore
    if key is not None:
        _restore(env, snap)
        if env.anchor_key() != key:
            _fail(f"{_name(env)}: restore() did not bring back the snapshot's state (anchor_key differs); {_keep_state_hint(env)}")
    replays = [(env, "replaying the same actions after restore() again", "restore() must not share state with the "
                "snapshot (copy it)"), (env, "replaying them a third time", "restore() must not share state with the "
                "snapshot (copy it)")]
    other = make_another() if make_another is not None else None
    if other is not None and capabilities(other).snapshot:
        _reset(other, task, seed + 1)
        replays.append((other, "restoring the snapshot into another env of the same id", "the snapshot must hold "
                        "the whole episode state (env workers restore it in other processes)"))
    for target, what, fix in replays:
        _restore(target, snap)
        again = _replay(target, played)
        if again != original:
            _fail(f"{_name(env)}: {what} gave different results ({_first_difference(original, again)}); {fix}, "
                  f"and {_keep_state_hint(env)}")


def _restore(env: Env, snap: EnvSnapshot) -> None:
    try:
        env.restore(snap)
    except Exception as err:
        _fail(f"{_name(env)}.restore() raised {type(err).__name__}: {err}; it must accept any snapshot of its env id")


def _copier(env: Env, report: CheckReport) -> Callable[[], Env] | None:
    """A second env like ``env`` for the independence checks, sharing the level cache as
    ``make_batch``'s envs do: made again with the same options when ``env`` came from the
    registry, else a deep copy made before any episode."""
    from turnforge.envs.registry import make, share_levels

    try:
        made_with = env.made_with
        if made_with is not None:
            other = make(env.env_id, **made_with)
            other.tasks = env.tasks
        else:
            other = copy.deepcopy(env)
    except Exception as err:
        report.warnings.append(
            f"{_name(env)}: could not copy the env ({type(err).__name__}) for the batch-independence check; check it "
            "by id (check_env('ENV_ID')) or pass make_another"
        )
        return None
    share_levels([env, other])
    return lambda: other


def _check_batch(a: Env, b: Env, task: Task, actions: _Actions, max_steps: int) -> None:
    """Two envs of one batch play the same task at once, step by step; each must play as alone."""
    rng = random.Random(99)
    played, alone = _draw(a, task, 0, actions, rng, 8)
    _reset(a, task, 0)
    _reset(b, task, 0)
    together_a, together_b = [], []
    for action in played[: len(alone)]:
        together_a.append(_step(a, action))
        together_b.append(_step(b, action))
    for name, got in (("first", together_a), ("second", together_b)):
        if got != alone:
            _fail(
                f"{_name(a)}: two envs of one batch playing the same task at once changed each other (the {name} "
                f"env's {_first_difference(alone, got)}); envs must not share mutable state: copy the task's data "
                "(e.g. the level object) in reset() instead of keeping a reference to a shared one"
            )


def _check_expert(env: Env, tasks: list[Task], max_steps: int, deterministic: bool | None) -> None:
    """The expert's actions are valid, and on a deterministic env it wins every task."""
    for seed, task in enumerate(tasks):
        played, results = _play_expert(env, task, seed, max_steps)
        for action, r in zip(played, results):
            if r.invalid_action:
                _fail(f"{_name(env)}.expert_action() returned {action!r}, which the env rejects as invalid: "
                      f"{_short(r.observation)}")
        is_det = deterministic
        if is_det is None:
            _reset(env, task, seed + 1000)
            is_det = _replay(env, played) == results
            if _is_level(env):
                _reset(env, task, seed)
                state = env.rng.getstate()
                _replay(env, played)
                is_det = is_det and env.rng.getstate() == state
        if is_det and not (results and results[-1].success):
            _fail(
                f"{_name(env)}: the expert did not win {task.task_id} within {max_steps} steps on a deterministic "
                "env; fix expert_action (or generate only solvable tasks)"
            )


def _play_expert(env: Env, task: Task, seed: int, max_steps: int) -> tuple[list[str], list[StepResult]]:
    _reset(env, task, seed)
    played, results = [], []
    while len(played) < max_steps and not (results and (results[-1].terminated or results[-1].truncated)):
        action = _expert(env)
        if _is_level(env):
            try:
                env.parse_action(action)
            except InvalidAction as err:
                _fail(f"{_name(env)}.expert_action() returned {action!r}, which parse_action rejects: {err}")
        played.append(action)
        results.append(_step(env, action))
    return played, results


def check_action_lengths(env: Env, tokenizer: Any, max_new_tokens: int, tasks: Sequence[Task] | None = None,
                         max_steps: int = 200, fix: str = SET_MAX_NEW_TOKENS) -> list[str]:
    """Warnings (empty when all is well) for actions that need more than ``max_new_tokens``
    tokens of ``tokenizer`` (a ``ChatFormat`` or HF tokenizer), counting the stop token: the
    env's action names, the expert's actions on ``tasks`` (default: one train and one held-out
    task), or random actions when there is neither. ``fix``: how the user raises the budget
    (``{n}``: the tokens needed), the config key by default."""
    tasks = list(tasks) if tasks is not None else [env.task("train", 0), env.task("heldout", 0)]
    _reset(env, tasks[0], 0)
    actions = _Actions(env)
    encode = tokenizer.encode if hasattr(tokenizer, "close_after") else (
        lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    texts: dict[str, str] = {name: "action" for name in actions.names}
    if capabilities(env).expert:
        for seed, task in enumerate(tasks):
            for action in _play_expert(env, task, seed, max_steps)[0]:
                texts.setdefault(action, "expert action")
    if not texts and capabilities(env).random_action:
        rng = random.Random(0)
        for seed, task in enumerate(tasks):
            for action in _draw(env, task, seed, actions, rng, 5)[0]:
                texts.setdefault(action, "action")
    if not texts:
        return []
    need = {text: len(encode(text)) + 1 for text in texts}  # + the stop token the model must emit
    longest = max(need, key=need.get)
    cut = [t for t in need if need[t] > max_new_tokens]
    if not cut:
        return []
    return [
        f"{_name(env)}: {len(cut)} of {len(need)} actions do not fit rollout.max_new_tokens={max_new_tokens}; the "
        f"longest, {texts[longest]} {_short(longest)}, needs {need[longest]} tokens with the stop token: "
        f"{fix.format(n=need[longest])}, or every such action is cut and played as invalid"
    ]


__all__ = ["CheckReport", "EnvCheckError", "EnvCodeError", "GARBAGE_ACTION", "check_action_lengths", "check_env"]
