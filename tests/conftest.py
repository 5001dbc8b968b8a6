"""Shared fixtures: a tiny HF model built once per test session, and a scripted test env."""

from __future__ import annotations

import os
import random

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)

from helpers import TINY_TEST_SHAPE  # noqa: E402
from turnforge.envs.levels import InvalidAction, LevelEnv, Outcome  # noqa: E402
from turnforge.envs.registry import register  # noqa: E402

WORDS = "the box wall floor target up down left right # _ . $ @ 2 4 8 16 hole goal".split()


class EchoEnv(LevelEnv):
    """A test env: observations are seeded random word strings of varying length (1 to
    ``max_obs_words`` words); any action that is not the literal word 'bad' is valid;
    the episode terminates with success after ``episode_len`` valid actions. If
    ``crash_on`` is set, step() raises RuntimeError on that step of tasks whose index is
    divisible by 4 (to test infrastructure failures)."""

    def __init__(self, *, episode_len: int = 3, max_obs_words: int = 40, crash_on: int | None = None,
                 invalid_action_penalty: float = -0.1, max_steps: int = 100) -> None:
        super().__init__(invalid_action_penalty=invalid_action_penalty, max_steps=max_steps)
        self.episode_len, self.max_obs_words, self.crash_on = episode_len, max_obs_words, crash_on

    instructions = "Say anything."
    valid_actions_text = "any text but 'bad'"

    def generate_level(self, level_seed):
        return level_seed

    def level_key(self, level):
        return str(level)

    def initial_state(self, level, rng):
        return {"level": level, "t": 0, "text": self._text(random.Random(level))}

    def _text(self, r):
        return " ".join(r.choice(WORDS) for _ in range(r.randint(1, self.max_obs_words)))

    def render(self):
        return self.state["text"]

    def parse_action(self, text):
        if text.strip() == "bad":
            raise InvalidAction("the word 'bad' is not allowed")
        return text

    def apply(self, action):
        self.state["t"] += 1
        if self.crash_on is not None and self.state["t"] == self.crash_on and self.current_task.index % 4 == 0:
            raise RuntimeError("simulated env crash")
        self.state["text"] = self._text(self.rng)
        done = self.state["t"] >= self.episode_len
        return Outcome(reward=1.0 if done else 0.1, terminated=done, success=done)

    def expert_action(self):
        return "up"


register("test-echo", EchoEnv, overwrite=True)




@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from turnforge.policy.tiny import TinyModelConfig, build_tiny_model

    path = tmp_path_factory.mktemp("tiny_model")
    build_tiny_model(path, TinyModelConfig(**TINY_TEST_SHAPE))
    return path


@pytest.fixture()
def tiny_policy(tiny_model_dir):
    from turnforge.policy.model import load_policy

    return load_policy(tiny_model_dir)

