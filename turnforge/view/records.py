"""The typed records ``turnforge view`` passes between its parts (``data``, ``page``,
``server``) and, as JSON (``to_jsonable``), to the page's script."""

from __future__ import annotations

import decimal
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from turnforge.errors import UserError, choices

#: Values of the outcome filter.
OUTCOMES: tuple[str, ...] = ("success", "failure", "infra", "truncated")
#: Orders of the group list: run order, widest reward spread, best reward first, worst reward first.
SORTS: tuple[str, ...] = ("run", "spread", "best", "worst")


@dataclass(frozen=True)
class SkippedFile:
    """A trajectory file of a live run left out: it is still being written."""

    name: str
    why: str


@dataclass(frozen=True)
class RunFiles:
    """What of a run directory the viewer reads."""

    path: Path
    live: bool  # a process holds RUN/.lock: the run is being written
    parquet: tuple[Path, ...]  # the complete trajectory files, by name
    skipped: tuple[SkippedFile, ...] = ()


@dataclass(frozen=True)
class Table:
    """Rows with named columns: a query's result, or the records of one kind of
    ``metrics.jsonl`` event (``read_series``)."""

    columns: list[str]
    rows: list[list[Any]]

    @classmethod
    def of(cls, table: pa.Table) -> "Table":
        cols = [[json_value(v) for v in c.to_pylist()] for c in table.columns]
        return cls(list(table.column_names), [list(r) for r in zip(*cols)])


@dataclass(frozen=True)
class Totals:
    """Counts over the whole run (the files read)."""

    episodes: int
    scored: int  # episodes less infrastructure failures
    successes: int
    infra_failures: int
    truncated: int
    samples: int  # training samples (rows with tokens)
    rows: int  # samples plus the episode rows of episodes without samples
    tokens: int
    groups: int
    tasks: int


@dataclass(frozen=True)
class StageStats:
    """One stage: outcomes, failures (the first line of each error text with its numbers as N,
    most frequent first) and truncations by reason."""

    stage: str
    episodes: int
    samples: int
    scored: int
    successes: int
    success_rate: float | None
    mean_reward: float | None
    infra_failures: int
    truncated: int
    truncations: dict[str, int]
    failures: list[tuple[str, int]]
    iterations: list[int]


@dataclass(frozen=True)
class Overview:
    """Everything the overview shows for one run."""

    index: int  # the run's place on the command line (0 = RUN, 1 = RUN2)
    name: str
    path: str
    status: str  # 'finished' (summary.json), 'running' (lock held), 'stopped' (neither)
    config: dict[str, Any]
    config_text: str
    summary: dict[str, Any] | None
    tokenizer: str | None  # the directory the token pieces come from; None: ids only
    files: list[str]
    skipped: list[SkippedFile]
    totals: Totals
    stages: list[StageStats]
    rounds: Table  # the store's success_by_round
    sources: Table  # the store's success_by_source
    series: dict[str, Table]  # metrics.jsonl by event kind, as the page draws them (page_series)
    metrics_notes: list[str]  # metrics.jsonl lines left out (a line being written)
    warnings: list[str]
    bc_temperatures: list[dict[str, Any]]  # summary.json: the BC policy at each temperature
    gateway_splits: int
    facets: dict[str, list[Any]]  # filter values: stages, sources, envs, iterations per stage


@dataclass(frozen=True)
class BrowseQuery:
    """Filters, order and page of the group list; ``from_params`` reads them from a URL query."""

    stage: str | None = None
    iteration: int | None = None
    source: str | None = None
    env: str | None = None
    task: str | None = None  # a substring of the task id
    task_id: str | None = None  # one task exactly
    outcome: str | None = None  # one of OUTCOMES
    reward_min: float | None = None
    reward_max: float | None = None
    sort: str = "run"  # one of SORTS
    offset: int = 0
    limit: int = 50

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> "BrowseQuery":
        """Read the filters from URL parameters (empty = unset); ``UserError`` naming a bad one."""
        kinds = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, text in params.items():
            if key == "run" or text == "":
                continue
            if key not in kinds:
                raise UserError(f"unknown filter {key!r}; valid filters: {choices(kinds)}")
            kind = str(kinds[key])
            try:
                values[key] = int(text) if "int" in kind else float(text) if "float" in kind else text
            except ValueError:
                raise UserError(f"filter {key}={text!r} is not a number") from None
        q = cls(**values)
        if q.outcome is not None and q.outcome not in OUTCOMES:
            raise UserError(f"unknown outcome {q.outcome!r}; valid outcomes: {choices(OUTCOMES)}")
        if q.sort not in SORTS:
            raise UserError(f"unknown sort {q.sort!r}; valid sorts: {choices(SORTS)}")
        if q.offset < 0 or not 1 <= q.limit <= 1000:
            raise UserError("offset must be >= 0 and limit from 1 to 1000")
        return q

    def where(self) -> tuple[str, list[Any]]:
        """The SQL condition on ``episodes`` and its parameters."""
        clauses, params = ["TRUE"], []
        for name in ("stage", "iteration", "source", "env", "task_id"):
            if getattr(self, name) is not None:
                clauses.append(f"{name} = ?")
                params.append(getattr(self, name))
        if self.task:
            clauses.append("contains(task_id, ?)")
            params.append(self.task)
        if self.outcome is not None:
            clauses.append({"success": "success", "failure": "infra_failure IS NULL AND NOT success",
                            "infra": "infra_failure IS NOT NULL", "truncated": "truncation_reason IS NOT NULL"}[self.outcome])
        if self.reward_min is not None:
            clauses.append("reward >= ?")
            params.append(self.reward_min)
        if self.reward_max is not None:
            clauses.append("reward <= ?")
            params.append(self.reward_max)
        return " AND ".join(clauses), params


