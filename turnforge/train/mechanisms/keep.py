"""``keep``: the levels the starting policy solved are re-tested each round, and the starting
policy's success on each one the current policy no longer solves is rehearsed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from turnforge.train.mechanisms.base import Mechanism, MechanismRecord

if TYPE_CHECKING:
    from turnforge.data.filters import Candidate


@dataclass
class KeepState:
    pool: dict[str, Candidate] = field(default_factory=dict)  # task id -> the starting policy's kept success on it
    lost: list[str] = field(default_factory=list)  # task ids no rollout solved at their last re-test
    cursor: int = 0  # round robin over the pool
    held_total: int = 0  # re-tests with a success, so far
    lost_total: int = 0  # re-tests without one, so far


@dataclass(frozen=True)
class KeepRecord(MechanismRecord):
    pool: int = 0  # tasks the starting policy solved (round 1's kept successes on hard tasks)
    held: int = 0  # of this round's re-tested tasks, those still solved
    lost: int = 0  # of this round's re-tested tasks, those no rollout solved (their start success rehearsed)


class Keep(Mechanism):
    """Round 1 is played by the starting policy: its kept successes on hard tasks (plain success
    at most ``replay_max_success``, plain or retried) fill a pool of at most ``keep_pool`` tasks.
    Every later round plays ``keep_tasks`` of them as its first wave (the tasks lost at their last
    re-test first, then round robin), ``group_size`` rollouts each as any wave; a task none of
    whose rollouts succeeds is lost this round, and the starting policy's success on it joins
    the round's rft stage (rehearsal), besides the replay buffer. Not in a paper as such: the
    rehearsal of SFT-then-RL recipes, aimed at the levels the policy gives up."""

    name, source, label = "keep", "kept", "kept"
    help = "the starting policy's solved levels re-tested each round; its successes rehearsed on the ones lost"
    Record = KeepRecord
    SEEDS = ("plain", "retry")  # the sources whose round-1 successes are the start's

    def initial_state(self):
        return KeepState()

    def begin(self, col):
        self.r, self.tested, self.rehearse, self.held, self.lost = col.r, [], [], 0, 0

    def first_wave(self, col):
        st, n = self.state, self.cfg.flywheel.keep_tasks
        if not st.pool:
            return []
        ids = pick_retests(list(st.pool), st.lost, st.cursor, n)
        first = len([i for i in st.lost if i in st.pool][:n])  # the lost ones, ahead of the round robin
        st.cursor = (st.cursor + len(ids) - first) % len(st.pool)
        self.tested = ids
        return [st.pool[i].trajectory.task for i in ids]

    def after_collection(self, col, plain, unsolved):
        st = self.state
        lost = []
        for key in self.tested:
            got = [t for t in plain.get(key, []) if t.infra_failure is None]
            if not got:
                continue
            if any(t.success for t in got):
                self.held += 1
            else:
                lost.append(key)
                self.rehearse.append(st.pool[key])
        self.lost = len(lost)
        st.lost = lost
        st.held_total += self.held
        st.lost_total += self.lost

    def route(self, hard):
        st, fw = self.state, self.cfg.flywheel
        if self.r == 0:
            for c in hard:
                if c.source in self.SEEDS and len(st.pool) < fw.keep_pool:
                    st.pool.setdefault(c.trajectory.task.task_id, c)
        return list(self.rehearse)

    def record(self, episodes):
        return KeepRecord(episodes, len(self.state.pool), self.held, self.lost)

    @classmethod
    def columns(cls, record):
        return {**super().columns(record), "held/lost": f"{record.held}/{record.lost}"}

    @classmethod
    def summary(cls, record):
        return f"{super().summary(record)} (start's levels held {record.held}, lost {record.lost}, pool {record.pool})"

    @classmethod
    def report_lines(cls, rounds):
        records = [x.mechanisms[cls.name] for x in rounds]
        if not records[-1].pool:
            return []
        per_round = ", ".join(f"round {x.round}: {r.held} held, {r.lost} lost" for x, r in zip(rounds, records)
                              if r.held or r.lost)
        return ["", (f"Levels the starting policy solved (round 1's successes on hard tasks, {records[-1].pool} in the "
                     f"pool), re-tested each later round: {per_round or 'none re-tested'}; the start's success on each "
                     "lost level was rehearsed.")]


def pick_retests(pool: list[str], lost: list[str], cursor: int, n: int) -> list[str]:
    """The ``n`` task ids of a round's re-test: those of ``lost`` still in the pool first, then the
    pool round robin from ``cursor`` (each id at most once; fewer when the pool is smaller)."""
    out = [i for i in lost if i in set(pool)][:n]
    taken = set(out)
    for k in range(len(pool)):
        if len(out) >= n:
            break
        i = pool[(cursor + k) % len(pool)]
        if i not in taken:
            out.append(i)
            taken.add(i)
    return out
