"""``evolve`` (WebRL): easier tasks the env derives from failed ones, played while informative."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from turnforge.train.mechanisms.base import MechanismRecord, TaskPool

if TYPE_CHECKING:
    from turnforge.types import Task

@dataclass
class EvolveState:
    tasks: dict[str, tuple[Task, int]] = field(default_factory=dict)  # task id -> (task, rounds played unsolved)
    retired: int = 0


@dataclass(frozen=True)
class EvolveRecord(MechanismRecord):
    live: int = 0  # derived tasks in play after the round
    retired: int = 0  # derived tasks retired so far


class Evolve(TaskPool):
    """The env derives ``evolve_per_task`` easier tasks from each of a round's unsolved tasks
    (``Env.derive_tasks``; at most ``evolve_pool`` live); up to ``tasks_per_wave`` of them are the
    next rounds' first wave, until a round solves all of their rollouts or they stay unsolved
    three rounds. Departs from WebRL, which derives tasks with an LLM: here with an env hook."""

    name, source = "evolve", "evolved"
    help = "easier tasks the env derives from failed ones, played as each round's first wave"
    Record = EvolveRecord
    stream = "flywheel-evolved"

    @classmethod
    def requirements(cls, cfg):
        return [cls.needs("derive", "self-evolving tasks")]

    def initial_state(self):
        return EvolveState()

    def after_collection(self, col, plain, unsolved):
        """Retire derived tasks that were solved every time (or stayed unsolved three
        rounds, ``TaskPool.retire``); derive new ones from this round's unsolved tasks."""
        from turnforge.seeding import stable_hash

        st, fw = self.state, self.cfg.flywheel
        self.retire(plain)
        for task in unsolved:
            if len(st.tasks) >= fw.evolve_pool or task.task_id in st.tasks:
                continue
            for new in col.engine.env.derive_tasks(task, fw.evolve_per_task, stable_hash(self.cfg.seed, "evolve", col.r, task.task_id)):
                if len(st.tasks) < fw.evolve_pool:
                    st.tasks.setdefault(new.task_id, (new, 0))

    def record(self, episodes):
        return EvolveRecord(episodes, len(self.state.tasks), self.state.retired)
