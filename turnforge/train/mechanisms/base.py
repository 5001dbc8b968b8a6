"""What a flywheel mechanism is: ``Mechanism`` (its declarations and hooks), ``MechanismRecord``
(its part of a round's record) and ``ExpertUse`` (the expert queries it made).

Imported by the config (through the registry), so nothing heavy at module level: the hooks
import what they use when they run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from turnforge.algos.estimators import Requirement

if TYPE_CHECKING:
    from turnforge.config import TrainConfig
    from turnforge.data.filters import Candidate
    from turnforge.envs.base import Env
    from turnforge.policy.model import Policy
    from turnforge.train.flywheel import Collection
    from turnforge.train.metrics import FlywheelRound
    from turnforge.types import Sample, Task, Trajectory


@dataclass(frozen=True)
class MechanismRecord:
    """A mechanism's part of a round's ``FlywheelRound`` (``FlywheelRound.mechanisms[name]``);
    a mechanism with more to say subclasses it (its class's ``Record``)."""

    episodes: tuple[int, int] | None = None  # its source's (scored episodes, successes); None: it plays none

    @staticmethod
    def class_for(name: str) -> type[MechanismRecord]:
        """The record class of mechanism ``name`` (how ``metrics.jsonl`` is read back)."""
        from turnforge.train.mechanisms import MECHANISMS

        if name not in MECHANISMS:
            raise ValueError(f"no flywheel mechanism {name!r} (mechanisms: {', '.join(MECHANISMS)})")
        return MECHANISMS[name].Record


@dataclass(frozen=True)
class ExpertUse:
    """Expert queries a mechanism made so far: hints that needed the env's solver, and the
    expert's moves it played (``summary.json``'s ``expert_queries``)."""

    hints: int = 0
    moves: int = 0


class Mechanism:
    """One flywheel mechanism. Subclasses set the class attributes and override the hooks they
    act at; every hook's default does nothing. One instance per run (``run_flywheel``) holds the
    mechanism's ``state`` (what a resumable checkpoint keeps for it) and what it gathers during a
    round. The round calls the hooks of the mechanisms ``flywheel.mechanisms`` turns on in
    registry order (``turnforge.train.flywheel``):

    1. ``begin``: before the round's waves (episodes of its own come first);
    2. ``first_wave``: tasks played as a wave before the fresh ones;
    3. ``after_wave``: a wave's tasks no rollout solved; returns those still unsolved;
    4. ``after_collection``: the round's plain episodes by task and its unsolved tasks;
    5. ``candidates``: more episodes offered to the filters, after the played ones;
    6. ``route``: the kept successes on hard tasks; returns earlier episodes to train on again;
    7. ``sample_weights``: the RFT weights of the samples of its source's candidates;
    8. ``rft_extra``: more samples for the rft stage with their weights (a negative weight: pushed
       down, ``turnforge.algos.signed_nll``);
    9. ``record``: its part of the round's record.
    """

    name: ClassVar[str]  # its flywheel.mechanisms name
    help: ClassVar[str]  # a few words for the config key's description
    source: ClassVar[str | None] = None  # the trajectory store's source of the episodes it plays (None: none)
    label: ClassVar[str] = ""  # its episodes in reports and messages (default: the source)
    trains_as_played: ClassVar[bool] = True  # its episodes go to the filters as played (else: ``candidates``)
    counts_as_hard: ClassVar[bool] = True  # its kept successes count as successes on hard tasks (``route``)
    remembered: ClassVar[bool] = True  # its successes may enter the episodic memory (memory.sources)
    keeps_snapshots: ClassVar[bool] = False  # the round's episodes keep their env snapshots
    Record: ClassVar[type[MechanismRecord]] = MechanismRecord

    def __init__(self, cfg: TrainConfig, state: Any = None) -> None:
        self.cfg = cfg
        self.state = state if state is not None else self.initial_state()

    # -- declarations (the config and the start checks ask them)
    @classmethod
    def requirements(cls, cfg: TrainConfig) -> list[Requirement]:
        """The env capabilities it needs (checked at start, before any model work)."""
        return []

    @classmethod
    def needs(cls, capability: str, what: str) -> Requirement:
        """``capability`` for ``what`` (the error says it and to drop the mechanism instead)."""
        return Requirement(capability, f"{what} (flywheel.mechanisms has {cls.name})", f"drop {cls.name} from flywheel.mechanisms")

    @classmethod
    def conflict(cls, cfg: TrainConfig) -> str | None:
        """Its own cross-key config rules: one line, or None."""
        return None

    @classmethod
    def env_conflict(cls, cfg: TrainConfig, env: Env) -> str | None:
        """What else it needs of the run's env, beyond a capability (checked at start): one line, or None."""
        return None

    def initial_state(self) -> Any:
        """What it carries from round to round, at the start (None: nothing)."""
        return None

    # -- the run
    def open(self, policy: Policy) -> None:
        """Before the first round (e.g. an engine of its own)."""

    def close(self) -> None:
        """After the last round, or when the stage stops."""

    # -- a round's hooks, in the order they are called
    def begin(self, col: Collection) -> None:
        pass

    def first_wave(self, col: Collection) -> list[Task]:
        return []

    def after_wave(self, col: Collection, failed: list[Task]) -> list[Task]:
        return failed

    def after_collection(self, col: Collection, plain: dict[str, list[Trajectory]], unsolved: list[Task]) -> None:
        pass

    def candidates(self, col: Collection) -> list[Candidate]:
        return []

    def route(self, hard: list[Candidate]) -> list[Candidate]:
        return []

    def sample_weights(self, policy: Policy, samples: list[Sample]) -> list[float] | None:
        """Weights of the samples of its source's candidates in the RFT stage (None: 1 each)."""
        return None

    def rft_extra(self, col: Collection) -> tuple[list[Sample], list[float]]:
        """Samples it adds to the round's rft stage and their weights (< 0: pushed down); none by default."""
        return [], []

    def record(self, episodes: tuple[int, int] | None) -> MechanismRecord:
        """Its part of the round's record, given its source's (scored episodes, successes)."""
        return self.Record(episodes)

    def expert_use(self) -> ExpertUse:
        return ExpertUse()

    # -- reports (turnforge.train.flywheel_report) and the round's message
    @classmethod
    def episodes_label(cls) -> str:
        return cls.label or cls.source or cls.name

    @classmethod
    def columns(cls, record: MechanismRecord) -> dict[str, str]:
        """Its cells of the report's table of rounds, by column name."""
        if record.episodes is None:
            return {}
        return {cls.episodes_label(): f"{record.episodes[1]}/{record.episodes[0]}"}

    @classmethod
    def summary(cls, record: MechanismRecord) -> str:
        """Its part of the round's message ('' for none)."""
        if record.episodes is None:
            return ""
        return f"{cls.episodes_label()} {record.episodes[1]}/{record.episodes[0]}"

    @classmethod
    def report_lines(cls, rounds: list[FlywheelRound]) -> list[str]:
        """A paragraph of its own in the report, over all rounds (none by default)."""
        return []


class TaskPool(Mechanism):
    """A mechanism that keeps a pool of tasks of its own (``evolve``: derived tasks; ``selfplay``:
    repairs of injected bugs). Its state holds ``tasks`` (task id -> (task, rounds played
    unsolved)) and ``retired``; up to ``tasks_per_wave`` of them, in an order drawn from
    ``stream``, are each round's first wave; ``retire`` drops the tasks a round solved in every
    rollout, and those left unsolved ``patience`` rounds in a row."""

    stream: ClassVar[str]  # the random stream of the first wave's order
    patience: ClassVar[int] = 3

    def first_wave(self, col: Collection) -> list[Task]:
        from turnforge.seeding import rng

        pool = [t for t, _ in self.state.tasks.values()]
        order = rng(self.cfg.seed, self.stream, col.r).permutation(len(pool))
        return [pool[int(i)] for i in order[:self.cfg.flywheel.tasks_per_wave]]

    def retire(self, plain: dict[str, list[Trajectory]]) -> None:
        st = self.state
        for key, (task, age) in list(st.tasks.items()):
            got = [t for t in plain.get(key, []) if t.infra_failure is None]
            wins = sum(t.success for t in got)
            if got and (wins == len(got) or (wins == 0 and age + 1 >= self.patience)):
                del st.tasks[key]
                st.retired += 1
            elif got and wins == 0:
                st.tasks[key] = (task, age + 1)
