"""Solver-anchored rollouts with a reverse curriculum (the flywheel's ``anchor`` mechanism).

For a train task none of whose plain rollouts succeeded, the env's expert plays it once
(``ExpertActor`` without noise; each of its moves is an expert query, counted) and the env
state before each of its moves is kept (env snapshots). The policy then plays on from the
state after ``k`` of the expert's ``L`` moves (first ``k = ceil(anchor_start * L)``, at least
one move left to the policy), with the turns the rollout budget has left after ``k``, so a
success there is a success of the whole task within its budget. Only the policy's own tokens
are trained: the episode's context starts at the anchor state (``EpisodeRequest.start``).

Per task, after each round the anchor moves by ``max(1, round(anchor_step * L))`` moves:

- back toward the real start when the success at it reached ``anchor_advance``; a task whose
  anchor is its real start (``k = 0``) and that reaches ``anchor_advance`` there graduates
  and leaves the pool: a task brought from never solved to solved;
- forward (more of the expert's moves) when no rollout at it succeeded; at the most help
  (one move left) ``anchor_patience`` such rounds drop the task.

Departures from the papers: BREAD branches from expert prefixes inside a GRPO group and trains
the policy's continuations with RL, here the continuations that succeed are trained by the
flywheel's RFT stage (and replay); R3 moves the start back stage by stage over the whole
dataset, here each task keeps its own anchor; NuRL's hints are text, here they are states.
Envs with ``reseed`` get a fresh future for each rollout from an anchor state (otherwise the
snapshot's random state is replayed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from turnforge.config import TrainConfig
from turnforge.rollout.engine import EpisodeRequest
from turnforge.seeding import stable_hash
from turnforge.types import EnvSnapshot, Task, Trajectory


@dataclass
class Anchor:
    """A task of the pool: the expert's states along its solution and where the policy takes over."""

    task: Task
    snapshots: tuple[EnvSnapshot, ...]  # the state before each of the expert's moves
    k: int  # expert moves played before the policy takes over (0 = the task's real start)
    step: int  # moves the anchor moves by at a time
    misses: int = 0  # rounds in a row without a success at the most help

    @property
    def moves(self) -> int:
        return len(self.snapshots)


@dataclass
class AnchorPool:
    """What the ``anchor`` mechanism carries from round to round."""

    anchors: dict[str, Anchor] = field(default_factory=dict)  # task id -> anchor, in round-robin order
    waiting: list[Task] = field(default_factory=list)  # unsolved tasks not yet given to the expert
    graduated: int = 0
    dropped: int = 0
    expert_moves: int = 0
    unsolved_by_expert: int = 0  # tasks the expert did not solve within the rollout budget

    def expert_share(self) -> float | None:
        """Mean share k / L of the expert's moves played before the policy's, over the pool."""
        xs = [a.k / a.moves for a in self.anchors.values()]
        return sum(xs) / len(xs) if xs else None


def first_anchor(moves: int, start: float) -> int:
    """Where a task entering the pool starts: ``ceil(start * moves)`` expert moves, at least one
    move left to the policy (a one-move solution starts at the real start).

    >>> first_anchor(8, 0.5), first_anchor(5, 0.5), first_anchor(1, 0.5), first_anchor(4, 0.99)
    (4, 3, 0, 3)
    """
    return min(math.ceil(start * moves), moves - 1)


def move_anchor(k: int, moves: int, step: int, success: float, advance: float) -> tuple[int, str]:
    """The anchor after a round, and what happened: ``'back'`` (success reached ``advance``:
    ``step`` fewer expert moves), ``'graduated'`` (it did so at the real start), ``'forward'``
    (no success: ``step`` more expert moves, at most ``moves - 1``), ``'stuck'`` (no success at
    the most help), or ``'stay'``.

    >>> move_anchor(4, 8, 2, 0.5, 0.5), move_anchor(1, 8, 2, 1.0, 0.5), move_anchor(0, 8, 2, 0.5, 0.5)
    ((2, 'back'), (0, 'back'), (0, 'graduated'))
    >>> move_anchor(6, 8, 2, 0.0, 0.5), move_anchor(7, 8, 2, 0.0, 0.5), move_anchor(3, 8, 2, 0.25, 0.5)
    ((7, 'forward'), (7, 'stuck'), (3, 'stay'))
    """
    if success >= advance:
        return (0, "graduated") if k == 0 else (max(k - step, 0), "back")
    if success == 0:
        return (k, "stuck") if k >= moves - 1 else (min(k + step, moves - 1), "forward")
    return k, "stay"


