"""``selfplay`` (SWE-RL's self-play): the bugs the policy injected become repair tasks for it.

With the terminal env's ``selfplay`` task source (``turnforge.envs.terminal.selfplay``) a round's
plain episodes are inject tasks: the policy changes a correct function so that the hidden tests
catch it. Every episode the verifier scored as a valid bug reports its module
(``info["injected_module"]`` of its last turn); this mechanism keeps each new one as a repair task
(source ``injected``: the same package with that module) in a pool (at most ``evolve_pool``) and
plays up to ``tasks_per_wave`` of them as the next round's first wave, ``group_size`` rollouts
each, like any wave; their successes train in the rft stage as the round's others. A repair task
retires once every rollout of a round solves it, or after three rounds unsolved (``TaskPool``). The
policy thus trains on both halves: injecting bugs the tests catch, and repairing them.

Departs from SWE-RL, which also requires the injected bug to pass a "higher-order" consistency
check and trains with RL on both roles at once: here the bug is valid when 1-2 lines changed,
the module imports and a hidden test fails, and the roles alternate within the flywheel's rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from turnforge.train.mechanisms.base import MechanismRecord, TaskPool

if TYPE_CHECKING:
    from turnforge.types import Task

#: Index base of the repair tasks made from injected bugs (above any drawn task's index).
INDEX_BASE = 2**41


@dataclass
class SelfPlayState:
    tasks: dict[str, tuple[Task, int]] = field(default_factory=dict)  # task id -> (repair task, rounds unsolved)
    harvested: int = 0  # valid injected bugs turned into repair tasks so far
    retired: int = 0


@dataclass(frozen=True)
class SelfPlayRecord(MechanismRecord):
    harvested: int = 0  # valid bugs made repair tasks so far
    live: int = 0  # repair tasks in play after the round
    retired: int = 0


class SelfPlay(TaskPool):
    """Repair tasks from the policy's own valid injected bugs (see the module docstring)."""

    name, source, label = "selfplay", "injected", "injected bugs"
    help = "the policy's valid injected bugs (terminal env, source=selfplay) replayed as repair tasks"
    Record = SelfPlayRecord
    stream = "flywheel-selfplay"

    @classmethod
    def env_conflict(cls, cfg, env):
        if getattr(env, "source", None) not in ("selfplay", "inject"):
            return (f"flywheel.mechanisms has selfplay, which repairs the bugs the policy injects; it needs env "
                    f"terminal with source=selfplay (env {cfg.env.id!r} has none)")
        return None

    def initial_state(self):
        return SelfPlayState()

    def after_collection(self, col, plain, unsolved):
        from dataclasses import replace

        from turnforge.seeding import stable_hash

        st, fw = self.state, self.cfg.flywheel
        self.retire(plain)
        for episodes in plain.values():
            for t in episodes:
                module = t.turns[-1].info.get("injected_module") if t.success and t.turns else None
                if not module or len(st.tasks) >= fw.evolve_pool or (t.task.data or {}).get("source") != "inject":
                    continue
                data = {"source": "injected", "seed": t.task.data["seed"], "module": str(module)}
                task = replace(t.task, index=INDEX_BASE + stable_hash("selfplay", str(module)) % 2**40, data=data)
                if task.task_id not in st.tasks:
                    st.tasks[task.task_id] = (task, 0)
                    st.harvested += 1

    def record(self, episodes):
        return SelfPlayRecord(episodes, self.state.harvested, len(self.state.tasks), self.state.retired)
