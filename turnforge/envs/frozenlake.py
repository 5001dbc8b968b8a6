"""FrozenLake: walk from the top-left corner to the goal in the bottom-right without
falling into a hole.

Like Gymnasium's FrozenLake-v1 except that every level is a fresh random map (each
cell other than start and goal is a hole with probability ``hole_prob``, redrawn until
a path exists) and the start cell is shown as plain ice. On slippery ice the agent
moves in the intended direction with probability 1/3 and in each perpendicular
direction with probability 1/3 (Gymnasium's rule); moving off the map is a valid move
that stays in place.

Guidance (``guidance=1..3``, see ``FrozenLakeEnv.guidance_levels``) and derived tasks
(``FrozenLakeEnv.derive_tasks``, the start moved nearer the goal) are optional; with
``guidance=0`` the env is unchanged.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Iterator, Mapping

import numpy as np

from turnforge.envs.base import parse_choice
from turnforge.envs.levels import LevelEnv, Outcome, redraw
from turnforge.errors import UserError
from turnforge.seeding import stable_hash
from turnforge.types import Task

ACTIONS = ("Up", "Down", "Left", "Right")
DELTAS = ((-1, 0), (1, 0), (0, -1), (0, 1))
#: The two directions perpendicular to each action (where slippery ice may send you).
PERPENDICULAR = ((2, 3), (2, 3), (0, 1), (0, 1))

Pos = tuple[int, int]


@dataclass(frozen=True)
class FrozenLakeLevel:
    """An immutable map: the start ((0, 0) in generated maps), goal (size-1, size-1) and the holes."""

    size: int
    holes: frozenset[Pos]
    start: Pos = (0, 0)

    def __deepcopy__(self, memo: dict) -> FrozenLakeLevel:
        return self  # immutable: snapshots share it

    @property
    def goal(self) -> Pos:
        return (self.size - 1, self.size - 1)

    def move(self, pos: Pos, action: int) -> Pos:
        """Where ``action`` leads from ``pos`` (off the map: stay)."""
        r, c = pos[0] + DELTAS[action][0], pos[1] + DELTAS[action][1]
        return (r, c) if 0 <= r < self.size and 0 <= c < self.size else pos

    def render(self, player: Pos) -> str:
        """Rows of 'P' player, '_' ice, 'O' hole, 'G' goal."""

        def cell(pos: Pos) -> str:
            if pos == player:
                return "P"
            if pos == self.goal:
                return "G"
            return "O" if pos in self.holes else "_"

        return "\n".join("".join(cell((r, c)) for c in range(self.size)) for r in range(self.size))

    @classmethod
    def from_text(cls, text: str) -> FrozenLakeLevel:
        """Parse a map in the render format, the player ('P') marking the start."""
        rows = text.strip("\n").split("\n")
        size = len(rows)
        if any(len(row) != size for row in rows):
            raise ValueError("a FrozenLake map must be square")
        holes, starts = set(), []
        for r, row in enumerate(rows):
            for c, ch in enumerate(row):
                if ch not in "P_OG":
                    raise ValueError(f"unknown FrozenLake cell {ch!r} at row {r}, column {c}")
                if ch == "O":
                    holes.add((r, c))
                if ch == "P":
                    starts.append((r, c))
                if ch == "G" and (r, c) != (size - 1, size - 1):
                    raise ValueError("the goal 'G' must be in the bottom-right corner")
        if len(starts) != 1 or starts[0] == (size - 1, size - 1):
            raise ValueError("a FrozenLake map needs one player 'P', not on the goal")
        if rows[-1][-1] != "G":
            raise ValueError("the bottom-right cell must be the goal 'G'")
        return cls(size, frozenset(holes), starts[0])


@dataclass
class FrozenLakeState:
    """Mutable episode state: the level (shared, immutable) and the player's cell."""

    level: FrozenLakeLevel
    player: Pos


def shortest_path(level: FrozenLakeLevel, start: Pos) -> list[int] | None:
    """Fewest-moves action sequence from ``start`` to the goal on non-slippery ice (BFS)."""
    parent: dict[Pos, tuple[Pos, int] | None] = {start: None}
    queue = deque([start])
    while queue:
        pos = queue.popleft()
        if pos == level.goal:
            path = []
            while parent[pos] is not None:
                pos, action = parent[pos]  # type: ignore[misc]
                path.append(action)
            return path[::-1]
        for action in range(4):
            nxt = level.move(pos, action)
            if nxt not in parent and nxt not in level.holes:
                parent[nxt] = (pos, action)
                queue.append(nxt)
    return None


