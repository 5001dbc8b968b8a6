"""The files of a run directory as ``turnforge view`` reads them: which trajectory files are
complete (``locate_run``; a live run's file being written is skipped), whether a run is live
(``run_is_live``), its config, summary and ``metrics.jsonl`` records (``read_series``), and
those records as the page draws them (``page_series``)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from turnforge.errors import UserError
from turnforge.runs import RunDir
from turnforge.view.records import RunFiles, SkippedFile, Table, json_value

#: Columns a file must have to be read as a trajectory file.
REQUIRED_COLUMNS: tuple[str, ...] = ("stage", "iteration", "trajectory_id", "task_id", "group_id", "token_ids")


def run_is_live(run_dir: Path) -> bool:
    """True while another process holds the run's lock (``RUN/.lock``, a POSIX record lock
    held for the whole life of a run). Asks the kernel with ``F_GETLK``, which takes no lock,
    so a run starting meanwhile is never refused because of the viewer."""
    try:
        fd = os.open(RunDir(run_dir).lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        flock = struct.pack("hhllhh", fcntl.F_WRLCK, 0, 0, 0, 0, 0)  # l_type, l_whence, l_start, l_len (0: all), l_pid
        return struct.unpack("hhllhh", fcntl.fcntl(fd, fcntl.F_GETLK, flock))[0] != fcntl.F_UNLCK
    finally:
        os.close(fd)


def _unreadable(path: Path) -> str | None:
    """Why ``path`` cannot be read as a trajectory file (its footer and columns), or None."""
    try:
        names = set(pq.read_schema(path).names)
    except (OSError, pa.ArrowException) as err:
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    return f"not a trajectory file (no column {missing[0]!r})" if missing else None


def stage_iterations(path: Path) -> set[tuple[str, int]] | None:
    """The (stage, iteration) pairs of a trajectory file from its footer's statistics (the
    store writes one pair per file); None when a row group has no statistics or spans several."""
    meta = pq.read_metadata(path)
    names = [meta.schema.column(i).path for i in range(meta.num_columns)]
    if "stage" not in names or "iteration" not in names:
        return None
    keys = set()
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        if group.num_rows == 0:
            continue
        stats = [group.column(names.index(c)).statistics for c in ("stage", "iteration")]
        if any(st is None or not st.has_min_max or st.min != st.max for st in stats):
            return None
        stage = stats[0].min.decode() if isinstance(stats[0].min, bytes) else stats[0].min
        keys.add((stage, int(stats[1].min)))
    return keys


def locate_run(path: str | Path) -> RunFiles:
    """Check that ``path`` is a run directory with trajectories and pick its readable files.
    ``UserError`` (one line) for a missing path, a file, a directory that is no run, a run
    with no trajectory file yet, and a corrupt file in a run that is not running."""
    path = Path(path)
    run = RunDir(path)
    hint = "give the directory `turnforge train --out` wrote"
    if not path.exists():
        raise UserError(f"run directory {str(path)!r} does not exist; {hint}")
    if not path.is_dir():
        raise UserError(f"{str(path)!r} is a file, not a run directory; {hint}")
    if not run.config.is_file() and not run.trajectories.is_dir():
        raise UserError(f"{str(path)!r} is not a run directory (no config.yaml, no trajectories/); {hint}")
    live = run_is_live(path)
    good: list[Path] = []
    skipped: list[SkippedFile] = []
    folder = run.trajectories
    for f in sorted(folder.glob("*.parquet")) if folder.is_dir() else []:
        why = _unreadable(f)
        if why is None:
            good.append(f)
        elif live:
            skipped.append(SkippedFile(f.name, f"being written ({why})"))
        else:
            raise UserError(f"corrupt trajectory file {str(f)!r}: {why}; move it out of trajectories/ to view the rest")
    if not good:
        when = "; the run is in progress: view it once its first stage has written one" if live else ""
        raise UserError(f"run directory {str(path)!r} has no trajectories yet (no complete trajectories/*.parquet){when}")
    return RunFiles(path, live, tuple(good), tuple(skipped))


def read_config(run_dir: Path) -> tuple[str, dict[str, Any]]:
    """The run's ``config.yaml``: its text and its data (``""`` and ``{}`` when there is none or it
    does not parse as a mapping)."""
    path = RunDir(run_dir).config
    if not path.is_file():
        return "", {}
    text = path.read_text(errors="replace")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    return text, data if isinstance(data, dict) else {}


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_series(path: Path, live: bool = False) -> tuple[dict[str, Table], list[str]]:
    """``metrics.jsonl`` as one ``Table`` per event kind, with notes on the lines left out:
    nested fields flattened to dotted names (``update.entropy``, ``result.success_rate``), a
    pair as ``.0``/``.1``, null where a record lacks a column.

    Read as JSON, not through ``turnforge.train.metrics.read_metrics``: the page plots every
    numeric field a record has, including those of runs written by another turnforge version
    (``read_metrics`` refuses a field its classes lack), and a live run's last line may be
    half written."""
    records: dict[str, list[dict[str, Any]]] = {}
    notes: list[str] = []
    if not path.is_file():
        return {}, notes
    lines = path.read_text(errors="replace").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            kind = data.pop("event")
        except (ValueError, KeyError, AttributeError):
            notes.append(f"metrics.jsonl line {n} left out: " + ("being written" if live and n == len(lines) else "not a JSON event"))
            continue
        flat: dict[str, Any] = {}
        _flatten(data, "", flat)
        records.setdefault(str(kind), []).append(flat)
    series = {}
    for kind, recs in records.items():
        columns = list(dict.fromkeys(k for r in recs for k in r))
        series[kind] = Table(columns, [[r.get(c) for c in columns] for r in recs])
    return series, notes


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    """Scalars of nested JSON under dotted names; a list of scalars as name.0, name.1, ...;
    lists of objects are left out."""
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}{k}.", out)
    elif isinstance(value, list):
        if all(not isinstance(v, (dict, list)) for v in value):
            for i, v in enumerate(value):
                out[f"{prefix}{i}"] = json_value(v)
    else:
        out[prefix[:-1]] = json_value(value)


#: metrics.jsonl's records that count the iterations or rounds done, and the column that counts
#: them: ``rl_iter`` N is about the store's RL iteration N - 1, ``flywheel_round`` R about its
#: flywheel round R - 1 (``turnforge.train.rl``, ``turnforge.train.flywheel``).
COUNTED: dict[str, str] = {"rl_iter": "iteration", "flywheel_round": "round"}
#: Tags of ``eval`` records written after an iteration or round, N counting them as ``COUNTED`` does.
_COUNTED_TAG = re.compile(r"^(rl|flywheel)-(\d+)$")


def page_series(series: dict[str, Table], config: dict[str, Any]) -> dict[str, Table]:
    """The records of ``read_series`` as the page draws them. One numbering everywhere, the
    store's (from 0): ``COUNTED``'s columns less one. ``eval`` records get the columns that
    tell their series apart (``eval_series``)."""
    out = dict(series)
    for kind, column in COUNTED.items():
        if kind in out and column in out[kind].columns:
            j = out[kind].columns.index(column)
            out[kind] = Table(out[kind].columns, [[v - 1 if k == j and isinstance(v, int) else v for k, v in enumerate(row)]
                                                  for row in out[kind].rows])
    if "eval" in out:
        out["eval"] = eval_series(out["eval"], config)
    return out


def eval_series(table: Table, config: dict[str, Any]) -> Table:
    """``eval`` records with the columns the page groups them by, one series per sampling
    temperature and size (never a line through evaluations of different ones):

    - ``temperature``: the record's own; runs written before records kept it: ``evaluate_start``
      plays the records tagged ``bc`` at the config's ``eval.bc_temperatures`` other than
      ``eval.temperature``, in order, and every other evaluation at ``eval.temperature``;
    - ``size``: episodes asked (``result.episodes`` counts the scored ones; infrastructure
      failures are the rest);
    - ``series``: their label; ``main``: true for the run's evaluations (``eval.temperature``,
      ``eval.episodes``; every one where the config does not say), against which the others (BC
      at other temperatures, the flywheel's ``flywheel.eval_episodes``) are drawn as series of
      their own;
    - ``point``: the tag, a round or iteration numbered as the store numbers it
      (``flywheel-2`` -> ``flywheel round 1``)."""
    ev = config.get("eval") if isinstance(config.get("eval"), dict) else {}
    temperature, size = ev.get("temperature"), ev.get("episodes")
    others = iter([t for t in ev.get("bc_temperatures") or [] if t != temperature])
    col = {c: j for j, c in enumerate(table.columns)}
    get = lambda row, name: row[col[name]] if name in col else None  # noqa: E731
    rows = []
    for row in table.rows:
        tag, scored = get(row, "tag"), get(row, "result.episodes")
        inferred = next(others, None) if tag == "bc" else temperature
        temp = get(row, "temperature") if get(row, "temperature") is not None else inferred
        n = scored + (get(row, "result.infra_failures") or 0) if isinstance(scored, int) else None
        label = ", ".join(x for x in ("" if temp is None else f"T={temp:g}", "" if n is None else f"{n} episodes") if x)
        counted = _COUNTED_TAG.match(tag) if isinstance(tag, str) else None
        point = f"{'RL iteration' if counted[1] == 'rl' else 'flywheel round'} {int(counted[2]) - 1}" if counted else tag
        rows.append((row, [temp, n, label or "evaluations", temp == temperature and size in (None, n), point]))
    kept = [c for c in table.columns if c != "temperature"]
    return Table([*kept, "temperature", "size", "series", "main", "point"],
                 [[v for c, v in zip(table.columns, row) if c != "temperature"] + extra for row, extra in rows])
