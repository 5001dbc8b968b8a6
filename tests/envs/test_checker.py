"""check_env catches each kind of broken env, and its message names the fix."""

from __future__ import annotations

import random
import re

import pytest

from turnforge import Env, StepResult, TaskDataset
from turnforge.envs.tasks import TaskGenerator
from turnforge.envs import EnvCheckError, EnvCodeError, InvalidAction, LevelEnv, Outcome, check_env, parse_choice


class Corridor(LevelEnv):
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


class SharedLevelObject(Corridor):
    """Hands out the generated level itself as the mutable state: the next reset of the task,
    and every other env of the batch playing it, start from the moved position."""

    def generate_level(self, level_seed):
        return {"length": random.Random(level_seed).randint(3, 6), "pos": 0, "seed": level_seed % 997}

    def level_key(self, level):
        return f"{level['length']}-{level['seed']}"

    def initial_state(self, level, rng):
        return level


class InvalidChangesHiddenState(Corridor):
    """An invalid move drains a hidden battery that the render (and so the anchor key) never
    shows; the win pays less afterwards."""

    def initial_state(self, level, rng):
        return {"length": level[0], "pos": 0, "battery": 2}

    def parse_action(self, text):
        try:
            return super().parse_action(text)
        except InvalidAction:
            self.state["battery"] -= 1
            raise

    def apply(self, action):
        out = super().apply(action)
        return Outcome(out.reward * self.state["battery"] / 2, out.terminated, out.success) if out.terminated else out


class OneHeldoutLevel(Corridor):
    """Only 12 distinct levels exist; the split hash puts one of them in heldout."""

    def generate_level(self, level_seed):
        return (2 + level_seed % 3, level_seed % 4)


class RestoreMissesAField(Corridor):
    """Steps also count moves in an attribute outside self.state; snapshot/restore forget it and
    the reward depends on it."""

    def initial_state(self, level, rng):
        self.moves = 0
        return {"length": level[0], "pos": 0}

    def apply(self, action):
        self.moves += 1
        out = super().apply(action)
        return Outcome(out.reward / self.moves, out.terminated, out.success)


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
        (ValueErrorParse, "raised ValueError: bad action"),
        (StateOutsideState, "keep all mutable episode state in self.state"),
        (GlobalRandomDynamics, "make step() depend only on the state"),
        (InvalidMutates, "an invalid action changed the state"),
        (SharedSplits, "appear in both train and heldout"),
        (LosingExpert, "the expert did not win"),
        (UnparsableExpert, "returned 'Forward', which parse_action rejects"),
        (EmptyInstructions, "instructions is ''; return a non-empty str"),
        (BothEndings, "terminated and truncated are both True"),
        # the patterns a first-time plugin author hit, each with the fix in the message
        (SharedLevelObject, "copy it in reset()"),
        (InvalidChangesHiddenState, "an invalid action must leave all state, hidden state too, as it was"),
        (OneHeldoutLevel, "the held-out split has only 1 distinct task(s) in 50 drawn"),
        (RestoreMissesAField, "keep all mutable episode state in self.state"),
    ],
)
def test_broken_env_is_caught(env_cls, message):
    random.seed(0)
    with pytest.raises(EnvCheckError) as err:
        check_env(env_cls())
    assert message in str(err.value)
    assert isinstance(err.value, AssertionError)


def test_not_an_env():
    with pytest.raises(EnvCheckError, match="subclass turnforge.Env"):
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


# ---------------------------------------------------------------------- light envs
ROWS = [{"target": t, "split": "heldout" if t % 5 == 0 else "train"} for t in range(60)]


class Counter(Env):
    """A light env (reset/step only): count up to task.data['target'] % 4 + 1 with 'inc' (the
    task's number is shown, so no two tasks play alike)."""

    instructions = "Say inc until you reach the target."
    action_names = ("inc", "dec")
    tasks = TaskDataset(ROWS)

    def reset(self, task, seed):
        self.goal, self.count = task.data["target"] % 4 + 1, 0
        return f"task {task.data['target']}: count 0 of {self.goal}"

    def step(self, action):
        if action.strip() not in self.action_names:
            return StepResult(f"say inc or dec (count {self.count})", -0.1, False, False, invalid_action=True)
        self.count += 1 if action.strip() == "inc" else -1
        won = self.count == self.goal
        return StepResult(f"count {self.count} of {self.goal}", 1.0 if won else 0.0, won, False, success=won)


