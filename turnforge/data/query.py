"""Query a run's trajectories with SQL: every ``RUN/trajectories/*.parquet`` as one dataset.

``TrajectoryStore(run_dir)`` opens an in-memory DuckDB connection (nothing is written into the
run directory) over all the run's trajectory files (``bc_demos``, ``rl_*``, ``flywheel_*``, ...)
read together with ``union_by_name``, so files written before a column existed still read: the
missing column is null, and a null ``source`` reads as ``default_source(stage)`` (``demo`` for
stage ``bc``, else ``plain``). Views:

- ``samples``: every row of the files (one per training sample, one episode row for each episode
  without samples; see ``turnforge.data.store``), columns in ``SCHEMA`` order;
- ``trajectories``: one row per episode (``stage, iteration, source, trajectory_id, task_id,
  group_id, env_seed, reward, success, num_turns, truncation_reason, infra_failure``) with
  ``n_samples``, ``n_tokens`` and ``n_action_tokens`` summed over its samples;
- ``success_by_task``, ``success_by_round`` (by ``stage`` and ``iteration``), ``success_by_source``:
  ``episodes``, ``scored`` (episodes less infrastructure failures), ``successes``,
  ``success_rate`` (successes / scored, null when nothing was scored), ``mean_reward`` (over the
  scored episodes) and ``infra_failures``. ``success_by_task`` counts every stage and source
  together (demonstrations included); filter ``trajectories`` for one of them.

``TrajectoryStore.sql`` returns a ``pyarrow.Table``; an error in the SQL is a ``UserError``
with DuckDB's first line and the view names. ``turnforge data RUN SQL`` is the command line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from turnforge.data.store import SCHEMA
from turnforge.errors import UserError
from turnforge.runs import RunDir

#: The views every store has, in the order they are made.
VIEWS: tuple[str, ...] = ("samples", "trajectories", "success_by_task", "success_by_round", "success_by_source")

#: What ``write_result`` writes, by suffix of the output file.
OUT_SUFFIXES: tuple[str, ...] = (".parquet", ".csv")

_DUCK_TYPES = {pa.string(): "VARCHAR", pa.int8(): "TINYINT", pa.int32(): "INTEGER", pa.int64(): "BIGINT",
               pa.float32(): "FLOAT", pa.bool_(): "BOOLEAN"}

_TRAJECTORIES = """
CREATE VIEW trajectories AS
SELECT stage, iteration, source, trajectory_id, task_id, group_id, env_seed, reward, success, num_turns,
       truncation_reason, infra_failure,
       count(token_ids) AS n_samples,                                     -- episode rows have no tokens
       coalesce(sum(len(token_ids)), 0)::BIGINT AS n_tokens,
       coalesce(sum(list_sum(loss_mask)), 0)::BIGINT AS n_action_tokens
FROM samples
GROUP BY ALL                                                              -- episode columns repeat on every row
ORDER BY stage, iteration, trajectory_id
"""

_SUCCESS = """
CREATE VIEW {name} AS
SELECT {keys},
       count(*) AS episodes,
       count(*) FILTER (WHERE infra_failure IS NULL) AS scored,
       count(*) FILTER (WHERE infra_failure IS NULL AND success) AS successes,
       (count(*) FILTER (WHERE infra_failure IS NULL AND success))::DOUBLE
           / nullif(count(*) FILTER (WHERE infra_failure IS NULL), 0) AS success_rate,
       avg(reward) FILTER (WHERE infra_failure IS NULL) AS mean_reward,
       count(*) FILTER (WHERE infra_failure IS NOT NULL) AS infra_failures
