"""The queryable trajectory store: the ``source`` column of ``write_trajectories``, the views of
``TrajectoryStore`` against hand-counted episodes, files without ``source``, errors as one-line
``UserError``s, and ``turnforge data`` on the command line (table, --out, bad input: exit 2)."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from turnforge.data.query import VIEWS, TrajectoryStore
from turnforge.data.store import SCHEMA, read_trajectories, write_trajectories
from turnforge.errors import UserError
from turnforge.types import Sample, Task, Trajectory, Turn

UNWRITABLE = "/sys"  # EACCES for every user, root included


def traj(tid: str, task: int, reward: float, success: bool, *, samples: int = 1, failure: str | None = None) -> Trajectory:
    """An episode on sokoban train task ``task``; each sample is 3 tokens, 2 of them actions."""
    sample = Sample(token_ids=np.array([5, 6, 7]), loss_mask=np.array([0, 1, 1], np.int8),
                    logprobs=np.array([np.nan, -0.5, -0.25], np.float32), versions=np.array([-1, 0, 0], np.int32),
                    trajectory_id=tid, turn_index=0)
    return Trajectory(
        trajectory_id=tid, task=Task("sokoban", "train", task), group_id=f"g{task}", env_seed=task,
        turns=tuple(Turn("obs", "up", reward, False, "") for _ in range(max(samples, 1))),
        samples=tuple(sample for _ in range(samples)), episode_return=reward, success=success,
        terminated=True, truncated=False, truncation_reason=None, policy_version=0, infra_failure=failure,
    )


def T(i: int) -> str:
    return f"sokoban:train:{i}"


@pytest.fixture
def run(tmp_path) -> Path:
    """A run directory with three files:

    - bc_demos (stage bc, no sources given: 'demo'): d0 on task 0, d1 on task 1, both won (reward 1);
    - rl_00000 (stage rl, iteration 0, no sources: 'plain'): r0 won on task 0 (reward 1, 2 samples),
      r1 lost on task 1 (-0.5), r2 an infrastructure failure on task 2 (failed reset: no samples);
    - flywheel_00001 (iteration 1): f0 'guided' won on task 1 (1), f1 'guided' lost on task 1 (0),
      f2 'curriculum' won on task 1 (0.5).
    """
    out = tmp_path / "run" / "trajectories"
    write_trajectories(out / "bc_demos.parquet", [traj("d0", 0, 1.0, True), traj("d1", 1, 1.0, True)], stage="bc", iteration=0)
    write_trajectories(out / "rl_00000.parquet", [
        traj("r0", 0, 1.0, True, samples=2), traj("r1", 1, -0.5, False),
        traj("r2", 2, 0.0, False, samples=0, failure="env reset() raised: boom"),
    ], stage="rl", iteration=0)
    write_trajectories(out / "flywheel_00001.parquet", [
        traj("f0", 1, 1.0, True), traj("f1", 1, 0.0, False), traj("f2", 1, 0.5, True),
    ], stage="flywheel", iteration=1, sources={"f0": "guided", "f1": "guided", "f2": "curriculum"})
    return tmp_path / "run"


def snapshot(*dirs: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for d in dirs for p in sorted(d.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------- write_trajectories: source
def test_source_column_defaults_by_stage_and_takes_one_value_or_a_mapping(tmp_path):
    assert SCHEMA.names[:3] == ["stage", "source", "iteration"]
    cases = [("bc", None, ["demo", "demo"]), ("rl", None, ["plain", "plain"]), ("rl", "retry", ["retry", "retry"]),
             ("flywheel", {"a": "evolved", "b": "guided"}, ["evolved", "guided"])]
    for stage, sources, expected in cases:
        path = tmp_path / f"{stage}-{len(str(sources))}.parquet"
        write_trajectories(path, [traj("a", 0, 1.0, True), traj("b", 1, 0.0, False)], stage=stage, iteration=0, sources=sources)
        assert pq.read_table(path).column("source").to_pylist() == expected


def test_bad_sources_raise_before_anything_is_written(tmp_path):
    path = tmp_path / "x.parquet"
    with pytest.raises(ValueError, match=r"source 'Expert!' of trajectory 'a' is not a name"):
        write_trajectories(path, [traj("a", 0, 1.0, True)], stage="bc", iteration=0, sources="Expert!")
    with pytest.raises(ValueError, match=r"sources has no entry for trajectory 'b' \(1 missing\)"):
        write_trajectories(path, [traj("a", 0, 1.0, True), traj("b", 0, 1.0, True)], stage="rl", iteration=0,
                           sources={"a": "guided"})
    assert not path.exists()


def old_format(path: Path) -> None:
    """Rewrite ``path`` as a file written before the ``source`` column existed."""
    table = pq.read_table(path)
    pq.write_table(table.drop_columns(["source"]), path)


def test_read_trajectories_gives_an_old_file_a_null_source(tmp_path):
    path = tmp_path / "rl_00000.parquet"
    write_trajectories(path, [traj("a", 0, 1.0, True)], stage="rl", iteration=0)
    old_format(path)
    assert read_trajectories(path).column("source").to_pylist() == [None]


# ---------------------------------------------------------------------- the views, by hand
def test_views_count_episodes_by_hand(run):
    before = snapshot(run)
    with TrajectoryStore(run) as store:
        assert store.views() == list(VIEWS)
        assert [f.name for f in store.files] == ["bc_demos.parquet", "flywheel_00001.parquet", "rl_00000.parquet"]
        # samples: 2 demos + (2 + 1 + 1 episode row) + 3 flywheel rows
        assert store.sql("SELECT count(*) AS n FROM samples").column("n").to_pylist() == [9]
        assert store.sql("SELECT * FROM samples").column_names == SCHEMA.names

        trajs = {r["trajectory_id"]: r for r in store.sql("SELECT * FROM trajectories").to_pylist()}
        assert sorted(trajs) == ["d0", "d1", "f0", "f1", "f2", "r0", "r1", "r2"]
        assert trajs["r0"] == {
            "stage": "rl", "iteration": 0, "source": "plain", "trajectory_id": "r0", "task_id": T(0), "group_id": "g0",
            "env_seed": 0, "reward": 1.0, "success": True, "num_turns": 2, "truncation_reason": None,
            "infra_failure": None, "n_samples": 2, "n_tokens": 6, "n_action_tokens": 4,
        }
        r2 = trajs["r2"]  # the failed reset: its episode row, unscored, no tokens
        assert (r2["n_samples"], r2["n_tokens"], r2["n_action_tokens"]) == (0, 0, 0)
        assert r2["reward"] is None and r2["success"] is None and r2["infra_failure"] == "env reset() raised: boom"
        assert {t: r["source"] for t, r in trajs.items()} == {
            "d0": "demo", "d1": "demo", "r0": "plain", "r1": "plain", "r2": "plain",
            "f0": "guided", "f1": "guided", "f2": "curriculum"}

        cols = "episodes, scored, successes, success_rate, mean_reward, infra_failures"
        by_source = {r.pop("source"): r for r in store.sql(f"SELECT source, {cols} FROM success_by_source").to_pylist()}
        assert by_source == {
            "curriculum": row(1, 1, 1, 1.0, 0.5, 0),
            "demo": row(2, 2, 2, 1.0, 1.0, 0),
            "guided": row(2, 2, 1, 0.5, 0.5, 0),
            "plain": row(3, 2, 1, 0.5, 0.25, 1),  # 3 episodes, 1 infra failure, 1 success: 1/2; (1 - 0.5) / 2
        }
        by_round = store.sql(f"SELECT stage, iteration, {cols} FROM success_by_round").to_pylist()
        assert [(r.pop("stage"), r.pop("iteration")) for r in by_round] == [("bc", 0), ("flywheel", 1), ("rl", 0)]
        assert by_round[0] == row(2, 2, 2, 1.0, 1.0, 0)
        assert by_round[1] == row(3, 3, 2, pytest.approx(2 / 3), 0.5, 0)
        assert by_round[2] == row(3, 2, 1, 0.5, 0.25, 1)
        by_task = {r.pop("task_id"): r for r in store.sql(f"SELECT task_id, {cols} FROM success_by_task").to_pylist()}
        assert by_task == {
            T(0): row(2, 2, 2, 1.0, 1.0, 0),
            T(1): row(5, 5, 3, 0.6, pytest.approx(0.4), 0),  # d1 1, r1 -0.5, f0 1, f1 0, f2 0.5
            T(2): row(1, 0, 0, None, None, 1),  # nothing scored: no rate, no mean
        }
    assert snapshot(run) == before  # only read
    assert sorted(p.name for p in run.iterdir()) == ["trajectories"]


def row(episodes, scored, successes, success_rate, mean_reward, infra_failures) -> dict:
    return dict(episodes=episodes, scored=scored, successes=successes, success_rate=success_rate,
                mean_reward=mean_reward, infra_failures=infra_failures)


def test_a_file_without_source_reads_with_the_derived_source_next_to_new_files(run):
    files = run / "trajectories"
    old_format(files / "bc_demos.parquet")
    old_format(files / "rl_00000.parquet")
    with TrajectoryStore(run) as store:  # two old files, one new: one dataset
        got = {r["trajectory_id"]: r["source"] for r in store.sql("SELECT trajectory_id, source FROM trajectories").to_pylist()}
        assert got == {"d0": "demo", "d1": "demo", "r0": "plain", "r1": "plain", "r2": "plain",
                       "f0": "guided", "f1": "guided", "f2": "curriculum"}
    (files / "flywheel_00001.parquet").unlink()
    with TrajectoryStore(files) as store:  # only old files, opened on the directory of Parquet files itself
        assert store.sql("SELECT * FROM samples").column_names == SCHEMA.names
        counts = store.sql("SELECT source, episodes FROM success_by_source").to_pylist()
        assert counts == [{"source": "demo", "episodes": 2}, {"source": "plain", "episodes": 3}]


def test_one_file_or_a_directory_of_them(run):
    with TrajectoryStore(run / "trajectories" / "rl_00000.parquet") as store:
        assert store.sql("SELECT count(*) AS n FROM trajectories").column("n").to_pylist() == [3]


def test_a_view_made_by_a_query_is_listed_and_the_store_closes(run):
    store = TrajectoryStore(run)
    assert store.sql("CREATE VIEW wins AS SELECT * FROM trajectories WHERE success").num_rows == 0
    assert store.views() == [*VIEWS, "wins"]
    assert store.sql("SELECT count(*) AS n FROM wins").column("n").to_pylist() == [5]
    store.close()
    with pytest.raises(RuntimeError, match="is closed"):
        store.sql("SELECT 1")


# ---------------------------------------------------------------------- errors
def test_an_sql_error_is_one_line_with_duckdbs_message_and_the_views(run):
    with TrajectoryStore(run) as store:
        with pytest.raises(UserError) as err:
            store.sql("SELECT * FROM nope")
        message = str(err.value)
        assert message.startswith("query failed: Catalog Error: Table with name nope does not exist!")
        assert message.endswith("(views: samples, trajectories, success_by_task, success_by_round, success_by_source)")
        assert "\n" not in message
        with pytest.raises(UserError, match=r"^query failed: Parser Error: syntax error at or near \"SELEC\" \(views: "):
            store.sql("SELEC 1")
        assert store.sql("SELECT 1 AS x").column("x").to_pylist() == [1]  # the store still works


def test_an_empty_store_is_an_error_naming_the_path(tmp_path):
    with pytest.raises(UserError, match=r"^empty store: no trajectory files under '.*/nope' \(it does not exist\)$"):
        TrajectoryStore(tmp_path / "nope")
    (tmp_path / "run" / "trajectories").mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text("seed: 0\n")
    for where in (tmp_path / "run", tmp_path / "run" / "trajectories"):
        with pytest.raises(UserError, match=rf"^empty store: no trajectory files under '{where}' \(expected RUN/trajectories"):
            TrajectoryStore(where)


def test_a_damaged_file_is_an_error_naming_the_run(run):
    (run / "trajectories" / "rl_00001.parquet").write_bytes(b"not parquet")
    with pytest.raises(UserError, match=rf"^cannot read the trajectory files under '{run}': .*rl_00001.parquet"):
        TrajectoryStore(run)


# ---------------------------------------------------------------------- turnforge data
def run_main(args, cwd, monkeypatch, capsys):
    """``cli.main()`` with ``args`` in ``cwd``: (exit code, stdout, stderr)."""
    from turnforge import cli

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["turnforge", *map(str, args)])
    monkeypatch.setenv("COLUMNS", "120")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


QUERY = "SELECT source, episodes, success_rate FROM success_by_source"


def test_cli_prints_a_table_and_the_row_count(run, monkeypatch, capsys):
    code, out, err = run_main(["data", run, QUERY], run.parent, monkeypatch, capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    (plain,) = [ln for ln in lines if "plain" in ln]
    assert [cell.strip() for cell in re.split(r"[│|]", plain)[1:4]] == ["plain", "3", "0.5"]
    assert "curriculum" in out and "demo" in out and "guided" in out
    assert lines[-1] == "4 rows"

    code, out, _ = run_main(["data", run, QUERY, "--limit", "1"], run.parent, monkeypatch, capsys)
    assert code == 0 and "curriculum" in out and "plain" not in out  # ordered by source: the first row only
    assert out.splitlines()[-1] == "4 rows (showing 1; --limit N shows more, --out FILE writes them all)"

    code, out, _ = run_main(["data", run, "SELECT task_id, '[bold]x' AS t FROM samples LIMIT 1"], run.parent, monkeypatch, capsys)
    assert code == 0 and out.splitlines()[-1] == "1 row"
    assert "sokoban:train:0" in out and "[bold]x" in out  # text, not an emoji code or rich markup

    code, out, _ = run_main(["data", run, "SELECT * FROM trajectories"], run.parent, monkeypatch, capsys)
    assert code == 0 and "n_action_tokens" in out and "…" not in out  # wider than COLUMNS=120, not squeezed


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".CSV"])
def test_cli_out_writes_every_row(run, tmp_path, monkeypatch, capsys, suffix):
    out_file = tmp_path / f"result{suffix}"
    query = "SELECT trajectory_id, source, reward, success, n_tokens FROM trajectories"
    code, out, err = run_main(["data", run, query, "--out", out_file, "--limit", "1"], tmp_path, monkeypatch, capsys)
    assert code == 0 and err == "" and out.strip() == f"wrote 8 rows to {out_file}"
    with TrajectoryStore(run) as store:
        expected = store.sql(query).to_pylist()
    if suffix == ".parquet":
        assert pq.read_table(out_file).to_pylist() == expected
    else:
        with open(out_file, newline="") as f:
            rows = list(csv.DictReader(f))
        def text(v):  # DuckDB's CSV: null empty, booleans lower case
            return "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
        assert rows == [{k: text(v) for k, v in r.items()} for r in expected]
        assert rows[6] == {"trajectory_id": "r1", "source": "plain", "reward": "-0.5", "success": "false", "n_tokens": "3"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run", out_file.name])  # no temporary file left

    # a list column in CSV
    code, _, _ = run_main(["data", run, "SELECT token_ids FROM samples WHERE trajectory_id = 'd0'", "--out", out_file],
                          tmp_path, monkeypatch, capsys)
    assert code == 0
    if suffix != ".parquet":
        assert out_file.read_text().splitlines() == ["token_ids", '"[5, 6, 7]"']
    else:
        assert pq.read_table(out_file).column("token_ids").to_pylist() == [[5, 6, 7]]


@pytest.mark.parametrize("args, expected", [
    (["{run}", QUERY, "--out", "x.json"], "--out 'x.json' has suffix '.json'; valid suffixes: '.parquet', '.csv'"),
    (["{run}", "SELEC nothing", "--out", "x.txt"], "--out 'x.txt' has suffix '.txt'; valid suffixes"),  # before the query
    (["{run}", QUERY, "--out", "noext"], "--out 'noext' has no suffix; valid suffixes"),
    (["{run}", QUERY, "--out", "nodir/x.csv"], "directory 'nodir' does not exist"),
    (["{run}", QUERY, "--out", f"{UNWRITABLE}/x.csv"], f"cannot write in '{UNWRITABLE}'"),
    (["{run}", "SELECT * FROM nope"], "error: query failed: Catalog Error: Table with name nope does not exist!"),
    (["{run}", "SELEC 1", "--out", "x.csv"], "error: query failed: Parser Error: syntax error at or near"),
    (["/no/such/run", QUERY], "error: empty store: no trajectory files under '/no/such/run' (it does not exist)"),
    (["{run}", QUERY, "--limit", "-1"], "invalid value for '--limit'"),
    (["{run}"], "missing argument 'SQL'"),
], ids=["suffix", "suffix-before-query", "no-suffix", "out-missing-dir", "out-unwritable", "unknown-table", "bad-sql",
        "missing-run", "limit-negative", "no-sql"])
def test_cli_bad_input_is_one_line_exit_2_and_writes_nothing(run, monkeypatch, capsys, args, expected):
    args = ["data", *(a.format(run=run) for a in args)]
    before = snapshot(run.parent)
    code, out, err = run_main(args, run.parent, monkeypatch, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    assert "Traceback" not in err
    assert snapshot(run.parent) == before and sorted(p.name for p in run.parent.iterdir()) == ["run"]


def test_cli_in_a_real_process(run):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "120"}
    ok = subprocess.run([sys.executable, "-m", "turnforge.cli", "data", str(run), QUERY], capture_output=True, text=True,
                        env=env, timeout=120)
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1] == "4 rows", ok.stderr
    bad = subprocess.run([sys.executable, "-m", "turnforge.cli", "data", str(run), "SELECT * FROM nope"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: query failed: ")
