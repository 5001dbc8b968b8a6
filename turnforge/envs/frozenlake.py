"""FrozenLake: walk from the top-left corner to the goal in the bottom-right without
falling into a hole.

Like Gymnasium's FrozenLake-v1 except that every level is a fresh random map (each
cell other than start and goal is a hole with probability ``hole_prob``, redrawn until
a path exists) and the start cell is shown as plain ice. On slippery ice the agent
moves in the intended direction with probability 1/3 and in each perpendicular
direction with probability 1/3 (Gymnasium's rule); moving off the map is a valid move
that stays in place.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import numpy as np

from turnforge.envs.base import parse_choice, stable_hash
from turnforge.envs.levels import LevelEnv, Outcome
from turnforge.errors import UserError

ACTIONS = ("Up", "Down", "Left", "Right")
DELTAS = ((-1, 0), (1, 0), (0, -1), (0, 1))
#: The two directions perpendicular to each action (where slippery ice may send you).
PERPENDICULAR = ((2, 3), (2, 3), (0, 1), (0, 1))

Pos = tuple[int, int]


@dataclass(frozen=True)
class FrozenLakeLevel:
    """An immutable map: start (0, 0), goal (size-1, size-1) and the holes."""

    size: int
    holes: frozenset[Pos]

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
    goal, 0 otherwise (a hole ends the episode with 0)."""

    action_names = ACTIONS

    def __init__(
        self,
        *,
        size: int = 4,
        hole_prob: float = 0.2,
        is_slippery: bool = False,
        max_steps: int = 100,
        invalid_action_penalty: float = -0.1,
        success_reward: float = 1.0,
    ) -> None:
        super().__init__(invalid_action_penalty=invalid_action_penalty, max_steps=max_steps)
        if size < 2:
            raise UserError(f"frozenlake: size must be >= 2, got {size}")
        if not 0.0 <= hole_prob < 1.0:
            raise UserError(f"frozenlake: hole_prob must be in [0, 1), got {hole_prob}")
        self.size, self.hole_prob, self.is_slippery = int(size), float(hole_prob), bool(is_slippery)
        self.success_reward = float(success_reward)
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
        for attempt in range(10_000):
            rng = random.Random(stable_hash("frozenlake", level_seed, attempt))
            holes = frozenset(
                (r, c)
                for r in range(self.size)
                for c in range(self.size)
                if rng.random() < self.hole_prob and (r, c) not in ((0, 0), (self.size - 1, self.size - 1))
            )
            level = FrozenLakeLevel(self.size, holes)
            if shortest_path(level, (0, 0)) is not None:
                return level
        raise RuntimeError(f"frozenlake: no map with a path after 10000 attempts; lower hole_prob={self.hole_prob}")

    def level_key(self, level: FrozenLakeLevel) -> str:
        return level.render((0, 0))

    def initial_state(self, level: FrozenLakeLevel, rng: random.Random) -> FrozenLakeState:
        return FrozenLakeState(level, (0, 0))

    def render(self) -> str:
        return self.state.level.render(self.state.player)

    def parse_action(self, text: str) -> int:
        return parse_choice(text, ACTIONS)

    def apply(self, action: int) -> Outcome:
        s: FrozenLakeState = self.state
        actual = action
        if self.is_slippery:
            actual = (action, *PERPENDICULAR[action])[self.rng.randrange(3)]
        nxt = s.level.move(s.player, actual)
        info = {"slipped": actual != action, "moved": nxt != s.player, "direction": ACTIONS[actual]}
        s.player = nxt
        if nxt == s.level.goal:
            return Outcome(self.success_reward, terminated=True, success=True, info=info)
        return Outcome(0.0, terminated=nxt in s.level.holes, info=info)

    def expert_action(self) -> str:
        """BFS shortest path on plain ice; on slippery ice the value-iteration policy."""
        s: FrozenLakeState = self.state
        if not self.is_slippery:
            path = shortest_path(s.level, s.player)
            return ACTIONS[path[0] if path else 0]
        if s.level not in self._policies:
            if len(self._policies) > 10_000:
                self._policies.clear()
            self._policies[s.level] = slippery_policy(s.level)
        return ACTIONS[self._policies[s.level].get(s.player, 0)]


__all__ = ["ACTIONS", "FrozenLakeEnv", "FrozenLakeLevel", "FrozenLakeState", "shortest_path", "slippery_policy"]