def _unsolvable(goal):
    raise NotImplementedError(f"no solver for goal {goal}")


class SolverRaises(Counter):
    """Its expert calls a helper that raises: the user's code, not the checker's."""

    def expert_action(self):
        return _unsolvable(self.goal)


class ResetRaises(Counter):
    def reset(self, task, seed):
        return {}["missing " + "\n key"]


@pytest.mark.parametrize("env, expected", [
    (SolverRaises(), "SolverRaises ('unregistered').expert_action() raised NotImplementedError: no solver for goal"),
    (ResetRaises(), "ResetRaises ('unregistered').reset() raised KeyError: 'missing \\n key'"),
], ids=["expert", "reset"])
def test_an_exception_in_env_code_names_the_env_method(env, expected):
    """It surfaced as turnforge's internal error; it is the env's: the method the checker called
    (not the helper that raised), the exception on one line, the original as its cause."""
    with pytest.raises(EnvCodeError) as err:
        check_env(env)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)
    assert isinstance(err.value, EnvCheckError) and err.value.__cause__ is not None


class MutatesTaskData(Counter):
    """Keeps a reference to the dataset row and counts in it: every env and every later reset
    of the task sees the count."""

    def reset(self, task, seed):
        self.row = task.data
        self.row["count"] = 0
        self.goal = self.row["target"] % 4 + 1
        return f"count 0 of {self.goal}"

    def step(self, action):
        if action.strip() not in self.action_names:
            return StepResult("say inc or dec", -0.1, False, False, invalid_action=True)
        self.row["count"] = self.row.get("count", 0) + (1 if action.strip() == "inc" else -1)
        won = self.row["count"] == self.goal
        return StepResult(f"count {self.row['count']} of {self.goal}", 1.0 if won else 0.0, won, False, success=won)


def test_a_light_env_passes():
    report = check_env(Counter())
    assert {"tasks", "reset determinism", "invalid actions", "batch independence"} <= set(report.checks)
    assert report.warnings == []


def test_light_env_sharing_the_task_row_between_envs_is_caught():
    with pytest.raises(EnvCheckError, match="changed each other.*copy the task's data"):
        check_env(MutatesTaskData(), make_another=MutatesTaskData)


def test_tiny_or_empty_heldout_dataset_is_caught():
    class FewHeldout(Counter):
        tasks = TaskDataset([{"target": t, "split": "heldout" if t == 0 else "train"} for t in range(40)])

    with pytest.raises(EnvCheckError, match=r"held-out split has only 1 task\(s\).*at least 10"):
        check_env(FewHeldout())
    check_env(FewHeldout(), min_heldout=1)

    class NoHeldout(Counter):
        tasks = TaskDataset([{"target": t, "split": "train"} for t in range(40)])

    with pytest.raises(EnvCheckError, match="has no heldout tasks"):
        check_env(NoHeldout())


def test_env_without_tasks_names_the_fix():
    class NoTasks(Counter):
        tasks = None

    with pytest.raises(EnvCheckError, match="set env.tasks=PATH.jsonl"):
        check_env(NoTasks())


def test_actions_longer_than_max_new_tokens_fail_with_the_number_needed(tiny_policy):
    """Every such action would be cut and played as invalid: a failure (it was a warning under an
    "ok"), naming the budget that fits; that budget passes."""
    class Coordinates(Counter):
        action_names = ("[2 3]", "[0 1]")

        def step(self, action):
            return super().step("inc" if action.strip() in self.action_names else action)

    need = len(tiny_policy.chat.encode("[2 3]")) + 1
    with pytest.raises(EnvCheckError) as err:
        check_env(Coordinates(), tokenizer=tiny_policy.chat, max_new_tokens=need - 1)
    hinted = int(re.search(r"set rollout.max_new_tokens=(\d+) or more", str(err.value)).group(1))
    assert hinted == need and f"needs {need} tokens with the stop token" in str(err.value)
    report = check_env(Coordinates(), tokenizer=tiny_policy.chat, max_new_tokens=hinted)
    assert "action lengths" in report.checks and report.warnings == []


