"""Guess the Number: tasks come from a JSONL dataset with its own train/held-out split.

The env has no task source of its own: a recipe gives one with ``env.tasks=PATH.jsonl``
(one ``{"secret": S, "max": M, "split": "train" | "heldout"}`` per line; ``TASKS_FILE`` is the
one shipped with this package). Besides ``reset``/``step`` it implements two optional
capabilities: ``expert_action`` (binary search, for the BC warm start) and ``random_action``
(for a noisy demonstrator and ``check_env``).
"""

from __future__ import annotations

import random
from pathlib import Path

from turnforge import Env, StepResult, Task

TASKS_FILE = Path(__file__).with_name("guess_number_tasks.jsonl")


class GuessNumberEnv(Env):
    instructions = "Guess the secret whole number. After each guess you hear higher or lower. Answer with the number only."

    def reset(self, task: Task, seed: int) -> str:
        self.secret, self.lo, self.hi = task.data["secret"], 1, task.data["max"]
        return f"Guess a number from 1 to {self.hi}."

    def step(self, action: str) -> StepResult:
        text = action.strip()
        if not text.isdigit() or not 1 <= int(text) <= self.hi:
            return StepResult(f"Answer with a whole number from {self.lo} to {self.hi}.", -0.1, False, False, invalid_action=True)
        guess = int(text)
        if guess == self.secret:
            return StepResult(f"{guess} is right!", 1.0, True, False, success=True)
        if guess < self.secret:
            self.lo = max(self.lo, guess + 1)
        else:
            self.hi = min(self.hi, guess - 1)
        return StepResult(f"{guess} is too {'low' if guess < self.secret else 'high'}.", 0.0, False, False)

    # optional capabilities
    def expert_action(self) -> str:
        return str((self.lo + self.hi) // 2)

    def random_action(self, rng: random.Random) -> str:
        return str(rng.randint(self.lo, self.hi))