@dataclass(frozen=True)
class GroupPage:
    """A page of the group list: ``total_groups`` groups hold the ``total_episodes`` episodes
    that pass the filters; ``rows`` are groups ``offset`` to ``offset + limit``."""

    total_groups: int
    total_episodes: int
    offset: int
    rows: Table


@dataclass(frozen=True)
class SampleTokens:
    """One training sample, token-exact: what the trainer saw."""

    turn_index: int  # -1: the sample spans the whole episode (full-history context)
    action_text: str | None
    turn_reward: float | None
    advantage: float | None
    ids: list[int]
    logprobs: list[float | None]  # null where no policy sampled the token
    mask: list[int]  # 1 = trained on (action token)
    versions: list[int]  # policy version that sampled the token, -1 where none did
    segment_index: int = 0  # rollout.context=summarize (and agents' restarted conversations): the context's order
    parent_segment: int = -1
    first_turn: int = 0
    summary_tokens: int = 0  # trailing tokens that are the summary that ended the segment
    memory_start: int = 0  # episodic memory: ids[memory_start : memory_start + memory_tokens] is the recalled block
    memory_tokens: int = 0
    images: list[str] = field(default_factory=list)  # sha256 of the images its ids hold (vision policies), in order


@dataclass(frozen=True)
class TrajectoryDetail:
    """One episode with its samples, judge verdict and the gateway's splits."""

    episode: dict[str, Any]  # its row of ``episodes`` (EPISODE_COLUMNS)
    judge_prompt: str | None
    judge_output: str | None
    turn_advantages: list[float] | None
    env_seed: int | None
    samples: list[SampleTokens]
    splits: list[dict[str, Any]]  # RUN/gateway_splits.jsonl lines of this rollout


@dataclass(frozen=True)
class Detail:
    """Trajectories with the bytes of every token id they use (``TokenPieces.table``)."""

    trajectories: list[TrajectoryDetail]
    pieces: dict[str, str]
    special: list[int]


@dataclass(frozen=True)
class TokenArrays:
    """Every sample of a run in episode order, their per-token arrays concatenated
    (sample ``i`` is ``ids[start[i]:start[i] + length[i]]``)."""

    episode: np.ndarray  # [S] int32, the sample's episode (its ``ord``)
    turn_index: np.ndarray  # [S] int32
    action_text: list[str | None]  # [S]
    turn_reward: list[float | None]  # [S]
    advantage: list[float | None]  # [S]
    start: np.ndarray  # [S] int64
    length: np.ndarray  # [S] int32
    ids: np.ndarray  # [N] int32
    logprobs: np.ndarray  # [N] float32, NaN where no policy sampled the token
    mask: np.ndarray  # [N] int8
    versions: np.ndarray  # [N] int32
    segment_index: np.ndarray  # [S] int32 (0 where the run has no segments)
    parent_segment: np.ndarray  # [S] int32
    first_turn: np.ndarray  # [S] int32
    summary_tokens: np.ndarray  # [S] int32
    memory_start: np.ndarray  # [S] int32
    memory_tokens: np.ndarray  # [S] int32 (0 where no memory was shown)
    images: list[list[str]]  # [S] sha256 of each sample's images (vision policies; [] for text)


def json_value(value: Any, digits: int = 7) -> Any:
    """A value for JSON: floats to ``digits`` significant digits (float32 columns read back
    as the decimal they were written from), NaN and infinities as null."""
    if isinstance(value, decimal.Decimal):  # DuckDB's sums of integers
        value = int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.{digits}g}") if digits >= 1 else value
    return value


def to_jsonable(record: Any) -> Any:
    """A record of this module (nested dataclasses, tuples) as plain JSON data."""
    if hasattr(record, "__dataclass_fields__"):
        return {f.name: to_jsonable(getattr(record, f.name)) for f in fields(record)}
    if isinstance(record, dict):
        return {str(k): to_jsonable(v) for k, v in record.items()}
    if isinstance(record, (list, tuple)):
        return [to_jsonable(v) for v in record]
    if isinstance(record, Path):
        return str(record)
    if isinstance(record, np.generic):
        return json_value(record.item())
    return json_value(record)
