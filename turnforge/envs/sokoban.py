"""Sokoban: push every box onto a target in a small procedurally generated room.

Levels are made like gym-sokoban's (a random walk carves a connected room inside the
outer walls), but boxes, targets and the player are then placed at random on floor
cells and an exact BFS solver keeps only levels it can solve within the configured
solution-length range (gym-sokoban instead plays the level backwards). So every level
is solvable, and ``expert_action`` plays an optimal (fewest moves) solution. Rewards
follow gym-sokoban: a step penalty per move, +/- ``box_on_target_reward`` when a box
lands on / leaves a target, ``solved_reward`` when all boxes are on targets.

Guidance (``guidance=1..3``, see ``SokobanEnv.guidance_levels``) and derived tasks
(``SokobanEnv.derive_tasks``) are optional; with ``guidance=0`` the env is unchanged.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator, Mapping

from turnforge.envs.base import parse_choice
from turnforge.envs.levels import LevelEnv, Outcome, redraw
from turnforge.errors import UserError
from turnforge.seeding import stable_hash
from turnforge.types import Task

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


def play(
    level: SokobanLevel, player: Pos, boxes: frozenset[Pos], path: Iterable[int]
) -> Iterator[tuple[int, bool, Pos, frozenset[Pos]]]:
    """Replay a legal move sequence (a ``solve`` path): per move ``(action, pushed, player,
    boxes)``, the state after it."""
    for action in path:
        dr, dc = DELTAS[action]
        player = (player[0] + dr, player[1] + dc)
        pushed = player in boxes
        if pushed:
            boxes = (boxes - {player}) | {(player[0] + dr, player[1] + dc)}
        yield action, pushed, player, boxes


def push_plan(level: SokobanLevel, player: Pos, boxes: frozenset[Pos], path: Iterable[int]) -> list[int]:
    """The directions (indices into ``ACTIONS``) of the pushes in ``path``, without the walking."""
    return [action for action, pushed, _, _ in play(level, player, boxes, path) if pushed]


def walkable(level: SokobanLevel, start: Pos, boxes: frozenset[Pos]) -> list[Pos]:
    """Cells the player reaches from ``start`` without pushing a box, sorted."""
    seen, queue = {start}, deque([start])
    while queue:
        r, c = queue.popleft()
        for dr, dc in DELTAS:
            nxt = (r + dr, c + dc)
            if nxt not in seen and not level.blocked(nxt) and nxt not in boxes:
                seen.add(nxt)
                queue.append(nxt)
    return sorted(seen)


def _at(pos: Pos) -> str:
    return f"row {pos[0]}, column {pos[1]}"


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

    ``guidance`` (0 = off) gives hints of growing strength, each level including the ones
    below it (``guidance_levels``). The guard of level 1 undoes a push that would leave the
    pushed box off-target on a dead cell (the ``end_on_deadlock`` test), so with guidance
    ``end_on_deadlock`` never fires; like that test it misses deadlocks between boxes.
    Levels 2 and 3 run the solver (1 expert query per hint line that shows its answer) and
    name box pushes only, never the walking moves.
    """

    action_names = ACTIONS
    guidance_levels = (
        "deadlock guard: a push that would strand a box on a dead cell is undone, and a hint says so (1 expert query each)",
        "level 1 + the direction of the next box push of an optimal solution (solver, 1 expert query)",
        "level 2 + the directions of all box pushes of an optimal solution (solver, 1 more expert query)",
    )

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
        guidance: int = 0,
        first_word: bool = False,
    ) -> None:
        super().__init__(invalid_action_penalty=invalid_action_penalty, max_steps=max_steps, guidance=guidance,
                         first_word=first_word)
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
        # (level, player, boxes) -> (an optimal path through that state, the state's offset in it); None: no solution
        self._plans: dict[tuple[SokobanLevel, Pos, frozenset[Pos]], tuple[tuple[int, ...], int] | None] = {}
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
        return redraw(
            lambda attempt: self._try_level(random.Random(stable_hash("sokoban", level_seed, attempt))),
            self.max_generation_attempts,
            f"sokoban: no solvable level after {self.max_generation_attempts} attempts (seed {level_seed}); "
            "widen min_solution_length..max_solution_length, use fewer boxes or a larger dim",
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

    def level_from_data(self, data: Mapping[str, Any]) -> SokobanLevel:
        return SokobanLevel.from_text(data["level"])

    def initial_state(self, level: SokobanLevel, rng: random.Random) -> SokobanState:
        return SokobanState(level, level.player, level.boxes)

    # ------------------------------------------------------------ dynamics
    def render(self) -> str:
        return render_room(self.state.level, self.state.player, self.state.boxes)

    def parse_action(self, text: str) -> int:
        return parse_choice(text, ACTIONS, self.first_word)

    def apply(self, action: int) -> Outcome:
        s: SokobanState = self.state
        level = s.level
        dr, dc = DELTAS[action]
        nxt = (s.player[0] + dr, s.player[1] + dc)
        reward, moved, pushed, guarded = self.step_penalty, False, False, False
        if not level.blocked(nxt):
            if nxt not in s.boxes:
                s.player, moved = nxt, True
            else:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if not level.blocked(beyond) and beyond not in s.boxes:
                    if self.guidance and beyond not in level.targets and beyond not in self._live_cells(level):
                        guarded = True  # the deadlock guard: leave the state as it was
                        self.guard_note = f"pushing the box {ACTIONS[action]} there would make the room unsolvable, so it was undone"
                    else:
                        s.boxes = (s.boxes - {nxt}) | {beyond}
                        s.player, moved, pushed = nxt, True, True
                        reward += self.box_on_target_reward * ((beyond in level.targets) - (nxt in level.targets))
        on_target = len(s.boxes & level.targets)
        solved = on_target == len(s.boxes)
        if solved:
            reward += self.solved_reward
        info: dict[str, bool | int] = {"boxes_on_target": on_target, "moved": moved, "pushed": pushed}
        if self.guidance:
            info["guarded"] = guarded
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
        path = self.optimal_path(s.level, s.player, s.boxes)
        if not path:
            return ACTIONS[self._any_moving_action()]
        return ACTIONS[path[0]]

    def optimal_path(self, level: SokobanLevel, player: Pos, boxes: frozenset[Pos]) -> tuple[int, ...] | None:
        """An optimal solution from ``(player, boxes)`` (``solve``), cached: one solve caches
        its suffix for every state on its path. None: unsolvable or over ``solver_budget``."""
        key = (level, player, boxes)
        if key not in self._plans:
            if len(self._plans) > 100_000:
                self._plans.clear()
            found = solve(level, player, boxes, budget=self.solver_budget)
            if found is None:
                self._plans[key] = None
                return None
            path = tuple(found)
            self._plans[key] = (path, 0)
            for i, (_, _, p, bx) in enumerate(play(level, player, boxes, path), 1):
                self._plans.setdefault((level, p, bx), (path, i))
        plan = self._plans[key]
        return None if plan is None else plan[0][plan[1]:]

    # ------------------------------------------------------------ guidance
    def hints(self, level: int) -> list[str]:
        """Level 2: the direction of the next push of an optimal solution; level 3: also the
        directions of all its pushes. (Level 1's guard note comes from ``apply``.)"""
        s: SokobanState = self.state
        if level < 2 or s.boxes <= s.level.targets:
            return []
        path = self.optimal_path(s.level, s.player, s.boxes)
        self.expert_queries += 1
        if path is None:
            return ["the solver found no solution from here; the room may be unsolvable"]
        pushes = [ACTIONS[a] for a in push_plan(s.level, s.player, s.boxes, path)]
        hints = [f"the next push moves a box {pushes[0]}"]
        if level >= 3:
            self.expert_queries += 1
            hints.append("box pushes to solve: " + ", ".join(pushes))
        return hints

    # ------------------------------------------------------------ derived tasks
    def derive_tasks(self, task: Task, n: int, seed: int) -> list[Task]:
        """Up to ``n`` easier train tasks from ``task``'s room, each checked with the solver to
        be solvable in fewer moves than the parent (and never a held-out level):

        - the player moved next to the box, on the pushing side of an optimal solution's first push;
        - the boxes as after push j of an optimal solution (so nearer their targets), the player
          on a random floor cell from which it can walk to that push's pushing side;
        - with several boxes: one box removed, with the target it ends on in that solution.

        The first kind comes first, then the other two alternate; ``seed`` draws their order
        and the player cells."""
        parent = self.level_for(task)
        path = self.optimal_path(parent, parent.player, parent.boxes)
        if not path:
            return []
        rng = random.Random(stable_hash("derive", task.task_id, seed))

        def easier(level: SokobanLevel) -> bool:
            found = self.optimal_path(level, level.player, level.boxes)
            return found is not None and 0 < len(found) < len(path)

        return self.derived_tasks(task, self._derived_candidates(parent, path, rng), n, easier)

    def _derived_candidates(
        self, parent: SokobanLevel, path: tuple[int, ...], rng: random.Random
    ) -> Iterator[tuple[SokobanLevel, str, int]]:
        states = list(play(parent, parent.player, parent.boxes, path))
        pushes = [i for i, (_, pushed, _, _) in enumerate(states) if pushed]
        # 1. the player next to the box, on the side of the first push
        first = pushes[0]
        beside = states[first - 1][2] if first > 0 else parent.player
        direction = ACTIONS[states[first][0]]
        how = f"player placed next to the box, on the side to push it {direction} (first push of an optimal solution)"
        yield replace(parent, player=beside), how, 0
        # 2. the boxes further along the solution, alternating with 3. fewer boxes
        nearer = list(range(1, len(pushes)))  # after the last push the room is solved
        rng.shuffle(nearer)
        fewer = self._fewer_boxes(parent, states, rng)
        for i in range(max(len(nearer), len(fewer))):
            if i < len(nearer):
                j = nearer[i]
                _, _, behind, boxes = states[pushes[j - 1]]
                player = rng.choice(walkable(parent, behind, boxes))
                how = f"box nearer its target: boxes as after push {j} of {len(pushes)} of an optimal solution, player at {_at(player)}"
                yield replace(parent, boxes=boxes, player=player), how, j
            if i < len(fewer):
                yield fewer[i]

    def _fewer_boxes(
        self, parent: SokobanLevel, states: list[tuple[int, bool, Pos, frozenset[Pos]]], rng: random.Random
    ) -> list[tuple[SokobanLevel, str, int]]:
        """One box removed, with the target it ends on in the solution ``states``."""
        if len(parent.boxes) < 2:
            return []
        where = {box: box for box in parent.boxes}  # start cell -> cell along the solution
        for action, pushed, player, _ in states:
            if pushed:
                start = next(b for b, now in where.items() if now == player)
                dr, dc = DELTAS[action]
                where[start] = (player[0] + dr, player[1] + dc)
        out = []
        for k, box in enumerate(sorted(parent.boxes)):
            level = replace(parent, boxes=parent.boxes - {box}, targets=parent.targets - {where[box]})
            out.append((level, f"fewer boxes: the box at {_at(box)} and its target at {_at(where[box])} removed", k))
        rng.shuffle(out)
        return out

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


__all__ = [
    "ACTIONS", "SokobanEnv", "SokobanLevel", "SokobanState", "live_cells", "play", "push_plan", "render_room", "solve",
    "walkable",
]