def slippery_policy(level: FrozenLakeLevel, gamma: float = 0.999, tol: float = 1e-10) -> dict[Pos, int]:
    """Value iteration on slippery ice: per safe cell, the action that maximises the
    (discounted, gamma close to 1) probability of reaching the goal."""
    cells = [(r, c) for r in range(level.size) for c in range(level.size)]
    index = {pos: i for i, pos in enumerate(cells)}
    # nxt[s, a, k]: the cell reached from s by action a when the ice sends it the k-th way
    nxt = np.array([[[index[level.move(p, b)] for b in (a, *PERPENDICULAR[a])] for a in range(4)] for p in cells])
    live = np.array([p not in level.holes and p != level.goal for p in cells])
    value = np.zeros(len(cells))  # [S]
    value[index[level.goal]] = 1.0
    for _ in range(100_000):
        q = value[nxt].mean(axis=2)  # [S, A]
        new = np.where(live, gamma * q.max(axis=1), value)
        done = np.abs(new - value).max() < tol
        value = new
        if done:
            break
    best = value[nxt].mean(axis=2).argmax(axis=1)  # [S], first best action on ties
    return {p: int(best[i]) for i, p in enumerate(cells) if live[i]}


class FrozenLakeEnv(LevelEnv[FrozenLakeLevel]):
    """FrozenLake on a random ``size`` x ``size`` map; reward ``success_reward`` at the
    goal, 0 otherwise (a hole ends the episode with 0).

    ``guidance`` (0 = off) gives hints of growing strength, each level including the ones
    below it (``guidance_levels``). The guard of level 1 undoes a move that ends in a hole (on
    slippery ice the move the ice actually made), so with guidance no episode is lost. No
    hint names a move to make.
    """

    action_names = ACTIONS
    guidance_levels = (
        "hole guard: a move that ends in a hole is undone, and a hint says so (1 expert query each)",
        "level 1 + which neighbouring cells are holes",
        "level 2 + the number of moves of the shortest safe path to the goal (BFS, 1 expert query)",
    )

    def __init__(
        self,
        *,
        size: int = 4,
        hole_prob: float = 0.2,
        is_slippery: bool = False,
        max_steps: int = 100,
        invalid_action_penalty: float = -0.1,
        success_reward: float = 1.0,
        guidance: int = 0,
        first_word: bool = False,
        expert_thoughts: bool = False,
    ) -> None:
        super().__init__(invalid_action_penalty=invalid_action_penalty, max_steps=max_steps, guidance=guidance,
                         first_word=first_word)
        if size < 2:
            raise UserError(f"frozenlake: size must be >= 2, got {size}")
        if not 0.0 <= hole_prob < 1.0:
            raise UserError(f"frozenlake: hole_prob must be in [0, 1), got {hole_prob}")
        self.size, self.hole_prob, self.is_slippery = int(size), float(hole_prob), bool(is_slippery)
        self.success_reward = float(success_reward)
        self.expert_thoughts = bool(expert_thoughts)
        self._policies: dict[FrozenLakeLevel, dict[Pos, int]] = {}

    @property
    def instructions(self) -> str:
        slip = " The ice is slippery: you may slide sideways instead." if self.is_slippery else ""
        return (
            "Walk to the goal without falling into a hole. "
            f"Symbols: P you, _ ice, O hole, G goal.{slip} Answer with one of Up, Down, Left, Right."
        )

    @property
    def valid_actions_text(self) -> str:
        return ", ".join(ACTIONS)

    def generate_level(self, level_seed: int) -> FrozenLakeLevel:
        """A random map with a hole-free path from start to goal (maps without one are redrawn)."""
        return redraw(lambda attempt: self._map(random.Random(stable_hash("frozenlake", level_seed, attempt))), 10_000,
                      f"frozenlake: no map with a path after 10000 attempts; lower hole_prob={self.hole_prob}")

    def _map(self, rng: random.Random) -> FrozenLakeLevel | None:
        """A map drawn from ``rng``, or None when no path leads from start to goal."""
        holes = frozenset(
            (r, c)
            for r in range(self.size)
            for c in range(self.size)
            if rng.random() < self.hole_prob and (r, c) not in ((0, 0), (self.size - 1, self.size - 1))
        )
        level = FrozenLakeLevel(self.size, holes)
        return level if shortest_path(level, (0, 0)) is not None else None

    def level_key(self, level: FrozenLakeLevel) -> str:
        return level.render(level.start)

    def level_from_data(self, data: Mapping[str, Any]) -> FrozenLakeLevel:
        return FrozenLakeLevel.from_text(data["level"])

    def initial_state(self, level: FrozenLakeLevel, rng: random.Random) -> FrozenLakeState:
        return FrozenLakeState(level, level.start)

    def render(self) -> str:
        return self.state.level.render(self.state.player)

    def parse_action(self, text: str) -> int:
        return parse_choice(text, ACTIONS, self.first_word)

    def apply(self, action: int) -> Outcome:
        s: FrozenLakeState = self.state
        actual = action
        if self.is_slippery:
            actual = (action, *PERPENDICULAR[action])[self.rng.randrange(3)]
        nxt = s.level.move(s.player, actual)
        info = {"slipped": actual != action, "moved": nxt != s.player, "direction": ACTIONS[actual]}
        if self.guidance:
            info["guarded"] = nxt in s.level.holes
            if info["guarded"]:  # the hole guard: stay where you were
                info["moved"] = False
                self.guard_note = f"moving {ACTIONS[actual]} from there fell into a hole; the move was undone"
                if actual != action:
                    self.guard_note = f"the ice slid you {ACTIONS[actual]} instead of {ACTIONS[action]}: " + self.guard_note
                return Outcome(0.0, info=info)
        s.player = nxt
        if nxt == s.level.goal:
            return Outcome(self.success_reward, terminated=True, success=True, info=info)
        return Outcome(0.0, terminated=nxt in s.level.holes, info=info)

    def potential(self) -> float:
        """Shaping potential: ``1 - d / size**2`` with ``d`` the fewest safe moves from the agent
        to the goal (BFS), 0 where no safe path is left. Positive everywhere a path exists, so
        with the engine's Phi = 0 at terminal states (goal and hole alike) falling into a hole
        costs the potential given up, and an episode cut off nearer the goal scores higher than
        one cut off farther away (the sum telescopes: optimal policies are unchanged)."""
        s: FrozenLakeState = self.state
        path = shortest_path(s.level, s.player)
        return 0.0 if path is None else 1.0 - len(path) / s.level.size**2

    def expert_action(self) -> str:
        """BFS shortest path on plain ice; on slippery ice the value-iteration policy. With
        ``expert_thoughts`` the move follows a short thought, as a reasoning model writes it:
        ``<think>\nTHOUGHT\n</think>\n\nMOVE`` (``expert_thought``); the env is sent the move only
        (the engine parses actions from the part after ``</think>``)."""
        s: FrozenLakeState = self.state
        if not self.is_slippery:
            path = shortest_path(s.level, s.player)
            move = ACTIONS[path[0] if path else 0]
        else:
            if s.level not in self._policies:
                if len(self._policies) > 10_000:
                    self._policies.clear()
                self._policies[s.level] = slippery_policy(s.level)
            move = ACTIONS[self._policies[s.level].get(s.player, 0)]
        return f"<think>\n{self.expert_thought()}\n</think>\n\n{move}" if self.expert_thoughts else move

    def expert_thought(self) -> str:
        """The expert's thought before its move: on plain ice its plan, the moves of a shortest safe
        path ("path Down Down Right"); on slippery ice, where no plan survives the ice, where the goal
        lies ("goal 2 Down 1 Right")."""
        s: FrozenLakeState = self.state
        if not self.is_slippery:
            path = shortest_path(s.level, s.player) or []
            return " ".join(["path", *(ACTIONS[a] for a in path)])
        (r, c), (gr, gc) = s.player, s.level.goal
        return f"goal {gr - r} Down {gc - c} Right"

    # ------------------------------------------------------------ guidance
    def hints(self, level: int) -> list[str]:
        """Level 2: the neighbouring holes; level 3: also the length of the shortest safe path
        (BFS, 1 expert query). (Level 1's guard note comes from ``apply``.)"""
        s: FrozenLakeState = self.state
        if level < 2:
            return []
        around = [ACTIONS[a] for a in range(4) if s.level.move(s.player, a) in s.level.holes]
        hints = ["holes: " + (", ".join(around) if around else "none")]
        if level >= 3:
            self.expert_queries += 1
            path = shortest_path(s.level, s.player)
            if path is None:
                hints.append("the goal cannot be reached from here")
            else:
                hints.append(f"the goal is {len(path)} safe move{'s' if len(path) != 1 else ''} away")
        return hints

    # ------------------------------------------------------------ derived tasks
    def derive_tasks(self, task: Task, n: int, seed: int) -> list[Task]:
        """Up to ``n`` easier train tasks: the same map with the start moved j moves along a
        shortest safe path from the parent's start (so the goal is nearer), never onto a
        held-out map; ``seed`` draws which j."""
        parent = self.level_for(task)
        path = shortest_path(parent, parent.start)
        if not path or len(path) < 2:
            return []
        rng = random.Random(stable_hash("derive", task.task_id, seed))

        def easier(level: FrozenLakeLevel) -> bool:
            found = shortest_path(level, level.start)
            return found is not None and 0 < len(found) < len(path)

        return self.derived_tasks(task, self._derived_candidates(parent, path, rng), n, easier)

    def _derived_candidates(
        self, parent: FrozenLakeLevel, path: list[int], rng: random.Random
    ) -> Iterator[tuple[FrozenLakeLevel, str, int]]:
        cells = [parent.start]
        for action in path:
            cells.append(parent.move(cells[-1], action))
        steps = list(range(1, len(path)))  # cells[len(path)] is the goal
        rng.shuffle(steps)
        for j in steps:
            r, c = cells[j]
            how = f"start moved {j} of {len(path)} moves along a shortest safe path, to row {r}, column {c}"
            yield replace(parent, start=cells[j]), how, j


__all__ = ["ACTIONS", "FrozenLakeEnv", "FrozenLakeLevel", "FrozenLakeState", "shortest_path", "slippery_policy"]