FROM trajectories
GROUP BY {keys}
ORDER BY {keys}
"""


def trajectory_files(path: str | Path) -> list[Path]:
    """The Parquet files of a store: ``path/trajectories/*.parquet`` for a run directory, else
    ``path/*.parquet`` (or ``path`` itself, a Parquet file); sorted by name. Raises ``UserError``
    when there are none."""
    path = Path(path)
    if path.is_file() and path.suffix == ".parquet":
        return [path]
    in_run = RunDir(path).trajectories
    folder = in_run if in_run.is_dir() else path
    files = sorted(p for p in folder.glob("*.parquet") if p.is_file()) if folder.is_dir() else []
    if not files:
        why = "it does not exist" if not path.exists() else "expected RUN/trajectories/*.parquet or DIR/*.parquet"
        raise UserError(f"empty store: no trajectory files under {str(path)!r} ({why})")
    return files


class TrajectoryStore:
    """All the trajectory files of a run (or of a directory of Parquet files) as DuckDB views
    (see the module docstring); ``sql(query)`` runs a query over them. The files are those there
    when the store opens (``files``), or the non-empty list ``files`` given (``turnforge view``
    leaves out files still being written); a file written later needs a new store. Use as a
    context manager or call ``close()``."""

    def __init__(self, path: str | Path, files: Sequence[Path] | None = None) -> None:
        self.path = Path(path)
        self.files = trajectory_files(self.path) if files is None else list(files)
        if not self.files:
            raise ValueError("TrajectoryStore(files=...) needs at least one file")
        self._con: duckdb.DuckDBPyConnection | None = duckdb.connect(":memory:")
        try:
            self._con.sql(f"CREATE VIEW samples AS {self.samples_of(self.files)}")
            self._con.sql(_TRAJECTORIES)
            for name, keys in (("success_by_task", "task_id"), ("success_by_round", "stage, iteration"),
                               ("success_by_source", "source")):
                self._con.sql(_SUCCESS.format(name=name, keys=keys))
        except duckdb.Error as err:  # a damaged or foreign file: DuckDB's message names it
            self.close()
            raise UserError(f"cannot read the trajectory files under {str(self.path)!r}: {_first_line(err)}") from None

    def sql(self, query: str, params: Sequence[object] | None = None) -> pa.Table:
        """Run ``query`` (DuckDB SQL over the views, ``?`` placeholders bound to ``params``) and
        return its rows (a statement such as ``CREATE VIEW`` gives DuckDB's empty result). A
        DuckDB error is a ``UserError`` with its first line and the view names."""
        con = self._open()
        try:
            rel = con.sql(query, params=list(params)) if params else con.sql(query)
            return pa.table({}) if rel is None else rel.to_arrow_table()
        except duckdb.Error as err:
            raise UserError(f"query failed: {_first_line(err)} (views: {', '.join(self.views())})") from None

    def samples_of(self, files: Sequence[Path], row_order: bool = False) -> str:
        """A query with the rows and columns of ``samples`` over ``files`` only (some of the
        store's files): a query about one stage's iteration need not open every file. With
        ``row_order``, two more columns, ``filename`` and ``file_row_number``, give the order the
        rows were written in (samples of one turn, e.g. an agent's calls, in call order)."""
        more = ", filename = true, file_row_number = true" if row_order else ""
        scan = "read_parquet([{}], union_by_name = true{})".format(", ".join(_literal(str(f)) for f in files), more)
        present = [row[0] for row in self._open().sql(f"DESCRIBE SELECT * FROM {scan}").fetchall()]
        return f"SELECT {_sample_columns(present)} FROM {scan}"

    def views(self) -> list[str]:
        """The views this store's queries can read, in the order they were made (the ones a
        query created included)."""
        rows = self._open().sql("SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY view_oid").fetchall()
        return [name for (name,) in rows]

    def close(self) -> None:
        """Close the DuckDB connection (the files are only read; nothing to write back)."""
        if self._con is not None:
            self._con.close()
            self._con = None

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            raise RuntimeError(f"the trajectory store of {str(self.path)!r} is closed")
        return self._con


def check_out_suffix(path: Path, label: str = "output file") -> None:
    """Raise ``UserError`` unless ``path`` ends in one of ``OUT_SUFFIXES`` (any case)."""
    if path.suffix.lower() not in OUT_SUFFIXES:
        what = f"suffix {path.suffix!r}" if path.suffix else "no suffix"
        raise UserError(f"{label} {str(path)!r} has {what}; valid suffixes: " + ", ".join(repr(s) for s in OUT_SUFFIXES))


def write_result(table: pa.Table, path: Path) -> None:
    """Write ``table`` to ``path`` as Parquet or CSV (by its suffix, one of ``OUT_SUFFIXES``),
    through a temporary file and a rename: never half a file. CSV writes a list as ``[1, 2]``
    and null as an empty field."""
    check_out_suffix(path)
    suffix = path.suffix.lower()
    target = path.resolve()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        if suffix == ".parquet":
            pq.write_table(table, tmp)
        else:  # DuckDB writes list columns (pyarrow's CSV writer refuses them)
            with duckdb.connect(":memory:") as con:
                con.from_arrow(table).write_csv(str(tmp), header=True)
        os.replace(tmp, target)
    except duckdb.Error as err:
        raise UserError(f"cannot write {str(path)!r}: {_first_line(err)}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _sample_columns(present: list[str]) -> str:
    """The select list of ``samples``: SCHEMA's columns in order (null where no file has one,
    the derived source), then any column the files have that SCHEMA does not."""
    items = []
    for field in SCHEMA:
        if field.name == "source":  # default_source(stage) of turnforge.data.store, in SQL
            given = "source" if "source" in present else "CAST(NULL AS VARCHAR)"
            items.append(f"coalesce({given}, CASE WHEN stage = 'bc' THEN 'demo' ELSE 'plain' END) AS source")
        elif field.name in present:
            items.append(_ident(field.name))
        else:
            items.append(f"CAST(NULL AS {_duck_type(field.type)}) AS {_ident(field.name)}")
    items += [_ident(name) for name in present if name not in SCHEMA.names]
    return ", ".join(items)


def _duck_type(t: pa.DataType) -> str:
    return _duck_type(t.value_type) + "[]" if pa.types.is_list(t) else _DUCK_TYPES[t]


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _first_line(err: Exception) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
