"""Key and door: a long winding corridor seen through a 3x3 window, a key picked up early,
and locks along the way that open only to the key's colour: an env that needs memory over
long horizons.

The agent walks a corridor of ``length`` cells (drawn per level between ``min_length`` and
``max_length``, 100-300 by default), seeing only the 3x3 cells around it. A few cells in, it
picks up a key whose colour (red, green or blue) is said once, in that turn's observation
("You pick up a key. Key: red.", the form ``expert_summary`` carries it in).
Lamps of every colour hang along the way ("a red lamp glows here"), so the last colour seen is
no guide. The door at the end of the corridor, and with ``gate_every`` a locked gate every that
many cells after the key, open when the agent answers the key's colour (reward
``success_reward`` at the door); a wrong colour ends the episode. So what a lock needs was
shown once, up to hundreds of turns earlier: a ``window`` context has forgotten it, a
``full_history`` context overflows its budget first, and a ``summarize`` context keeps it only
if the policy's summaries carry it (``turnforge.rollout.context``). The passive T-maze of
memory-based RL (Bakker 2002; Ni et al. 2023, "When do transformers shine in RL?") with a
corridor that must be walked and, with gates, several recalls per episode.

Window symbols: ``@`` you, ``#`` wall, ``.`` corridor not yet walked, ``:`` corridor already
walked, ``k`` the key, ``+`` a locked gate or the door. Actions: Up, Down, Left, Right, and a
colour (red, green, blue) at a lock. Walking into a wall, on past a locked gate, or naming a
colour where there is no lock is an invalid action; walking back is allowed (it wastes turns).

``expert_action`` walks on to the next cell and answers each lock with the key's colour;
``expert_summary`` is what a summary must carry (the key's colour, once picked up).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from turnforge.envs.base import InvalidAction, parse_choice
from turnforge.envs.levels import LevelEnv, Outcome, redraw
from turnforge.errors import UserError
from turnforge.seeding import stable_hash

MOVES = ("Up", "Down", "Left", "Right")
DELTAS = ((-1, 0), (1, 0), (0, -1), (0, 1))
COLOURS = ("red", "green", "blue")
ACTIONS = MOVES + COLOURS
#: The two directions at right angles to each action.
PERPENDICULAR = ((2, 3), (2, 3), (0, 1), (0, 1))

Pos = tuple[int, int]


@dataclass(frozen=True)
class KeyDoorLevel:
    """An immutable level: the corridor's cells in walking order (the first is the start, the
    last the end, where the door is), where the key lies, its colour, the lamps, the locks."""

    cells: tuple[Pos, ...]
    key_index: int  # index in ``cells`` of the key's cell
    key_colour: str
    lamps: tuple[tuple[int, str], ...]  # (index in cells, colour)
    locks: tuple[int, ...]  # indices in ``cells`` of the gates, then the door (the last cell)

    def __deepcopy__(self, memo: dict) -> KeyDoorLevel:
        return self  # immutable: snapshots share it

    @property
    def length(self) -> int:
        """Moves from the start to the end of the corridor."""
        return len(self.cells) - 1


@dataclass
class KeyDoorState:
    level: KeyDoorLevel
    pos: Pos
    walked: set[Pos]
    has_key: bool
    opened: int  # locks opened so far (in order)
    message: str  # what the last move showed besides the window (key, lamp, lock)


def _walk(length: int, rng: random.Random) -> list[Pos] | None:
    """A corridor of ``length`` moves that never touches itself: each new cell has no earlier
    cell among its 8 neighbours except the two it follows (so the 3x3 window shows one way
    on), and the end has 3 free neighbours for the doors. Straight runs of 2-6 cells with
    turns between them; None when the walk boxes itself in."""
    cells: list[Pos] = [(0, 0)]
    index: dict[Pos, int] = {(0, 0): 0}

    def free(pos: Pos) -> bool:
        return pos not in index and all(index[p] >= len(cells) - 2 for p in _around(pos) if p in index)

    direction, run = rng.randrange(4), rng.randint(2, 6)
    while len(cells) <= length:
        if run == 0:
            direction, run = rng.choice(PERPENDICULAR[direction]), rng.randint(2, 6)
        for d in (direction, *rng.sample(PERPENDICULAR[direction], 2)):
            nxt = (cells[-1][0] + DELTAS[d][0], cells[-1][1] + DELTAS[d][1])
            if free(nxt):
                break
        else:
            return None
        if d != direction:
            direction, run = d, rng.randint(2, 6)
        cells.append(nxt)
        index[nxt] = len(cells) - 1
        run -= 1
    return cells


def _around(pos: Pos) -> list[Pos]:
    return [(pos[0] + dr, pos[1] + dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1) if (dr, dc) != (0, 0)]


class KeyDoorEnv(LevelEnv[KeyDoorLevel]):
    """The key-and-door corridor (see the module docstring). Levels: ``min_length`` to
    ``max_length`` moves of corridor; the key lies ``key_distance`` (a range) cells in (0: the
    agent starts with it, its colour said in the first observation); about
    one cell in ``lamp_every`` has a lamp of a random colour; with ``gate_every`` > 0 a locked
    gate stands every that many cells after the key (none closer than that to the door)."""

    action_names = ACTIONS

    def __init__(
        self,
        *,
        min_length: int = 100,
        max_length: int = 300,
        key_distance: tuple[int, int] = (2, 5),
        lamp_every: int = 4,
        gate_every: int = 0,
        max_steps: int = 1000,
        invalid_action_penalty: float = -0.1,
        success_reward: float = 1.0,
        first_word: bool = False,
    ) -> None:
        super().__init__(invalid_action_penalty=invalid_action_penalty, max_steps=max_steps, first_word=first_word)
        lo, hi = (int(v) for v in key_distance)
        if not 0 <= lo <= hi:
            raise UserError(f"keydoor: key_distance must be a range [lo, hi] with 0 <= lo <= hi, got {list(key_distance)}")
        if not hi + 2 <= min_length <= max_length:
            raise UserError(f"keydoor: need key_distance[1] + 2 <= min_length <= max_length; got key_distance={list(key_distance)}, "
                            f"min_length={min_length}, max_length={max_length}")
        if lamp_every < 1:
            raise UserError(f"keydoor: lamp_every must be >= 1, got {lamp_every}")
        if gate_every < 0:
            raise UserError(f"keydoor: gate_every must be >= 0 (0 = no gates), got {gate_every}")
        self.min_length, self.max_length, self.key_distance = int(min_length), int(max_length), (lo, hi)
        self.lamp_every, self.gate_every, self.success_reward = int(lamp_every), int(gate_every), float(success_reward)

    @property
    def instructions(self) -> str:
        return (
            "Walk along the corridor, pick up the key, and open every lock on the way and the door at the end by "
            "saying your key's colour. You see the 3x3 cells around you: @ you, # wall, . corridor ahead, "
            ": corridor walked, k key, + lock. Answer with one of Up, Down, Left, Right, or at a lock red, green, blue."
        )

    @property
    def valid_actions_text(self) -> str:
        return ", ".join(ACTIONS)

    def generate_level(self, level_seed: int) -> KeyDoorLevel:
        return redraw(lambda attempt: self._corridor(random.Random(stable_hash("keydoor", level_seed, attempt))), 10_000,
                      "keydoor: no corridor after 10000 attempts")

    def _corridor(self, rng: random.Random) -> KeyDoorLevel | None:
        """A level drawn from ``rng``, or None when the walk of its corridor got stuck."""
        length = rng.randint(self.min_length, self.max_length)
        cells = _walk(length, rng)
        if cells is None:
            return None
        key_index = rng.randint(*self.key_distance)
        gates = range(key_index + self.gate_every, length - self.gate_every + 1, self.gate_every) if self.gate_every else ()
        lamps = tuple((i, rng.choice(COLOURS)) for i in range(1, length)
                      if i != key_index and i not in gates and rng.randrange(self.lamp_every) == 0)
        return KeyDoorLevel(tuple(cells), key_index, rng.choice(COLOURS), lamps, (*gates, length))

    def level_key(self, level: KeyDoorLevel) -> str:
        lamps = ",".join(f"{i}{c[0]}" for i, c in level.lamps)
        locks = ",".join(map(str, level.locks))
        return f"{'/'.join(f'{r}:{c}' for r, c in level.cells)}|key {level.key_index} {level.key_colour}|{lamps}|{locks}"

    def initial_state(self, level: KeyDoorLevel, rng: random.Random) -> KeyDoorState:
        if level.key_index == 0:  # the agent starts with the key
            return KeyDoorState(level, level.cells[0], {level.cells[0]}, True, 0, "You stand at the start of a long "
                                f"corridor. You pick up a key. Key: {level.key_colour}. Open the locks with it.")
        return KeyDoorState(level, level.cells[0], {level.cells[0]}, False, 0,
                            "You stand at the start of a long corridor. Find the key, then open the locks with it.")

    def _cells(self) -> dict[Pos, int]:
        level: KeyDoorLevel = self.state.level
        cache = getattr(self, "_cell_index", None)
        if cache is None or cache[0] is not level:
            cache = (level, {p: i for i, p in enumerate(level.cells)})
            self._cell_index = cache
        return cache[1]

    def _lock_here(self) -> bool:
        """The agent stands at the next lock, still locked."""
        s: KeyDoorState = self.state
        return s.opened < len(s.level.locks) and self._cells()[s.pos] == s.level.locks[s.opened]

    def _cell(self, pos: Pos) -> str:
        s: KeyDoorState = self.state
        if pos == s.pos:
            return "@"
        index = self._cells().get(pos)
        if index is None:
            return "#"
        if index == s.level.key_index and not s.has_key:
            return "k"
        if index in s.level.locks[s.opened:]:
            return "+"
        return ":" if pos in s.walked else "."

    def render(self) -> str:
        s: KeyDoorState = self.state
        r, c = s.pos
        rows = ["".join(self._cell((r + dr, c + dc)) for dc in (-1, 0, 1)) for dr in (-1, 0, 1)]
        return "\n".join(rows) + ("\n" + s.message if s.message else "")

    def parse_action(self, text: str) -> int:
        return parse_choice(text, ACTIONS, self.first_word)

    def apply(self, action: int) -> Outcome:
        s: KeyDoorState = self.state
        level = s.level
        if action >= len(MOVES):
            if not self._lock_here():
                raise InvalidAction("there is no lock here")
            colour = ACTIONS[action]
            door = s.opened == len(level.locks) - 1
            what = "door" if door else "gate"
            if colour != level.key_colour or not s.has_key:
                s.message = f"The {colour} key does not fit: the {what} stays shut."
                return Outcome(0.0, terminated=True, info={"locks_opened": s.opened})
            s.opened += 1
            s.message = f"The {what} opens."
            if door:
                return Outcome(self.success_reward, terminated=True, success=True, info={"locks_opened": s.opened})
            return Outcome(0.0)
        nxt = (s.pos[0] + DELTAS[action][0], s.pos[1] + DELTAS[action][1])
        index = self._cells().get(nxt)
        if index is None:
            raise InvalidAction(f"there is a wall {MOVES[action]} of you")
        if self._lock_here() and index > self._cells()[s.pos]:
            raise InvalidAction("the gate is locked")
        s.pos = nxt
        s.walked.add(nxt)
        s.message = ""
        if index == level.key_index and not s.has_key:
            s.has_key = True
            s.message = f"You pick up a key. Key: {level.key_colour}."
        elif self._lock_here():
            s.message = "The door at the end is locked." if index == len(level.cells) - 1 else "A locked gate."
        else:
            lamp = dict(level.lamps).get(index)
            if lamp is not None:
                s.message = f"A {lamp} lamp glows here."
        return Outcome(0.0)

    def anchor_key(self) -> str:
        """Position, key held, locks opened and cells walked: the window alone does not tell states apart."""
        s: KeyDoorState = self.state
        return f"{s.pos}|{s.has_key}|{s.opened}|{len(s.walked)}"

    def expert_action(self) -> str:
        """The key's colour at a lock; otherwise on to the next corridor cell."""
        s: KeyDoorState = self.state
        if self._lock_here():
            return s.level.key_colour
        target = s.level.cells[self._cells()[s.pos] + 1]
        return MOVES[DELTAS.index((target[0] - s.pos[0], target[1] - s.pos[1]))]

    def expert_summary(self) -> str:
        """What a summary of the episode so far must carry: the key's colour once picked up."""
        s: KeyDoorState = self.state
        return f"Key: {s.level.key_colour}." if s.has_key else "Key: none yet."


__all__ = ["ACTIONS", "COLOURS", "MOVES", "KeyDoorEnv", "KeyDoorLevel", "KeyDoorState"]