def admit(pool: AnchorPool, cfg: TrainConfig, play_expert: Callable[[list[EpisodeRequest]], list[Trajectory]],
          r: int) -> None:
    """Give waiting tasks to the expert (``play_expert`` plays them with the env's expert,
    keeping snapshots), as many as the pool has room for, and add those it solves with their
    first anchors."""
    fw = cfg.flywheel
    room = fw.anchor_pool - len(pool.anchors)
    tasks, pool.waiting = pool.waiting[:room], pool.waiting[room:]
    if not tasks:
        return
    reqs = [EpisodeRequest(t, stable_hash(cfg.seed, "anchor-expert", t.task_id), f"ax-{r}-{t.task_id}", f"ax-{r}-{t.task_id}")
            for t in tasks]
    for traj in play_expert(reqs):
        if traj.infra_failure is not None:
            continue
        pool.expert_moves += traj.num_turns
        if not traj.success:
            pool.unsolved_by_expert += 1
            continue
        n = traj.num_turns
        pool.anchors[traj.task.task_id] = Anchor(traj.task, traj.snapshots, first_anchor(n, fw.anchor_start),
                                                 max(1, round(fw.anchor_step * n)))


def requests(pool: AnchorPool, cfg: TrainConfig, r: int, reseed: bool) -> list[EpisodeRequest]:
    """This round's anchored episodes: ``anchor_rollouts`` from each of the next ``anchor_tasks``
    tasks of the pool (round robin: played tasks move to the back), but no more tasks than keep
    their worst case (every episode to ``rollout.max_turns``) within half of the round's env-step
    budget, so plain collection always has the other half."""
    fw = cfg.flywheel
    cap = max(1, fw.env_steps_per_round // (2 * fw.anchor_rollouts * cfg.rollout.max_turns))
    picked = list(pool.anchors)[:min(fw.anchor_tasks, cap)]
    for key in picked:  # to the back of the round robin
        pool.anchors[key] = pool.anchors.pop(key)
    out = []
    for key in picked:
        a = pool.anchors[key]
        for g in range(fw.anchor_rollouts):
            seed = stable_hash(cfg.seed, "flywheel", r, "a", key, g)
            start = a.snapshots[a.k] if a.k > 0 else None
            out.append(EpisodeRequest(a.task, seed, f"a-{r}-{key}", f"a-{r}-{key}-{g}", start=start,
                                      max_turns=cfg.rollout.max_turns - a.k,
                                      reseed=seed if reseed and start is not None else None))
    return out


def wait(pool: AnchorPool, tasks: list[Task], cfg: TrainConfig) -> None:
    """Queue tasks no plain rollout solved for the expert (the newest ``anchor_pool`` wait)."""
    known = set(pool.anchors) | {t.task_id for t in pool.waiting}
    pool.waiting = (pool.waiting + [t for t in tasks if t.task_id not in known])[-cfg.flywheel.anchor_pool:]


def update(pool: AnchorPool, played: list[Trajectory], cfg: TrainConfig) -> None:
    """Move each played task's anchor by its success this round (``move_anchor``); graduate and
    drop tasks."""
    fw = cfg.flywheel
    by_task: dict[str, list[Trajectory]] = {}
    for t in played:
        if t.infra_failure is None:
            by_task.setdefault(t.task.task_id, []).append(t)
    for key, trajs in by_task.items():
        a = pool.anchors.get(key)
        if a is None:
            continue
        a.k, what = move_anchor(a.k, a.moves, a.step, sum(t.success for t in trajs) / len(trajs), fw.anchor_advance)
        a.misses = a.misses + 1 if what == "stuck" else 0
        if what == "graduated":
            del pool.anchors[key]
            pool.graduated += 1
        elif a.misses >= fw.anchor_patience:
            del pool.anchors[key]
            pool.dropped += 1


__all__ = ["Anchor", "AnchorPool", "admit", "first_anchor", "move_anchor", "requests", "update", "wait"]
