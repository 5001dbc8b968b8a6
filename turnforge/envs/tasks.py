"""Where an env's tasks come from: a dataset with its own split, or a generator.

A ``TaskSource`` answers three questions: task ``index`` of a split, how many distinct tasks
a split holds (``None``: unbounded), and a content key of a task (equal keys = the same task).
Train and held-out tasks never share a key.

- ``TaskDataset``: a list of task dicts (or a JSONL file, one per line). Each row's ``split``
  field ('train' or 'heldout') puts it in a split; rows without one are split by a hash of
  their content with ``heldout_fraction``. Task ``index`` of a split is row ``index % n`` of
  that split, so callers may draw indices from any range (RL draws random ones).
- ``TaskGenerator``: ``make(rng) -> dict`` draws a task's fields; task ``index`` of a split is
  the first draw (from seeds derived from the split and index) whose content hash falls in
  the split, as ``LevelEnv`` does for levels.

``LevelEnv`` brings its own source (``LevelTasks``): levels generated from the task's split
and index inside the env, ``task.data`` left ``None``.
"""

from __future__ import annotations

import json
import random
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from turnforge.errors import UserError
from turnforge.seeding import stable_hash
from turnforge.types import SPLITS, Task


def content_key(data: Mapping[str, Any]) -> str:
    """Canonical JSON of a task's fields, without its ``split`` label."""
    return json.dumps({k: v for k, v in data.items() if k != "split"}, sort_keys=True, default=str)


def _bucket(key: str, heldout_fraction: float) -> str:
    return "heldout" if stable_hash("split", key) % 10_000 < heldout_fraction * 10_000 else "train"


class TaskSource(ABC):
    """Tasks of one env (see the module docstring). ``task`` leaves ``env_id`` empty;
    ``Env.task`` fills it in."""

    @abstractmethod
    def task(self, split: str, index: int) -> Task:
        """Task ``index`` of ``split``."""

    @abstractmethod
    def size(self, split: str) -> int | None:
        """Distinct tasks of ``split``; ``None`` when unbounded (generated)."""

    @abstractmethod
    def key(self, task: Task) -> str:
        """Content key of ``task``: equal keys mean the same task."""


class TaskDataset(TaskSource):
    """Tasks from a list of dicts with their own train/held-out split (see the module docstring)."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], *, heldout_fraction: float | None = None,
                 name: str = "task list") -> None:
        if heldout_fraction is not None and not 0.0 <= heldout_fraction <= 1.0:
            raise UserError(f"{name}: heldout_fraction must be in [0, 1]; got {heldout_fraction}")
        self.name = name
        self.rows: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
        seen: dict[str, str] = {}
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise UserError(f"{name}: task {i} is a {type(row).__name__}; each task must be a JSON object")
            split = row.get("split")
            if split is None:
                if heldout_fraction is None:
                    raise UserError(
                        f"{name}: task {i} has no 'split'; give every task a 'split' of 'train' or 'heldout', "
                        "or a heldout_fraction to split the rest by content"
                    )
                split = _bucket(content_key(row), heldout_fraction)
            if split not in SPLITS:
                raise UserError(f"{name}: task {i} has split {split!r}; valid splits: 'heldout', 'train'")
            key = content_key(row)
            if seen.get(key, split) != split:
                raise UserError(f"{name}: task {i} appears in both splits ({key[:80]}); a held-out task must not be trained on")
            seen[key] = split
            self.rows[split].append(dict(row))

    @classmethod
    def from_jsonl(cls, path: str | Path, *, heldout_fraction: float | None = None) -> "TaskDataset":
        """Read one task dict per line (blank lines skipped); errors name the file and line."""
        p = Path(path)
        if not p.is_file():
            raise UserError(f"task file {str(path)!r} does not exist")
        rows = []
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise UserError(f"task file {str(path)!r}, line {n}: not JSON ({err.msg})") from None
        return cls(rows, heldout_fraction=heldout_fraction, name=f"task file {str(path)!r}")

    def task(self, split: str, index: int) -> Task:
        rows = self.rows[split]
        if not rows:
            raise UserError(f"{self.name} has no {split} tasks")
        i = index % len(rows)
        return Task("", split, i, rows[i])  # type: ignore[arg-type]

    def size(self, split: str) -> int:
        return len(self.rows[split])

    def key(self, task: Task) -> str:
        return content_key(task.data or {})


class TaskGenerator(TaskSource):
    """Tasks drawn by ``make(rng)`` (a dict of JSON-able fields), split by content hash."""

    def __init__(self, make: Callable[[random.Random], Mapping[str, Any]], *, heldout_fraction: float = 0.1,
                 cache_size: int = 4096) -> None:
        if not 0.0 < heldout_fraction < 1.0:
            raise UserError(f"TaskGenerator: heldout_fraction must be in (0, 1); got {heldout_fraction}")
        self.make, self.heldout_fraction, self.cache_size = make, heldout_fraction, cache_size
        self._cache: dict[tuple[str, int], dict[str, Any]] = {}

    def task(self, split: str, index: int) -> Task:
        key = (split, index)
        if key not in self._cache:
            for attempt in range(10_000):
                data = dict(self.make(random.Random(stable_hash("task", split, index, attempt))))
                if _bucket(content_key(data), self.heldout_fraction) == split:
                    break
            else:
                raise UserError(f"TaskGenerator: no {split} task after 10000 draws; the generator draws too few distinct tasks")
            if len(self._cache) >= self.cache_size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = data
        return Task("", split, index, self._cache[key])  # type: ignore[arg-type]

    def size(self, split: str) -> None:
        return None

    def key(self, task: Task) -> str:
        return content_key(task.data or {})
