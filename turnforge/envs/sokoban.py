"""Sokoban: push every box onto a target in a small procedurally generated room.

Levels are made like gym-sokoban's (a random walk carves a connected room inside the
outer walls), but boxes, targets and the player are then placed at random on floor
cells and an exact BFS solver keeps only levels it can solve within the configured
solution-length range (gym-sokoban instead plays the level backwards). So every level
is solvable, and ``expert_action`` plays an optimal (fewest moves) solution. Rewards
follow gym-sokoban: a step penalty per move, +/- ``box_on_target_reward`` when a box
lands on / leaves a target, ``solved_reward`` when all boxes are on targets.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from turnforge.envs.base import parse_choice, stable_hash
from turnforge.envs.levels import LevelEnv, Outcome
from turnforge.errors import UserError

ACTIONS = ("Up", "Down", "Left", "Right")
DELTAS = ((-1, 0), (1, 0), (0, -1), (0, 1))

Pos = tuple[int, int]

# gym-sokoban's carving masks: each is a connected 3x3 pattern through its centre.
_MASKS = (
    ((0, 0, 0), (1, 1, 1), (0, 0, 0)),
    ((0, 1, 0), (0, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (1, 1, 0)),
    ((0, 0, 0), (0, 1, 1), (0, 1, 0)),
)


@dataclass(frozen=True)
class SokobanLevel:
    """An immutable room: walls, targets and the initial boxes and player."""

    height: int
    width: int
    walls: frozenset[Pos]
    targets: frozenset[Pos]
    boxes: frozenset[Pos]
    player: Pos

    def __deepcopy__(self, memo: dict) -> SokobanLevel:
        return self  # immutable: snapshots share it

    def blocked(self, pos: Pos) -> bool:
        """Wall or outside the grid."""
        r, c = pos
        return not (0 <= r < self.height and 0 <= c < self.width) or pos in self.walls

    @classmethod
    def from_text(cls, text: str) -> SokobanLevel:
        """Parse a room in the render format (``#_.$*@+``; a space also means floor)."""
        rows = text.strip("\n").split("\n")
        if len({len(row) for row in rows}) != 1:
            raise ValueError("a Sokoban room must be rectangular (all rows of equal length)")
        walls, targets, boxes, players = set(), set(), set(), []
        for r, row in enumerate(rows):
            for c, ch in enumerate(row):
                if ch not in "#_ .$*@+":
                    raise ValueError(f"unknown Sokoban cell {ch!r} at row {r}, column {c}")
                if ch == "#":
                    walls.add((r, c))
                if ch in ".*+":
                    targets.add((r, c))
                if ch in "$*":
                    boxes.add((r, c))
                if ch in "@+":
                    players.append((r, c))
        if len(players) != 1 or not boxes or len(boxes) != len(targets):
            raise ValueError("a Sokoban room needs one player and as many targets as boxes (at least one)")
        return cls(len(rows), len(rows[0]), frozenset(walls), frozenset(targets), frozenset(boxes), players[0])


@dataclass
class SokobanState:
    """Mutable episode state: the level (shared, immutable) plus player and boxes."""

    level: SokobanLevel
    player: Pos
    boxes: frozenset[Pos]


def render_room(level: SokobanLevel, player: Pos, boxes: Iterable[Pos]) -> str:
    """Text of a room: one character per cell, rows joined by newlines."""
    grid = [["_"] * level.width for _ in range(level.height)]
    for r, c in level.walls:
        grid[r][c] = "#"
    for r, c in level.targets:
        grid[r][c] = "."
    for r, c in boxes:
        grid[r][c] = "*" if (r, c) in level.targets else "$"
    grid[player[0]][player[1]] = "+" if player in level.targets else "@"
    return "\n".join("".join(row) for row in grid)


# ---------------------------------------------------------------------- solver
def live_cells(level: SokobanLevel) -> frozenset[Pos]:
    """Floor cells from which a lone box can still be pushed onto some target."""
    live = set(level.targets)
    queue = deque(level.targets)
    while queue:
        r, c = queue.popleft()
        for dr, dc in DELTAS:  # a push in direction -d moved the box here from (r+dr, c+dc)
            prev, player = (r + dr, c + dc), (r + 2 * dr, c + 2 * dc)
            if prev not in live and not level.blocked(prev) and not level.blocked(player):
                live.add(prev)
                queue.append(prev)
    return frozenset(live)


def solve(
    level: SokobanLevel, player: Pos | None = None, boxes: frozenset[Pos] | None = None, budget: int = 200_000
) -> list[int] | None:
    """An optimal (fewest moves) solution as action indices into ``ACTIONS``, by exact BFS
    over (player, boxes). Starts from the level's initial state unless ``player``/``boxes``
    are given. Returns None if unsolvable or if more than ``budget`` states were visited."""
    player = level.player if player is None else player
    boxes = level.boxes if boxes is None else frozenset(boxes)
    live, targets = live_cells(level), level.targets
    start = (player, boxes)
    parent: dict[tuple[Pos, frozenset[Pos]], tuple[tuple[Pos, frozenset[Pos]], int] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        p, bx = state
        if bx <= targets:
            path = []
            while parent[state] is not None:
                state, action = parent[state]  # type: ignore[misc]
                path.append(action)
            return path[::-1]
        for action, (dr, dc) in enumerate(DELTAS):
            nxt = (p[0] + dr, p[1] + dc)
            if level.blocked(nxt):
                continue
            if nxt in bx:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if beyond not in live or beyond in bx:  # live cells are never walls
                    continue
                child = (nxt, (bx - {nxt}) | {beyond})
            else:
                child = (nxt, bx)
            if child not in parent:
                parent[child] = (state, action)
                if len(parent) > budget:
                    return None
                queue.append(child)
    return None


# ---------------------------------------------------------------------- env
class SokobanEnv(LevelEnv[SokobanLevel]):
    """Sokoban on a ``dim`` x ``dim`` grid (outer walls included) with ``num_boxes`` boxes.

    Standard rules: walking into a wall, or pushing a box into a wall or another box, is
    a valid move that changes nothing (it still costs ``step_penalty``). Boxes, targets
    and the player start on distinct cells.

    ``end_on_deadlock``: a push that leaves a box off-target on a dead cell (no push
    sequence can bring it to any target, ``live_cells``) ends the episode at once, unsolved,
    with ``info["deadlock"] = True``. The test is sound (such a room can never be solved)
    but not complete (boxes blocking each other are not detected), so success rates are
    the same as without it; only the hopeless turns after the push are skipped. Those
    turns are still charged: the push's reward adds ``step_penalty`` for every step left
    until ``max_steps``, plus ``deadlock_penalty``. Without the charge an early deadlock
    would return more than a late one or than wandering until the limit, and group
    baselines would reward deadlocking fast. Set ``max_steps`` to the rollout's turn limit.
    """

    action_names = ACTIONS

    #: Most BFS states the generator and the expert visit per solve.
    solver_budget: int = 200_000
    #: Room layouts tried per level seed before giving up.
    max_generation_attempts: int = 2_000

    def __init__(
        self,
        *,
        dim: int = 6,
        num_boxes: int = 1,
        max_steps: int = 100,
        invalid_action_penalty: float = -0.1,
        step_penalty: float = -0.1,
        box_on_target_reward: float = 1.0,
        solved_reward: float = 10.0,
        min_solution_length: int = 1,
        max_solution_length: int | None = None,
        end_on_deadlock: bool = False,
        deadlock_penalty: float = 0.0,
    ) -> None:
        super().__init__(invalid_action_penalty=invalid_action_penalty, max_steps=max_steps)
        if dim < 5:
            raise UserError(f"sokoban: dim must be >= 5 (outer walls included), got {dim}")
        if num_boxes < 1 or 2 * num_boxes + 1 > (dim - 2) ** 2:
            raise UserError(f"sokoban: num_boxes={num_boxes} does not fit a {dim}x{dim} room; use fewer boxes")
        if min_solution_length < 1 or (max_solution_length is not None and max_solution_length < min_solution_length):
            raise UserError("sokoban: need 1 <= min_solution_length <= max_solution_length")
        self.dim, self.num_boxes = int(dim), int(num_boxes)
        self.step_penalty, self.box_on_target_reward = float(step_penalty), float(box_on_target_reward)
        self.solved_reward = float(solved_reward)
        self.min_solution_length, self.max_solution_length = int(min_solution_length), max_solution_length
        self.end_on_deadlock, self.deadlock_penalty = bool(end_on_deadlock), float(deadlock_penalty)
        self._expert_cache: dict[tuple[SokobanLevel, Pos, frozenset[Pos]], int] = {}
        self._live: dict[SokobanLevel, frozenset[Pos]] = {}

    @property
    def instructions(self) -> str:
        return (
            "Push every box onto a target; you can push but not pull. "
            "Symbols: # wall, _ floor, . target, $ box, * box on target, @ you, + you on a target. "
            "Answer with one of Up, Down, Left, Right."
        )

    @property
    def valid_actions_text(self) -> str:
        return ", ".join(ACTIONS)

    # ------------------------------------------------------------ generation
    def generate_level(self, level_seed: int) -> SokobanLevel:
        """A solvable room; layouts the solver rejects are retried with derived seeds."""
        for attempt in range(self.max_generation_attempts):
            level = self._try_level(random.Random(stable_hash("sokoban", level_seed, attempt)))
            if level is not None:
                return level
        raise RuntimeError(
            f"sokoban: no solvable level after {self.max_generation_attempts} attempts (seed {level_seed}); "
            "widen min_solution_length..max_solution_length, use fewer boxes or a larger dim"
        )

    def _try_level(self, rng: random.Random) -> SokobanLevel | None:
        floor = self._carve_room(rng)
        if len(floor) < 2 * self.num_boxes + 1:
            return None
        walls = frozenset((r, c) for r in range(self.dim) for c in range(self.dim)) - floor
        cells = sorted(floor)
        targets = frozenset(rng.sample(cells, self.num_boxes))
        room = SokobanLevel(self.dim, self.dim, walls, targets, frozenset(), (0, 0))
        candidates = sorted(live_cells(room) - targets)  # a box on a dead cell can never be solved
        if len(candidates) < self.num_boxes:
            return None
        boxes = frozenset(rng.sample(candidates, self.num_boxes))
        free = [p for p in cells if p not in targets and p not in boxes]
        if not free:
            return None
        level = SokobanLevel(self.dim, self.dim, walls, targets, boxes, rng.choice(free))
        solution = solve(level, budget=self.solver_budget)
        if solution is None or len(solution) < self.min_solution_length:
            return None
        if self.max_solution_length is not None and len(solution) > self.max_solution_length:
            return None
        return level

    def _carve_room(self, rng: random.Random) -> frozenset[Pos]:
        """gym-sokoban's room topology: a random walk stamping connected 3x3 masks."""
        lo, hi = 1, self.dim - 2
        pos = (rng.randint(lo, hi), rng.randint(lo, hi))
        direction = rng.choice(DELTAS)
        floor: set[Pos] = set()
        for _ in range(int(1.7 * 2 * self.dim)):
            if rng.random() < 0.35:
                direction = rng.choice(DELTAS)
            pos = (min(max(pos[0] + direction[0], lo), hi), min(max(pos[1] + direction[1], lo), hi))
            mask = rng.choice(_MASKS)
            for i in range(3):
                for j in range(3):
                    r, c = pos[0] + i - 1, pos[1] + j - 1
                    if mask[i][j] and lo <= r <= hi and lo <= c <= hi:
                        floor.add((r, c))
        return frozenset(floor)

    def level_key(self, level: SokobanLevel) -> str:
        return render_room(level, level.player, level.boxes)

    def initial_state(self, level: SokobanLevel, rng: random.Random) -> SokobanState:
        return SokobanState(level, level.player, level.boxes)

    # ------------------------------------------------------------ dynamics
    def render(self) -> str:
        return render_room(self.state.level, self.state.player, self.state.boxes)

    def parse_action(self, text: str) -> int:
        return parse_choice(text, ACTIONS)

    def apply(self, action: int) -> Outcome:
        s: SokobanState = self.state
        level = s.level
        dr, dc = DELTAS[action]
        nxt = (s.player[0] + dr, s.player[1] + dc)
        reward, moved, pushed = self.step_penalty, False, False
        if not level.blocked(nxt):
            if nxt not in s.boxes:
                s.player, moved = nxt, True
            else:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if not level.blocked(beyond) and beyond not in s.boxes:
                    s.boxes = (s.boxes - {nxt}) | {beyond}
                    s.player, moved, pushed = nxt, True, True
                    reward += self.box_on_target_reward * ((beyond in level.targets) - (nxt in level.targets))
        on_target = len(s.boxes & level.targets)
        solved = on_target == len(s.boxes)
        if solved:
            reward += self.solved_reward
        info = {"boxes_on_target": on_target, "moved": moved, "pushed": pushed}
        if self.end_on_deadlock and pushed and not solved and (s.boxes - level.targets) - self._live_cells(level):
            info["deadlock"] = True
            skipped = self.step_penalty * max(self.max_steps - self.steps, 0)
            return Outcome(reward + skipped + self.deadlock_penalty, terminated=True, success=False, info=info)
        return Outcome(reward, terminated=solved, success=solved, info=info)

    def _live_cells(self, level: SokobanLevel) -> frozenset[Pos]:
        live = self._live.get(level)
        if live is None:
            if len(self._live) > 10_000:
                self._live.clear()
            live = self._live[level] = live_cells(level)
        return live

    def potential(self) -> float:
        """Shaping potential: minus the summed Manhattan distance of each box to its nearest
        target, where a box on a dead cell (no push sequence can bring it to a target, see
        ``live_cells``) counts ``2 * dim``. Pushing a box closer raises it by 1; a deadlocking
        push drops it by up to ``2 * dim``."""
        s: SokobanState = self.state
        live = self._live_cells(s.level)
        total = 0
        for box in s.boxes:
            if box not in live:
                total += 2 * self.dim
            else:
                total += min(abs(box[0] - t[0]) + abs(box[1] - t[1]) for t in s.level.targets)
        return -float(total)

    def expert_action(self) -> str:
        """First move of an optimal solution from the current state; in a deadlock (or if
        the solver's budget runs out) a move that changes the state, else 'Up'."""
        s: SokobanState = self.state
        key = (s.level, s.player, s.boxes)
        if key not in self._expert_cache:
            if len(self._expert_cache) > 100_000:
                self._expert_cache.clear()
            path = solve(s.level, s.player, s.boxes, budget=self.solver_budget)
            if not path:
                return ACTIONS[self._any_moving_action()]
            player, boxes = s.player, s.boxes  # cache the optimal suffix for every state on the path
            for action in path:
                self._expert_cache[(s.level, player, boxes)] = action
                dr, dc = DELTAS[action]
                player = (player[0] + dr, player[1] + dc)
                if player in boxes:
                    boxes = (boxes - {player}) | {(player[0] + dr, player[1] + dc)}
        return ACTIONS[self._expert_cache[key]]

    def _any_moving_action(self) -> int:
        s: SokobanState = self.state
        for action, (dr, dc) in enumerate(DELTAS):
            nxt = (s.player[0] + dr, s.player[1] + dc)
            beyond = (nxt[0] + dr, nxt[1] + dc)
            if not s.level.blocked(nxt) and (
                nxt not in s.boxes or (not s.level.blocked(beyond) and beyond not in s.boxes)
            ):
                return action
        return 0


__all__ = ["ACTIONS", "SokobanEnv", "SokobanLevel", "SokobanState", "live_cells", "render_room", "solve"]
