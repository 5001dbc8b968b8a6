"""``curriculum`` (start-state curriculum): episodes started from env snapshots along earlier
successes on hard tasks, a depth of turns before their end that grows as the policy succeeds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from turnforge.train.mechanisms.base import Mechanism, MechanismRecord

if TYPE_CHECKING:
    import numpy as np

    from turnforge.types import EnvSnapshot, Task


@dataclass
class CurriculumState:
    starts: list[tuple[Task, tuple[EnvSnapshot, ...]]] = field(default_factory=list)  # successes on hard tasks
    depth: int = 1  # turns before the end of a success that the next round's episodes start at


@dataclass(frozen=True)
class CurriculumRecord(MechanismRecord):
    depth: int = 1  # turns before the end of a success that curriculum episodes start at (next round)
    success: float | None = None  # success of this round's curriculum episodes (None: none played)


class Curriculum(Mechanism):
    """Each round, before the waves: ``curriculum_rollouts`` unguided episodes from each of up to
    ``curriculum_starts`` env snapshots, ``depth`` kept turns before the end of a stored success
    (its first state when it is shorter); the depth grows by one when the success at it reaches
    ``curriculum_advance``. The round's kept successes on hard tasks, plain or guided, are stored
    (the newest ``replay_size``, snapshots in memory)."""

    name = source = "curriculum"
    help = "episodes from env snapshots along earlier successes, the start moving back as they succeed"
    counts_as_hard = False  # a success from near the end of an earlier one says little of the task
    keeps_snapshots = True
    Record = CurriculumRecord
    SEEDS = ("plain", "guided")  # the sources whose successes are stored as start states

    @classmethod
    def requirements(cls, cfg):
        return [cls.needs("snapshot", "the start-state curriculum")]

    def initial_state(self):
        return CurriculumState()

    def begin(self, col):
        from turnforge.rollout.engine import EpisodeRequest
        from turnforge.seeding import rng, stable_hash

        cfg, fw, st, r = self.cfg, self.cfg.flywheel, self.state, col.r
        self.success = None
        if not st.starts:
            return
        starts = pick_starts(st, fw.curriculum_starts, rng(cfg.seed, "flywheel-curriculum", r))
        reqs = [EpisodeRequest(task, stable_hash(cfg.seed, "flywheel", r, "c", i, g), f"c-{r}-{i}", f"c-{r}-{i}-{g}",
                               start=snapshot) for i, (task, snapshot) in enumerate(starts)
                for g in range(fw.curriculum_rollouts)]
        ok = [t for t in col.play(reqs, self.source) if t.infra_failure is None]
        self.success = sum(t.success for t in ok) / max(len(ok), 1)
        if self.success >= fw.curriculum_advance:
            st.depth += 1

    def route(self, hard):
        st = self.state
        st.starts.extend((c.trajectory.task, tuple(c.trajectory.snapshots[i] for i in c.turns)) for c in hard
                         if c.source in self.SEEDS and c.trajectory.snapshots)
        st.starts = st.starts[-self.cfg.flywheel.replay_size:]
        return []

    def record(self, episodes):
        return CurriculumRecord(episodes, self.state.depth, self.success)

    @classmethod
    def columns(cls, record):
        return {**super().columns(record), "depth": str(record.depth)}


def pick_starts(st: CurriculumState, n: int, gen: np.random.Generator) -> list[tuple[Task, EnvSnapshot]]:
    """Up to ``n`` (task, snapshot) starts, ``st.depth`` kept turns before the end of a stored
    success (its first state when it is shorter): the real start is reached as the depth grows."""
    picks = gen.permutation(len(st.starts))[:n]
    out = []
    for i in picks:
        task, snaps = st.starts[int(i)]
        k = max(len(snaps) - st.depth, 0)
        if k > 0:  # k == 0 is the task's own start, which plain collection already plays
            out.append((task, snaps[k]))
    return out
