"""Lights Out: press cells of a small board until every light is off; tasks are generated.

Pressing a cell toggles it and its four neighbours. Each task is a board scrambled by a few
random presses (so it is solvable), drawn by a ``TaskGenerator`` that keeps train and
held-out boards disjoint by content. Actions are ``[row col]`` (``action_names`` lists all of
them, so random actions and noisy demonstrators work). Optional capabilities: ``expert_action``
(the first press of a shortest solution, found by search over press sets), ``snapshot``/
``restore`` (Monte-Carlo values), ``anchor_key``.

A ``[2 3]`` is five tokens and a stop token for a byte-level tokenizer that splits
punctuation: ``rollout.max_new_tokens`` must be at least 6 (``turnforge check-env lightsout
--model DIR --max-new-tokens 4`` says so).
"""

from __future__ import annotations

import itertools
import random
import re

from turnforge import Env, StepResult, Task, TaskGenerator
from turnforge.envs import EnvSnapshot

_PRESS = re.compile(r"\s*\[\s*(\d+)\s+(\d+)\s*\]\s*")


def _press(board: list[list[int]], r: int, c: int) -> None:
    n = len(board)
    for dr, dc in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)):
        if 0 <= r + dr < n and 0 <= c + dc < n:
            board[r + dr][c + dc] ^= 1


def _scramble(size: int, presses: int, rng: random.Random) -> list[list[int]]:
    board = [[0] * size for _ in range(size)]
    for _ in range(rng.randint(1, presses)):
        _press(board, rng.randrange(size), rng.randrange(size))
    if not any(map(any, board)):
        _press(board, rng.randrange(size), rng.randrange(size))
    return board


class LightsOutEnv(Env):
    def __init__(self, size: int = 3, presses: int = 4, step_penalty: float = -0.05) -> None:
        self.size, self.step_penalty = size, step_penalty
        self.action_names = tuple(f"[{r} {c}]" for r in range(size) for c in range(size))
        self.tasks = TaskGenerator(lambda rng: {"board": _scramble(size, presses, rng)}, heldout_fraction=0.2)
        self.instructions = (
            f"Lights Out on a {size}x{size} board (1 = on). Pressing a cell toggles it and its neighbours above, "
            "below, left and right. Turn every light off. Answer with the cell to press as [row col], counting from 0."
        )

    def reset(self, task: Task, seed: int) -> str:
        self.board = [list(row) for row in task.data["board"]]  # a copy: the task's data is shared by every env
        return self._render()

    def step(self, action: str) -> StepResult:
        m = _PRESS.fullmatch(action)
        if m is None or not all(int(x) < self.size for x in m.groups()):
            return StepResult(f"Invalid action: answer [row col] with 0 <= row, col < {self.size}.\n{self._render()}",
                              -0.1, False, False, invalid_action=True)
        _press(self.board, int(m.group(1)), int(m.group(2)))
        won = not any(map(any, self.board))
        return StepResult(self._render(), 1.0 if won else self.step_penalty, won, False, success=won)

    def _render(self) -> str:
        return "\n".join(" ".join(map(str, row)) for row in self.board)

    # optional capabilities
    def expert_action(self) -> str:
        cells = [(r, c) for r in range(self.size) for c in range(self.size)]
        for k in range(1, len(cells) + 1):  # the smallest press set that clears the board
            for combo in itertools.combinations(cells, k):
                board = [row[:] for row in self.board]
                for r, c in combo:
                    _press(board, r, c)
                if not any(map(any, board)):
                    return f"[{combo[0][0]} {combo[0][1]}]"
        return self.action_names[0]  # unsolvable boards do not occur (tasks are scrambled solved boards)

    def snapshot(self) -> EnvSnapshot:
        return EnvSnapshot(self.env_id, [row[:] for row in self.board])

    def restore(self, snapshot: EnvSnapshot) -> str:
        self.board = [row[:] for row in snapshot.payload]
        return self._render()

    def anchor_key(self) -> str:
        return self._render()
