"""``check_env``: run an env through the contract and name the fix for each violation.

Works on any ``Env`` subclass, built-in or third-party. Random play uses the actions
named in ``valid_actions_text`` (split on commas, '/', '|' and 'or') that ``parse_action``
accepts, mixed with ``expert_action`` when the env has one.
"""

from __future__ import annotations

import random
import re
from typing import Mapping, NoReturn

from turnforge.envs.base import Env, EnvSnapshot, InvalidAction
from turnforge.types import StepResult, Task

#: An action text no env should accept.
GARBAGE_ACTION = "<<turnforge check_env: this is not an action>>"


class EnvCheckError(AssertionError):
    """The env breaks the contract; the message says what to change."""


def check_env(
    env: Env,
    *,
    episodes: int = 3,
    max_steps: int = 200,
    split_sample: int = 50,
    deterministic: bool | None = None,
    invalid_action: str | None = GARBAGE_ACTION,
) -> None:
    """Raise ``EnvCheckError`` at the first contract violation of ``env``.

    Plays ``episodes`` train and held-out tasks for at most ``max_steps`` steps each,
    and samples ``split_sample`` levels per split for the disjointness check. The expert
    must win every sampled task when the env is deterministic; ``deterministic=None``
    decides that from the env's use of ``self.rng``. ``invalid_action`` is a text the env
    must reject (None skips that check, for envs that accept any text).
    """
    if not isinstance(env, Env):
        _fail(f"{type(env).__name__} is not a turnforge Env; subclass turnforge.envs.Env")
    _check_text_hooks(env)
    _check_splits(env, split_sample)
    tasks = [env.task(split, i) for split in ("train", "heldout") for i in range(episodes)]
    env.reset(seed=0, task=tasks[0])  # parse_action may look at the state
    candidates = _candidate_actions(env)
    for seed, task in enumerate(tasks):
        _check_reset(env, seed, task)
        if invalid_action is not None:
            _check_invalid_action(env, seed, task, invalid_action)
        _check_snapshot(env, seed, task, candidates)
    _check_expert(env, tasks, max_steps, deterministic)
    _check_step_after_end(env, tasks[0], candidates, max_steps)


def _fail(message: str) -> NoReturn:
    raise EnvCheckError(message)


def _name(env: Env) -> str:
    return f"{type(env).__name__} ({env.env_id!r})"


# ---------------------------------------------------------------------- pieces
def _check_text_hooks(env: Env) -> None:
    for hook in ("instructions", "valid_actions_text"):
        value = getattr(env, hook)
        if not isinstance(value, str) or not value.strip():
            _fail(f"{_name(env)}.{hook} is {value!r}; return a non-empty str")


def _candidate_actions(env: Env) -> list[str]:
    """Action texts from ``valid_actions_text`` that ``parse_action`` accepts."""
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
    return found


def _check_splits(env: Env, sample: int) -> None:
    keys: dict[str, set[str]] = {}
    for split in ("train", "heldout"):
        keys[split] = set()
        for i in range(sample):
            key = env.level_key(env.level_for(env.task(split, i)))
            if not isinstance(key, str):
                _fail(f"{_name(env)}.level_key() returned {type(key).__name__}; return a str describing the level")
            keys[split].add(key)
    shared = keys["train"] & keys["heldout"]
    if shared:
        _fail(
            f"{_name(env)}: {len(shared)} level(s) appear in both train and heldout, e.g. {sorted(shared)[0]!r}; "
            "make level_key() describe the level's full content (the split is a hash of it)"
        )
    for seed in (0, 1):
        a, b = env.level_key(env.generate_level(seed)), env.level_key(env.generate_level(seed))
        if a != b:
            _fail(f"{_name(env)}.generate_level({seed}) gave different levels; draw all randomness from level_seed")


def _check_reset(env: Env, seed: int, task: Task) -> None:
    first = env.reset(seed=seed, task=task)
    if not isinstance(first, str):
        _fail(f"{_name(env)}.reset() returned {type(first).__name__}; return the observation str")
    key = env.anchor_key()
    if not isinstance(key, str):
        _fail(f"{_name(env)}.anchor_key() returned {type(key).__name__}; return a str")
    if env.render() != env.render():
        _fail(f"{_name(env)}.render() gave different text for the same state; make it depend only on self.state")
    again = env.reset(seed=seed, task=task)
    if again != first or env.anchor_key() != key:
        _fail(
            f"{_name(env)}: reset() with the same seed and task gave different observations; make "
            "generate_level/initial_state depend only on their arguments and self.rng"
        )


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
    return result


def _step(env: Env, action: str) -> StepResult:
    try:
        result = env.step(action)
    except InvalidAction:
        _fail(f"{_name(env)}.step({action!r}) let InvalidAction escape; raise it only from parse_action/apply")
    except Exception as err:
        _fail(
            f"{_name(env)}.step({action!r}) raised {type(err).__name__}; raise InvalidAction in "
            f"parse_action/apply so Env.step can turn it into an observation (the error: {err})"
        )
    return _check_result(env, result, action)


