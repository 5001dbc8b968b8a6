"""``negatives``: failed episodes carry signal too. A failed turn's action in a state where the
same task's successes acted otherwise is pushed down in the rft stage (unlikelihood)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from turnforge.train.mechanisms.base import Mechanism, MechanismRecord

if TYPE_CHECKING:
    from turnforge.types import Sample, Trajectory


@dataclass(frozen=True)
class NegativesRecord(MechanismRecord):
    samples: int = 0  # failed turns pushed down this round
    tasks: int = 0  # tasks they came from (each with a success in the round)


class Negatives(Mechanism):
    """Each round, on every task with both a success and a failure among the round's episodes
    trained as played (plain, retried, anchored, ...): each distinct (state, action) of a failed
    episode that no success of the task took in its state (``Env.anchor_key``; with
    ``negative_scope=state`` only in states a success visited) joins the rft stage with weight
    ``-negative_weight``: the loss adds
    ``negative_weight x -log(1 - p(action))`` (``turnforge.algos.signed_nll``, unlikelihood),
    beside the kept successes' likelihood. Negative-sample reinforcement (Zhu et al. 2025) pushes
    down every failed episode's actions by REINFORCE; here, inside supervised fine-tuning and with
    a bounded loss, only those of tasks the round also solved and never an action a success took
    in the same state.
    Needs per-turn samples (``rollout.context=window``); episodes of several turns per sample are
    left out."""

    name = "negatives"
    help = "failed turns' actions no success of the same task took there, pushed down (unlikelihood) in rft"
    Record = NegativesRecord

    @classmethod
    def requirements(cls, cfg):
        return [cls.needs("anchor_key", "matching failed turns to successes' states")]

    @classmethod
    def conflict(cls, cfg):
        if "rft" not in cfg.flywheel.stages:
            return "flywheel.mechanisms has negatives, which trains in the rft stage: add rft to flywheel.stages"
        return None

    def begin(self, col):
        self.samples, self.tasks = [], 0

    def rft_extra(self, col):
        from turnforge.train.mechanisms import MECHANISMS

        as_played = {"plain"} | {cls.source for cls in MECHANISMS.values() if cls.source and cls.trains_as_played}
        by_task: dict[str, list[Trajectory]] = {}
        for t, src in col.played:
            if src in as_played and t.infra_failure is None:
                by_task.setdefault(t.task.task_id, []).append(t)
        self.samples, self.tasks = negative_samples(by_task.values(), self.cfg.flywheel.negative_scope)
        w = -self.cfg.flywheel.negative_weight
        return list(self.samples), [w] * len(self.samples)

    def record(self, episodes):
        return NegativesRecord(episodes, len(self.samples), self.tasks)

    @classmethod
    def columns(cls, record):
        return {"negatives": str(record.samples)}

    @classmethod
    def summary(cls, record):
        return f"negatives {record.samples} turns ({record.tasks} tasks)"


def contradicted_turns(episodes: Sequence[tuple[bool, Sequence[tuple[Hashable, str]]]],
                       scope: str) -> list[tuple[int, int]]:
    """The turns of one task's failed episodes that its successes contradict: ``episodes`` are
    ``(success, [(state key, action), ...])``; a failed episode's turn ``(s, a)`` is returned as
    ``(episode, turn)``, each distinct ``(s, a)`` once (its first occurrence), when no success
    took ``a`` in ``s`` and (``scope="state"``) a success visited ``s``, or (``scope="task"``)
    anywhere in the episode. None when the task has no success."""
    good: dict[Hashable, set[str]] = {}
    for ok, turns in episodes:
        if ok:
            for key, action in turns:
                good.setdefault(key, set()).add(action)
    if not good:
        return []
    out, seen = [], set()
    for e, (ok, turns) in enumerate(episodes):
        if ok:
            continue
        for i, (key, action) in enumerate(turns):
            visited = key in good or scope == "task"
            if visited and action not in good.get(key, ()) and (key, action) not in seen:
                seen.add((key, action))
                out.append((e, i))
    return out


def negative_samples(tasks, scope: str) -> tuple[list[Sample], int]:
    """The per-turn samples of the contradicted turns of each task's episodes (``contradicted_turns``)
    and how many tasks gave any."""
    samples, n = [], 0
    for trajs in tasks:
        picks = contradicted_turns([(t.success, [(turn.anchor_key, turn.action_text.strip()) for turn in t.turns])
                                    for t in trajs], scope)
        got = []
        for e, i in picks:
            by_turn = {x.turn_index: x for x in trajs[e].samples}
            if i in by_turn:
                got.append(by_turn[i])
        samples += got
        n += bool(got)
    return samples, n
