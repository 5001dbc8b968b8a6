"""check_env catches each kind of broken env, and its message names the fix."""

from __future__ import annotations

import random

import pytest

from turnforge.envs import Env, EnvCheckError, InvalidAction, Outcome, check_env, parse_choice
from turnforge.types import StepResult


class Corridor(Env):
    """A correct toy env: walk right to the end of a corridor of length 2..6."""

    env_id = "corridor"
    instructions = "Walk to the end of the corridor. Answer with Left or Right."
    valid_actions_text = "Left, Right"

    def __init__(self, *, invalid_action_penalty: float = -0.1, max_steps: int = 20) -> None:
        super().__init__(invalid_action_penalty=invalid_action_penalty, max_steps=max_steps)

    def generate_level(self, level_seed):
        return (random.Random(level_seed).randint(2, 6), level_seed % 997)

    def level_key(self, level):
        return repr(level)

    def initial_state(self, level, rng):
        return {"length": level[0], "pos": 0}

    def render(self):
        return "".join("@" if i == self.state["pos"] else "_" for i in range(self.state["length"] + 1))

    def parse_action(self, text):
        return parse_choice(text, ("Left", "Right"))

    def apply(self, action):
        self.state["pos"] = max(0, self.state["pos"] + (1 if action else -1))
        won = self.state["pos"] == self.state["length"]
        return Outcome(1.0 if won else 0.0, terminated=won, success=won)

    def expert_action(self):
        return "Right"


class SlipperyCorridor(Corridor):
    """Correct and stochastic: a move fails half of the time (drawn from self.rng)."""

    def apply(self, action):
        if self.rng.random() < 0.5:
            return Outcome(0.0)
        return super().apply(action)


def test_correct_envs_pass():
    check_env(Corridor())
    check_env(SlipperyCorridor())


class TupleStep(Corridor):
    def step(self, action_text):
        r = super().step(action_text)
        return (r.observation, r.reward, r.terminated, r.truncated, {})


class IntReward(Corridor):
    def step(self, action_text):
        r = super().step(action_text)
        return StepResult(r.observation, int(r.reward), r.terminated, r.truncated, r.invalid_action, r.success)


class GlobalRandomReset(Corridor):
    def initial_state(self, level, rng):
        return {"length": level[0], "pos": random.randint(0, level[0] - 1)}


class ValueErrorParse(Corridor):
    def parse_action(self, text):
        if text.strip().lower() not in ("left", "right"):
            raise ValueError(f"bad action {text!r}")
        return text.strip().lower() == "right"


class StateOutsideState(Corridor):
    def initial_state(self, level, rng):
        self.pos = 0
        return {"length": level[0]}

    def render(self):
        return "".join("@" if i == self.pos else "_" for i in range(self.state["length"] + 1))

    def apply(self, action):
        self.pos = max(0, self.pos + (1 if action else -1))
        won = self.pos == self.state["length"]
        return Outcome(1.0 if won else 0.0, terminated=won, success=won)


class GlobalRandomDynamics(Corridor):
    def apply(self, action):
        if random.random() < 0.5:
            return Outcome(0.0)
        return super().apply(action)


class InvalidMutates(Corridor):
    def parse_action(self, text):
        self.state["pos"] = 1
        return super().parse_action(text)


class SharedSplits(Corridor):
    def level_for(self, task):
        return self.generate_level(task.index)


class LosingExpert(Corridor):
    def expert_action(self):
        return "Left"


class UnparsableExpert(Corridor):
    def expert_action(self):
        return "Forward"


class EmptyInstructions(Corridor):
    instructions = ""


class StepAfterEndAllowed(Corridor):
    def step(self, action_text):
        if self.done:
            return StepResult(self.render(), 0.0, True, False)
        return super().step(action_text)


class BothEndings(Corridor):
    def step(self, action_text):
        r = super().step(action_text)
        return StepResult(r.observation, r.reward, r.terminated, r.terminated, r.invalid_action, r.success)


@pytest.mark.parametrize(
    "env_cls, message",
    [
        (TupleStep, "returned a tuple; return a turnforge.types.StepResult"),
        (IntReward, "reward is int; return a float"),
        (GlobalRandomReset, "reset() with the same seed and task gave different observations"),
        (ValueErrorParse, "raised ValueError; raise InvalidAction"),
        (StateOutsideState, "keep all mutable episode state in self.state"),
        (GlobalRandomDynamics, "draw all dynamics randomness from self.rng"),
        (InvalidMutates, "an invalid action changed the state"),
        (SharedSplits, "appear in both train and heldout"),
        (LosingExpert, "the expert did not win"),
        (UnparsableExpert, "returned 'Forward', which parse_action rejects"),
        (EmptyInstructions, "instructions is ''; return a non-empty str"),
        (StepAfterEndAllowed, "step() after the episode ended did not raise"),
        (BothEndings, "terminated and truncated are both True"),
    ],
)
def test_broken_env_is_caught(env_cls, message):
    random.seed(0)
    with pytest.raises(EnvCheckError) as err:
        check_env(env_cls())
    assert message in str(err.value)
    assert isinstance(err.value, AssertionError)


def test_not_an_env():
    with pytest.raises(EnvCheckError, match="subclass turnforge.envs.Env"):
        check_env(object())  # type: ignore[arg-type]


def test_free_text_env_can_skip_the_invalid_action_check():
    class AnyText(Corridor):
        def parse_action(self, text):
            return "right" in text.lower()

    with pytest.raises(EnvCheckError, match="was not flagged invalid"):
        check_env(AnyText())
    check_env(AnyText(), invalid_action=None)


def test_stochastic_env_expert_need_not_win():
    class Hopeless(SlipperyCorridor):
        def expert_action(self):
            return "Left"

    check_env(Hopeless())  # stochastic (uses self.rng): no success requirement
    with pytest.raises(EnvCheckError, match="expert did not win"):
        check_env(Hopeless(), deterministic=True)


def test_invalid_action_helper_is_reusable():
    with pytest.raises(InvalidAction, match="could not parse 'north' as an action"):
        parse_choice("north", ("Up", "Down"))
    assert parse_choice("  <answer>\nDOWN </answer> ", ("Up", "Down")) == 1
    assert parse_choice("<answer>up</answer> no, <answer>down</answer>", ("Up", "Down")) == 1