def _check_invalid_action(env: Env, seed: int, task: Task, action: str) -> None:
    env.reset(seed=seed, task=task)
    key = env.anchor_key()
    result = _step(env, action)
    if not result.invalid_action:
        _fail(f"{_name(env)}: step({action!r}) was not flagged invalid; raise InvalidAction in parse_action")
    if result.reward != env.invalid_action_penalty:
        _fail(f"{_name(env)}: an invalid action gave reward {result.reward}, not invalid_action_penalty")
    if env.anchor_key() != key:
        _fail(f"{_name(env)}: an invalid action changed the state; raise InvalidAction before mutating self.state")


def _pick(env: Env, candidates: list[str], rng: random.Random) -> str:
    """A random candidate action, or the expert's action half of the time."""
    if rng.random() < 0.5 or not candidates:
        try:
            return env.expert_action()
        except NotImplementedError:
            pass
    return rng.choice(candidates) if candidates else GARBAGE_ACTION


def _play_out(env: Env, seed: int, task: Task, candidates: list[str], max_steps: int) -> None:
    """Play until the episode ends (invalid actions still count towards ``env.max_steps``)."""
    env.reset(seed=seed, task=task)
    rng, steps = random.Random(seed), 0
    while not env.done and steps < max(max_steps, env.max_steps):
        _step(env, _pick(env, candidates, rng))
        steps += 1


def _replay(env: Env, actions: list[str]) -> list[StepResult]:
    results = []
    for action in actions:
        if env.done:
            break
        results.append(_step(env, action))
    return results


def _check_snapshot(env: Env, seed: int, task: Task, candidates: list[str]) -> None:
    env.reset(seed=seed, task=task)
    rng = random.Random(seed)
    for _ in range(rng.randrange(3)):  # snapshot mid-episode, not only at the start
        if not env.done:
            _step(env, _pick(env, candidates, rng))
    if env.done:
        return
    snap, key = env.snapshot(), env.anchor_key()
    if not isinstance(snap, EnvSnapshot):
        _fail(f"{_name(env)}.snapshot() returned {type(snap).__name__}; return an EnvSnapshot")
    actions = []
    for _ in range(8):
        if env.done:
            break
        actions.append(_pick(env, candidates, rng))
        _step(env, actions[-1])
    env.restore(snap)
    if env.anchor_key() != key:
        _fail(
            f"{_name(env)}: restore() did not bring back the snapshot's state (anchor_key differs); keep all "
            "mutable episode state in self.state (deep-copyable), not in other attributes"
        )
    first = _replay(env, actions)
    env.restore(snap)
    second = _replay(env, actions)
    if first != second:
        _fail(
            f"{_name(env)}: replaying the same actions after restore() gave different results; keep all "
            "episode state in self.state and draw all dynamics randomness from self.rng"
        )


def _check_expert(env: Env, tasks: list[Task], max_steps: int, deterministic: bool | None) -> None:
    """The expert's actions parse, and on a deterministic env it wins every task.

    With ``deterministic=None`` the env counts as stochastic if a step consumed
    ``self.rng`` or the same actions play out differently under another seed.
    """
    for seed, task in enumerate(tasks):
        env.reset(seed=seed, task=task)
        actions, results, used_rng = [], [], False
        while not env.done and len(actions) < max_steps:
            try:
                action = env.expert_action()
            except NotImplementedError:
                return
            if not isinstance(action, str):
                _fail(f"{_name(env)}.expert_action() returned {type(action).__name__}; return the action text")
            try:
                env.parse_action(action)
            except InvalidAction as err:
                _fail(f"{_name(env)}.expert_action() returned {action!r}, which parse_action rejects: {err}")
            rng_before = env.rng.getstate()
            actions.append(action)
            results.append(_step(env, action))
            used_rng = used_rng or env.rng.getstate() != rng_before
        is_det = deterministic
        if is_det is None:
            env.reset(seed=seed + 1000, task=task)
            is_det = not used_rng and _replay(env, actions) == results
        if is_det and not (results and results[-1].success):
            _fail(
                f"{_name(env)}: the expert did not win {task.task_id} within {max_steps} steps on a "
                "deterministic env; fix expert_action (or generate only solvable levels)"
            )


def _check_step_after_end(env: Env, task: Task, candidates: list[str], max_steps: int) -> None:
    if not env.done:
        _play_out(env, 0, task, candidates, max_steps)
    if not env.done:
        return
    try:
        env.step(candidates[0] if candidates else GARBAGE_ACTION)
    except RuntimeError:
        return
    except Exception as err:  # any other exception is a contract violation
        _fail(f"{_name(env)}: step() after the episode ended raised {type(err).__name__}; raise RuntimeError")
    _fail(f"{_name(env)}: step() after the episode ended did not raise; raise RuntimeError until reset()")


__all__ = ["EnvCheckError", "GARBAGE_ACTION", "check_env"]
