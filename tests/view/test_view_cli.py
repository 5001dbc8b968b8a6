"""``turnforge view`` through the real command line: bad input is one line naming the problem,
exit 2, nothing written; a live run is read as far as it is complete."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from test_bad_input import run_cli, run_main, snapshot
from turnforge.view.data import RunView
from turnforge.view.rundir import locate_run, run_is_live


@pytest.fixture()
def dirs(tmp_path, view_run):
    """A copy of the run with a truncated trajectory file, a run with no trajectories yet, a
    directory that is no run, a plain file."""
    corrupt = shutil.copytree(view_run, tmp_path / "corrupt")
    bad = corrupt / "trajectories" / "rl_00001.parquet"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    fresh = tmp_path / "fresh"
    (fresh / "trajectories").mkdir(parents=True)
    (fresh / "config.yaml").write_text((view_run / "config.yaml").read_text())
    (tmp_path / "notarun").mkdir()
    (tmp_path / "notes.txt").write_text("hello\n")
    return {"run": view_run, "corrupt": corrupt, "fresh": fresh, "notarun": tmp_path / "notarun",
            "file": tmp_path / "notes.txt", "tmp": tmp_path}


CASES = [
    ("missing", ["view", "{tmp}/nope"], "run directory '{tmp}/nope' does not exist"),
    ("a-file", ["view", "{file}"], "'{file}' is a file, not a run directory"),
    ("not-a-run", ["view", "{notarun}"], "'{notarun}' is not a run directory (no config.yaml, no trajectories/)"),
    ("no-trajectories", ["view", "{fresh}"], "run directory '{fresh}' has no trajectories yet"),
    ("corrupt-parquet", ["view", "{corrupt}"], "corrupt trajectory file '{corrupt}/trajectories/rl_00001.parquet'"),
    ("three-runs", ["view", "{run}", "{run}", "{run}"], "give one or two run directories (got 3)"),
    ("out-and-serve", ["view", "{run}", "-o", "{tmp}/x.html", "--serve"], "-o writes a file and --serve serves the page"),
    ("port-without-serve", ["view", "{run}", "--port", "9"], "--port is the port of --serve"),
    ("out-not-html", ["view", "{run}", "-o", "{tmp}/x.txt"], "must end in .html"),
    ("out-missing-dir", ["view", "{run}", "-o", "{tmp}/no/x.html"], "directory '{tmp}/no' does not exist"),
    ("second-run-bad", ["view", "{run}", "{notarun}"], "'{notarun}' is not a run directory"),
]


#: cases also run in a process of their own (the others through ``cli.main`` in this one)
IN_A_PROCESS = {"corrupt-parquet", "no-trajectories"}


@pytest.mark.parametrize("args, expected, case", [pytest.param(a, e, i, id=i) for i, a, e in CASES])
def test_bad_input_is_one_line_exit_2(dirs, args, expected, case, monkeypatch, capsys):
    names = {k: str(v) for k, v in dirs.items()}
    args = [a.format(**names) for a in args]
    before = snapshot(dirs["tmp"], dirs["run"])
    ends = [run_main(args, dirs["tmp"], monkeypatch, capsys)]
    if case in IN_A_PROCESS:
        proc = run_cli(*args, cwd=dirs["tmp"], timeout=120)
        ends.append((proc.returncode, proc.stdout, proc.stderr))
    for code, _, stderr in ends:
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2, stderr
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected.format(**names) in lines[0], stderr
        assert snapshot(dirs["tmp"], dirs["run"]) == before  # nothing written


def test_port_in_use_is_one_line(view_run, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli("view", view_run, "--serve", "--port", port, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"error: port {port} on 127.0.0.1 is in use; give another --port (or --port 0 for a free one)"


def test_default_output_is_next_to_the_run(view_run_b, view_run, tmp_path):
    run = shutil.copytree(view_run_b, tmp_path / "b")
    proc = run_cli("view", run, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (run / "view.html").stat().st_size > 10_000
    proc = run_cli("view", run, view_run, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (run / f"view-vs-{view_run.name}.html").is_file()


HOLD_LOCK = """
import sys, time
from pathlib import Path
from turnforge.runs import RunLock
RunLock(Path(sys.argv[1])).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_a_live_run_shows_what_is_complete(view_run, tmp_path):
    """While a process holds the run's lock, a trajectory file that does not read yet is being
    written: left out and listed, not an error; once the run is over it is a corrupt file."""
    run = shutil.copytree(view_run, tmp_path / "live", ignore=shutil.ignore_patterns(".lock"))
    (run / "summary.json").unlink()
    partial = run / "trajectories" / "rl_00002.parquet"
    partial.write_bytes(b"PAR1" + b"\0" * 100)  # the start of a file, no footer yet
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert run_is_live(run)
        files = locate_run(run)
        assert files.live and partial not in files.parquet and [s.name for s in files.skipped] == ["rl_00002.parquet"]
        view = RunView(run)
        overview = view.overview()
        assert overview.status == "running" and overview.skipped[0].why.startswith("being written")
        complete = view.sql("SELECT count(*) AS n FROM episodes").to_pylist()[0]["n"]
        # the writer renames the finished file into place (iteration 1's episodes as iteration 2): a refresh reads it
        table = pq.read_table(view_run / "trajectories" / "rl_00001.parquet")
        table = table.set_column(table.schema.get_field_index("iteration"), "iteration", pa.array([2] * table.num_rows, pa.int32()))
        pq.write_table(table, tmp_path / "done.parquet")
        os.replace(tmp_path / "done.parquet", partial)
        assert view.refresh() and view.overview().totals.episodes > complete and not view.overview().skipped
        view.close()
        proc = run_cli("view", run, "-o", tmp_path / "live.html", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    finally:
        holder.kill()
        holder.wait()
    deadline = time.time() + 30
    while run_is_live(run) and time.time() < deadline:
        time.sleep(0.1)
    assert not run_is_live(run)
    partial.write_bytes(b"PAR1" + b"\0" * 100)
    proc = run_cli("view", run, "-o", tmp_path / "dead.html", cwd=tmp_path)
    assert proc.returncode == 2 and "corrupt trajectory file" in proc.stderr
