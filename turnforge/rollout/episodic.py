"""Episodic memory: the run's past successes, retrieved at reset and shown before the first
observation (``memory`` section of the config).

What enters: each successful, scored train-split episode whose ``source`` is in
``memory.sources`` (the flywheel's and RL's own episodes; BC's demonstrations with ``demo``),
added by the stage that played it once its episodes are collected (so every episode of a
round or an iteration sees the same memory, whatever the order they finish in). One entry per
task: its shortest success (ties: the first). Evaluations never add.

What is retrieved: at each reset the engine scores every entry's first observation against the
episode's first observation with BM25 (``rank_bm25.BM25Plus``: Okapi's idf goes negative for a
term in more than half of the documents, which every small memory of early training has; BM25+'s
constant lower-bound term is taken off, so a score of 0 means no term in common) and
shows the ``memory.k`` best with a score above ``memory.min_score``, each as its first
observation and its valid actions (invalid ones, which changed nothing, are left out). Terms are the words and punctuation marks of an observation, each
alone and with its line and column: two grid maps match cell by cell, two texts word by word.

The block is context (loss mask 0): its ids are written once per episode (cut to
``memory.max_tokens``) and stand at the start of the first user message of every prompt the
episode has (``turnforge.rollout.context.EpisodeContext.memory``), so the stored samples hold
exactly the ids the sampler saw.

Persistence: ``RUN/memory.parquet`` (one row per entry, rewritten after each addition) for
inspection and for ``memory.store`` (another run's memory, read-only); the entries also go into
each resumable checkpoint, so a resumed run retrieves exactly what an uninterrupted one would.
Departures: the papers' episodic memories (e.g. MemGen, Memento) retrieve by embeddings and
may store reflections; here retrieval is lexical and the stored form is the raw trajectory.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rank_bm25 import BM25Plus

from turnforge.config import MemoryConfig
from turnforge.errors import UserError
from turnforge.paths import write_atomic
from turnforge.runs import RunDir
from turnforge.types import Trajectory

_TERM = re.compile(r"\w+|[^\w\s]")
HEADER = "Past successes on similar tasks:"

SCHEMA = pa.schema([
    ("env_id", pa.string()), ("task_id", pa.string()), ("trajectory_id", pa.string()), ("stage", pa.string()),
    ("iteration", pa.int32()), ("source", pa.string()), ("observation", pa.string()), ("actions", pa.list_(pa.string())),
])


@dataclass(frozen=True)
class MemoryEntry:
    """One past success: the task's first observation and the actions that solved it."""

    task_id: str
    trajectory_id: str
    stage: str  # the stage that played it: bc, flywheel, rl
    iteration: int  # its round or iteration
    source: str
    observation: str
    actions: tuple[str, ...]


def terms(text: str) -> list[str]:
    """BM25 terms of ``text``: each word or punctuation mark, alone and as ``line:column:term``."""
    out: list[str] = []
    for i, line in enumerate(text.splitlines()):
        for m in _TERM.finditer(line):
            out += [m.group(), f"{i}:{m.start()}:{m.group()}"]
    return out


def render(entries: Sequence[MemoryEntry]) -> str:
    """The memory block's text ("" for no entries)."""
    if not entries:
        return ""
    parts = [HEADER]
    for e in entries:
        parts.append(f"{e.observation}\nActions: {', '.join(a.strip() for a in e.actions)}")
    return "\n\n".join(parts) + "\n\nYour task:\n"


