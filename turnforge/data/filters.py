"""Flywheel filters: which of the agent's own episodes (and which of their turns) are trained on.

A filter is a pure function from a list of ``Candidate`` (a trajectory, the turns of it that
are kept, where it came from) to a shorter one; ``apply_filters`` runs the ones a recipe names
in the recipe's order and counts what each kept (``FilterCount``). Filters:

- ``infra``: drop episodes the machinery failed (they have no score; never trained on);
- ``success``: keep episodes the env's verifier marked successful;
- ``reward``: keep episodes whose return is at least ``FilterParams.min_reward``;
- ``truncation``: drop episodes cut by the context budget or with an action cut at
  ``max_new_tokens`` (a truncated action is not the policy's complete answer);
- ``loops``: cut the turns between two visits of the same env state (``Turn.anchor_key``):
  what is left is still a path the env accepted, without the detour. Only for per-turn
  samples (``rollout.context=window``); a whole-episode sample (``full_history``) has no
  turn to cut, and such episodes pass unchanged;
- ``length``: drop episodes with more than ``FilterParams.max_length`` kept turns;
- ``dedup``: drop an episode whose task and kept action sequence equal an earlier one's;
- ``task_cap``: at most ``FilterParams.per_task_cap`` episodes per task, fewest kept turns first.

Departure from the papers' rejection sampling (which keeps whole successful samples): the
``loops`` filter edits episodes at turn level; it is sound for memoryless contexts
(``history_window=0``) and keeps the context of every kept turn as it was sampled otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from turnforge.types import Trajectory


@dataclass(frozen=True)
class Candidate:
    """An episode offered to training: the turns whose samples are used and its source."""

    trajectory: Trajectory
    turns: tuple[int, ...]  # indices into trajectory.turns (and its per-turn samples)
    source: str = "plain"

    @classmethod
    def of(cls, trajectory: Trajectory, source: str = "plain") -> Candidate:
        return cls(trajectory, tuple(range(trajectory.num_turns)), source)

    @property
    def actions(self) -> tuple[str, ...]:
        return tuple(self.trajectory.turns[i].action_text for i in self.turns)


@dataclass(frozen=True)
class FilterParams:
    """Parameters of the filters that take one (see ``FlywheelConfig``)."""

    min_reward: float = 0.0
    max_length: int = 1_000_000
    per_task_cap: int = 1


@dataclass(frozen=True)
class FilterCount:
    """What one filter did to the episodes (and their kept turns) it was given."""

    name: str
    episodes_in: int
    episodes_out: int
    turns_in: int
    turns_out: int


def _infra(cands: list[Candidate], p: FilterParams) -> list[Candidate]:
    return [c for c in cands if c.trajectory.infra_failure is None]


def _success(cands: list[Candidate], p: FilterParams) -> list[Candidate]:
    return [c for c in cands if c.trajectory.infra_failure is None and c.trajectory.success]


def _reward(cands: list[Candidate], p: FilterParams) -> list[Candidate]:
    return [c for c in cands if c.trajectory.infra_failure is None and c.trajectory.episode_return >= p.min_reward]


def _truncation(cands: list[Candidate], p: FilterParams) -> list[Candidate]:
    return [c for c in cands if c.trajectory.truncation_reason != "context_budget"
            and not any(c.trajectory.turns[i].generation_truncated for i in c.turns)]


def cut_loops(keys: Sequence[str], turns: Sequence[int]) -> tuple[int, ...]:
    """The turns left after cutting every detour: from each kept turn's state, jump to the
    last turn taken in that same state (``keys[i]`` is the state before turn ``i``).

    >>> cut_loops(["a", "b", "a", "c"], range(4))   # a -> b -> a -> c: the detour via b goes
    (2, 3)
    """
    turns = list(turns)
    last = {keys[i]: pos for pos, i in enumerate(turns)}
    out, pos = [], 0
    while pos < len(turns):
        pos = last[keys[turns[pos]]]
        out.append(turns[pos])
        pos += 1
    return tuple(out)


def _loops(cands: list[Candidate], p: FilterParams) -> list[Candidate]:
    out = []
    for c in cands:
        t = c.trajectory
        per_turn = t.samples and all(x.turn_index >= 0 for x in t.samples)
        out.append(replace(c, turns=cut_loops([turn.anchor_key for turn in t.turns], c.turns)) if per_turn else c)
    return out


def _length(cands: list[Candidate], p: FilterParams) -> list[Candidate]:
    return [c for c in cands if len(c.turns) <= p.max_length]


def _dedup(cands: list[Candidate], p: FilterParams) -> list[Candidate]:
    seen: set[tuple[str, tuple[str, ...]]] = set()
    out = []
    for c in cands:
        key = (c.trajectory.task.task_id, c.actions)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _task_cap(cands: list[Candidate], p: FilterParams) -> list[Candidate]:
    by_task: dict[str, list[int]] = {}
    for i, c in enumerate(cands):
        by_task.setdefault(c.trajectory.task.task_id, []).append(i)
    keep: set[int] = set()
    for idx in by_task.values():
        keep.update(sorted(idx, key=lambda i: (len(cands[i].turns), i))[: p.per_task_cap])
    return [c for i, c in enumerate(cands) if i in keep]


FILTERS: dict[str, Callable[[list[Candidate], FilterParams], list[Candidate]]] = {
    "infra": _infra,
    "success": _success,
    "reward": _reward,
    "truncation": _truncation,
    "loops": _loops,
    "length": _length,
    "dedup": _dedup,
    "task_cap": _task_cap,
}


def apply_filters(cands: Sequence[Candidate], names: Sequence[str], params: FilterParams) -> tuple[list[Candidate], list[FilterCount]]:
    """Run the named filters in order; returns what is left and one count per filter."""
    out, counts = list(cands), []
    for name in names:
        before, turns_before = len(out), sum(len(c.turns) for c in out)
        out = FILTERS[name](out, params)
        counts.append(FilterCount(name, before, len(out), turns_before, sum(len(c.turns) for c in out)))
    return out, counts


def kept_samples(cands: Sequence[Candidate]) -> list:
    """The samples of the kept turns (per-turn samples), or all of an episode's samples of
    several turns (its whole-episode sample, or every segment of a ``summarize`` context)."""
    out = []
    for c in cands:
        t = c.trajectory
        spans = [x for x in t.samples if x.turn_index < 0]
        if spans:
            out.extend(spans)
        else:
            by_turn = {x.turn_index: x for x in t.samples}
            out.extend(by_turn[i] for i in c.turns if i in by_turn)
    return out


__all__ = ["Candidate", "FILTERS", "FilterCount", "FilterParams", "apply_filters", "cut_loops", "kept_samples"]
