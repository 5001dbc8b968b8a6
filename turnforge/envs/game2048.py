"""2048: slide the tiles of a ``size`` x ``size`` board; equal tiles that collide merge.

Standard rules (each tile merges at most once per move, merges happen from the side the
tiles move towards; after a move that changes the board a 2 (p=0.9) or 4 (p=0.1) spawns
in a uniformly random empty cell). Departures from the usual game: the episode ends with
success as soon as a ``target_tile`` is made (default 256, not 2048), and a move that
changes nothing is a valid no-op (reward 0, no spawn) rather than being ignored. A level
is the initial board; the env's RNG draws every later spawn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from turnforge.envs.base import parse_choice
from turnforge.envs.levels import LevelEnv, Outcome
from turnforge.errors import UserError
from turnforge.seeding import stable_hash

ACTIONS = ("Up", "Down", "Left", "Right")

Board = tuple[tuple[int, ...], ...]  # [size][size], 0 = empty


@dataclass
class Game2048State:
    """Mutable episode state: the board and the score (sum of merged tile values)."""

    board: Board
    score: int = 0


@lru_cache(maxsize=1 << 16)
def slide_row_left(row: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Slide one row to the left, merging equal neighbours once: returns (row, reward)."""
    tiles = [v for v in row if v]
    out: list[int] = []
    reward, i = 0, 0
    while i < len(tiles):
        if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
            out.append(2 * tiles[i])
            reward += 2 * tiles[i]
            i += 2
        else:
            out.append(tiles[i])
            i += 1
    return tuple(out + [0] * (len(row) - len(out))), reward


def move(board: Board, action: int) -> tuple[Board, int]:
    """Apply action index (into ``ACTIONS``) to a board: returns (new board, merge reward)."""
    name = ACTIONS[action]
    lines = board if name in ("Left", "Right") else tuple(zip(*board))  # columns for Up/Down
    if name in ("Right", "Down"):
        lines = tuple(line[::-1] for line in lines)
    slid = [slide_row_left(line) for line in lines]
    reward = sum(r for _, r in slid)
    out = [line for line, _ in slid]
    if name in ("Right", "Down"):
        out = [line[::-1] for line in out]
    new = tuple(out) if name in ("Left", "Right") else tuple(zip(*out))
    return new, reward


def can_move(board: Board) -> bool:
    """Whether any action changes the board."""
    return any(move(board, a)[0] != board for a in range(4))


def render_board(board: Board) -> str:
    """Rows of cells separated by single spaces; '.' is empty."""
    return "\n".join(" ".join(str(v) if v else "." for v in row) for row in board)


def heuristic(board: Board) -> float:
    """Board value for the expert, on log2 tile values: empty cells, monotone rows and
    columns, pairs ready to merge, and the largest tile sitting in a corner."""
    n = len(board)
    logs = [[v.bit_length() - 1 if v else 0 for v in row] for row in board]
    empty = sum(v == 0 for row in board for v in row)
    mono, merges = 0, 0
    for lines in (logs, list(zip(*logs))):
        for line in lines:
            steps = list(zip(line, line[1:]))
            up, down = sum(max(b - a, 0) for a, b in steps), sum(max(a - b, 0) for a, b in steps)
            mono -= min(up, down)  # penalise lines that go up and down
            merges += sum(1 for a, b in steps if a and a == b)
    top = max(max(row) for row in logs)
    corner = top if top in (logs[0][0], logs[0][n - 1], logs[n - 1][0], logs[n - 1][n - 1]) else 0
    return 2.7 * empty + mono + 0.7 * merges + 3.0 * corner


class Game2048Env(LevelEnv[Board]):
    """2048 with success at ``target_tile``; reward per move = sum of merged tile values."""

    action_names = ACTIONS

    def __init__(
        self,
        *,
        size: int = 4,
        target_tile: int = 256,
        start_tiles: int = 2,
        max_steps: int = 300,
        invalid_action_penalty: float = -0.1,
    ) -> None:
        super().__init__(invalid_action_penalty=invalid_action_penalty, max_steps=max_steps)
        if size < 2:
            raise UserError(f"2048: size must be >= 2, got {size}")
        if target_tile < 8 or target_tile & (target_tile - 1):
            raise UserError(f"2048: target_tile must be a power of two >= 8, got {target_tile}")
        if not 1 <= start_tiles < size * size:
            raise UserError(f"2048: start_tiles must be in [1, {size * size - 1}], got {start_tiles}")
        self.size, self.target_tile, self.start_tiles = int(size), int(target_tile), int(start_tiles)

    @property
    def instructions(self) -> str:
        return (
            f"Slide all tiles of the 2048 board; two equal tiles that collide merge into their sum. "
            f"'.' is empty. Make a {self.target_tile} tile. Answer with one of Up, Down, Left, Right."
        )

    @property
    def valid_actions_text(self) -> str:
        return ", ".join(ACTIONS)

    def generate_level(self, level_seed: int) -> Board:
        """An empty board with ``start_tiles`` spawned tiles, drawn from the level seed."""
        rng = random.Random(stable_hash("2048", level_seed))
        board: Board = tuple((0,) * self.size for _ in range(self.size))
        for _ in range(self.start_tiles):
            board = spawn(board, rng)
        return board

    def level_key(self, level: Board) -> str:
        return render_board(level)

    def initial_state(self, level: Board, rng: random.Random) -> Game2048State:
        return Game2048State(level)

    def render(self) -> str:
        return render_board(self.state.board)

    def parse_action(self, text: str) -> int:
        return parse_choice(text, ACTIONS)

    def apply(self, action: int) -> Outcome:
        s: Game2048State = self.state
        board, reward = move(s.board, action)
        moved = board != s.board
        if moved:
            board = spawn(board, self.rng)
        s.board, s.score = board, s.score + reward
        top = max(max(row) for row in board)
        success = top >= self.target_tile
        terminated = success or (moved and not can_move(board))
        info = {"moved": moved, "score": s.score, "max_tile": top}
        return Outcome(float(reward), terminated=terminated, success=success, info=info)

    def expert_action(self) -> str:
        """Greedy one-ply expectimax: merge reward plus the expected heuristic over spawns."""
        board = self.state.board
        best, best_value = 0, float("-inf")
        for action in range(4):
            after, reward = move(board, action)
            if after == board:
                continue
            empties = [(r, c) for r, row in enumerate(after) for c, v in enumerate(row) if v == 0]
            expected = 0.0
            for r, c in empties:
                for tile, p in ((2, 0.9), (4, 0.1)):
                    expected += p * heuristic(_place(after, r, c, tile))
            value = reward + expected / len(empties)
            if value > best_value:
                best, best_value = action, value
        return ACTIONS[best]


def _place(board: Board, r: int, c: int, tile: int) -> Board:
    row = board[r][:c] + (tile,) + board[r][c + 1 :]
    return board[:r] + (row,) + board[r + 1 :]


def spawn(board: Board, rng: random.Random) -> Board:
    """Put a 2 (p=0.9) or 4 (p=0.1) in a uniformly random empty cell (board must have one)."""
    empties = [(r, c) for r, row in enumerate(board) for c, v in enumerate(row) if v == 0]
    r, c = rng.choice(empties)
    return _place(board, r, c, 2 if rng.random() < 0.9 else 4)


__all__ = [
    "ACTIONS",
    "Game2048Env",
    "Game2048State",
    "can_move",
    "heuristic",
    "move",
    "render_board",
    "slide_row_left",
    "spawn",
]