# ---------------------------------------------------------------------- holes an outside env found
class GuessWithStrikes(Env):
    """Guess the secret number. The wrapped game counts invalid answers where the observation
    does not show it, and the second invalid answer in a row ends the game as a loss: one
    invalid action looks harmless, two do not."""

    instructions = "Guess the secret number from 1 to 1000."
    tasks = TaskGenerator(lambda rng: {"secret": rng.randint(1, 1000)})

    def reset(self, task, seed):
        self.secret, self.strikes = task.data["secret"], 0
        return "Guess a number from 1 to 1000."

    def random_action(self, rng):
        return str(rng.randint(1, 1000))

    def step(self, action):
        if not action.strip().isdigit():
            self.strikes += 1
            if self.strikes >= 2:
                return StepResult("Two invalid answers: you lose.", -1.0, True, False, invalid_action=True)
            return StepResult("Answer with a number.", -0.1, False, False, invalid_action=True)
        self.strikes = 0
        guess = int(action)
        if guess == self.secret:
            return StepResult("Correct!", 1.0, True, False, success=True)
        return StepResult("Higher." if guess < self.secret else "Lower.", 0.0, False, False)


def test_two_invalid_actions_in_a_row_that_end_the_game_are_caught():
    with pytest.raises(EnvCheckError, match=r"invalid action 2 of 2 in a row at the start ended the episode"):
        check_env(GuessWithStrikes())


class SeedIgnored(Env):
    """A seeded library that ignores its seed: every task is the same board."""

    instructions = "Turn all the lights off. Answer with a cell number."
    action_names = ("0", "1", "2", "3")
    tasks = TaskGenerator(lambda rng: {"seed": rng.randrange(10**9)})

    def reset(self, task, seed):
        self.board = [1, 0, 1, 1]  # what the library builds for any seed
        return self._show()

    def _show(self):
        return "".join(map(str, self.board))

    def step(self, action):
        if action.strip() not in self.action_names:
            return StepResult("say a cell 0-3", -0.1, False, False, invalid_action=True)
        i = int(action)
        for j in (i - 1, i, i + 1):
            if 0 <= j < 4:
                self.board[j] ^= 1
        won = not any(self.board)
        return StepResult(self._show(), 1.0 if won else 0.0, won, False, success=won)


def test_tasks_that_all_play_alike_are_caught_and_distinct_ones_pass():
    with pytest.raises(EnvCheckError, match=r"all 12 tasks drawn play alike .*differ only in a seed the env does not use"):
        check_env(SeedIgnored())

    class SeedUsed(SeedIgnored):
        def reset(self, task, seed):
            self.board = [(task.data["seed"] >> k) & 1 for k in range(4)] or [1, 0, 0, 0]
            return self._show()

    check_env(SeedUsed(), deterministic=False)

    class OneFixedGame(SeedIgnored):
        tasks_may_be_alike = True  # declared: one game under many seeds (a fixed-map Gymnasium env)

    assert any("declares tasks_may_be_alike" in w for w in check_env(OneFixedGame()).warnings)


class Silent(Env):
    """Open-text actions and no way for the checker to produce one."""

    instructions = "Say something."
    tasks = TaskGenerator(lambda rng: {"n": rng.randrange(1000)})

    def reset(self, task, seed):
        self.n = task.data["n"]
        return f"task {self.n}"

    def step(self, action):
        return StepResult("ok", 1.0, True, False, success=True)


def test_an_env_with_no_actions_to_play_fails_unless_allowed():
    with pytest.raises(EnvCheckError, match=r"found no actions to play, so it could not check determinism.*"
                                            r"allow_no_actions=True"):
        check_env(Silent(), invalid_action=None)
    report = check_env(Silent(), invalid_action=None, allow_no_actions=True)
    assert any("found no actions to play" in w for w in report.warnings)


def test_an_env_written_for_the_old_hooks_is_told_the_new_contract():
    from turnforge.errors import UserError

    class OldStyle(Env):
        def generate_level(self, level_seed):
            return level_seed

        def render(self):
            return "x"

        def apply(self, action):
            return None

    with pytest.raises(UserError, match=r"OldStyle is written for turnforge's old env hooks \(generate_level, render, "
                                        r"apply\) and lacks reset\(\) and step\(\): subclass turnforge.envs.LevelEnv"):
        OldStyle()