class EpisodicMemory:
    """The run's past successes and their BM25 index (rebuilt when entries change)."""

    def __init__(self, cfg: MemoryConfig, env_id: str, entries: Iterable[MemoryEntry] = (), frozen: bool = False) -> None:
        self.cfg, self.env_id, self.frozen = cfg, env_id, frozen
        self._by_task: dict[str, MemoryEntry] = {}
        for e in entries:
            self._put(e)
        self._index: BM25Plus | None = None
        self._entries: list[MemoryEntry] = []
        self.recalls = 0  # resets that got a non-empty block

    def __len__(self) -> int:
        return len(self._by_task)

    @property
    def entries(self) -> list[MemoryEntry]:
        """In the order their tasks first entered."""
        return list(self._by_task.values())

    def _put(self, e: MemoryEntry) -> bool:
        old = self._by_task.get(e.task_id)
        if old is not None and len(old.actions) <= len(e.actions):
            return False
        self._by_task[e.task_id] = e
        self._index = None
        return True

    def add(self, trajectories: Iterable[tuple[Trajectory, str]], stage: str, iteration: int) -> int:
        """Add the scored successes among ``(trajectory, source)`` pairs whose source is in
        ``memory.sources``; returns how many entries were added or shortened."""
        if self.frozen:
            return 0
        changed = 0
        for t, source in trajectories:
            if t.success and t.infra_failure is None and source in self.cfg.sources and t.turns:
                actions = tuple(x.action_text for x in t.turns if not x.invalid_action)  # the moves that did something
                changed += self._put(MemoryEntry(t.task.task_id, t.trajectory_id, stage, iteration, source,
                                                 t.turns[0].observation, actions))
        return changed

    def recall(self, observation: str) -> list[MemoryEntry]:
        """The ``memory.k`` entries most similar to ``observation`` (best first; ties: the earlier entry)."""
        if not self._by_task:
            return []
        if self._index is None:
            self._entries = self.entries
            self._index = BM25Plus([terms(e.observation) for e in self._entries])
        query = terms(observation)
        # BM25+ adds delta * idf(q) for every query term to every document, a constant: without it 0 means no term in common
        scores = self._index.get_scores(query) - self._index.delta * sum(self._index.idf.get(q, 0.0) for q in query)
        order = np.argsort(-scores, kind="stable")[: self.cfg.k]
        return [self._entries[i] for i in order if scores[i] > self.cfg.min_score]

    def block(self, observation: str) -> str:
        """The text shown before ``observation`` ("" when nothing is recalled)."""
        text = render(self.recall(observation))
        self.recalls += bool(text)
        return text

    # ------------------------------------------------------------------ persistence
    def state(self) -> list[dict]:
        """The entries as plain dicts (a resumable checkpoint's ``memory``)."""
        return [asdict(e) for e in self.entries]

    @classmethod
    def from_state(cls, cfg: MemoryConfig, env_id: str, state: Sequence[dict] | None) -> EpisodicMemory:
        """The memory ``state()`` gave (None or []: an empty one)."""
        return cls(cfg, env_id, (MemoryEntry(**{**d, "actions": tuple(d["actions"])}) for d in state or ()))

    def write(self, path: Path) -> None:
        """The entries as Parquet at ``path`` (a run's ``memory.parquet``), atomically."""
        rows = [{"env_id": self.env_id, **asdict(e), "actions": list(e.actions)} for e in self.entries]
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        write_atomic(path, sink.getvalue().to_pybytes())


def read_store(cfg: MemoryConfig, env_id: str) -> EpisodicMemory:
    """The read-only memory of ``memory.store`` (a run directory); ``UserError`` when it has no
    memory, an empty one, or one of another env."""
    path = RunDir(str(cfg.store)).memory
    if not path.is_file():
        raise UserError(f"memory.store={cfg.store}: no {path.name} there (a run with memory.enabled=true writes it); "
                        "give a run directory of this env, or leave memory.store unset to build this run's own memory")
    try:
        table = pq.read_table(path)
    except Exception as err:
        raise UserError(f"memory.store={cfg.store}: {path} is not a memory file ({type(err).__name__}: {err})") from None
    missing = [n for n in SCHEMA.names if n not in table.column_names]
    if missing:
        raise UserError(f"memory.store={cfg.store}: {path} has no column {missing[0]!r}; it is not a turnforge memory file")
    rows = table.to_pylist()
    if not rows:
        raise UserError(f"memory.store={cfg.store}: its memory is empty (that run had no success to remember); "
                        "give another run, or leave memory.store unset")
    envs = sorted({r["env_id"] for r in rows})
    if envs != [env_id]:
        raise UserError(f"memory.store={cfg.store} remembers env {', '.join(envs)}, not {env_id!r}; "
                        "give a run directory of this env")
    entries = [MemoryEntry(r["task_id"], r["trajectory_id"], r["stage"], r["iteration"], r["source"], r["observation"],
                           tuple(r["actions"])) for r in rows]
    return EpisodicMemory(cfg, env_id, entries, frozen=True)
