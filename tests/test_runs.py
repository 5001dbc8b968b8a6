"""The run directory (``turnforge.runs``): every path under the root, the writers obey the rank rule
(nothing written on a rank other than 0), and a sealed directory is whole or absent."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest

import turnforge.dist
from turnforge.dist import World
from turnforge.errors import UserError
from turnforge.paths import MANIFEST, verify
from turnforge.runs import CHECKPOINTS, RunDir, RunLock, staging


def _paths(run: RunDir) -> dict[str, Path]:
    """Every path the layout names: each property, each method with its example arguments."""
    props = {name: getattr(run, name) for name, attr in inspect.getmembers(RunDir) if isinstance(attr, property)}
    props.pop("leftovers")
    return {**props, **{f"checkpoint({n})": run.checkpoint(n) for n in CHECKPOINTS},
            "kept(3, rl-2)": run.kept(3, "rl-2"), "trajectory_file(rl_00001)": run.trajectory_file("rl_00001")}


@pytest.fixture
def rank1(monkeypatch):
    """This process as rank 1 of 2 (its barriers recorded, not run)."""
    barriers = []
    monkeypatch.setattr(turnforge.dist, "world", lambda: World(rank=1, size=2))
    monkeypatch.setattr(turnforge.dist, "barrier", lambda: barriers.append(1))
    return barriers


def test_every_path_is_under_the_root_and_distinct(tmp_path):
    run = RunDir(tmp_path / "run")
    paths = _paths(run)
    assert all(p.is_relative_to(run.root) and p != run.root for p in paths.values()), paths
    assert len(set(paths.values())) == len(paths), "two names of the layout are one path"
    assert all(p.is_relative_to(run.root) for p in run.leftovers)
    assert run.kept(3, "rl-2").name == "kept-003-rl-2" and run.trajectory_file("bc_demos").name == "bc_demos.parquet"
    assert os.fspath(run) == str(run) == str(tmp_path / "run") and RunDir(run) == run == RunDir(str(run))
    with pytest.raises(ValueError, match="no checkpoint 'lats'.*valid names: bc, last"):
        run.checkpoint("lats")


def test_kept_checkpoints_in_order_without_a_save_in_progress(tmp_path):
    run = RunDir(tmp_path)
    assert run.kept_checkpoints() == []
    for path in (run.kept(10, "rl-10"), run.kept(2, "round-2"), staging(run.kept(11, "rl-11"))):
        path.mkdir(parents=True)
    assert [p.name for p in run.kept_checkpoints()] == ["kept-002-round-2", "kept-010-rl-10"]


def test_writers_write_on_rank_zero(tmp_path):
    run = RunDir(tmp_path)
    run.write_text(run.config, "seed: 0\n")
    run.write_json(run.summary, {"a": 1})
    assert run.write(run.trajectory_file("bc_demos"), lambda p: (p.parent.mkdir(), p.write_text("x"), "done")[2]) == "done"
    assert run.config.read_text() == "seed: 0\n" and json.loads(run.summary.read_text()) == {"a": 1}
    assert run.trajectory_file("bc_demos").read_text() == "x"
    run.remove(run.summary)
    run.remove(run.trajectories)
    assert not run.summary.exists() and not run.trajectories.exists()
    with run.hold():
        assert run.lock.exists()
        with pytest.raises(UserError, match="in use by a run of this process"):
            RunLock(run).acquire()


def test_writers_write_nothing_on_another_rank(tmp_path, rank1):
    run = RunDir(tmp_path)
    called = []
    run.write_text(run.config, "seed: 0\n")
    run.write_json(run.summary, {"a": 1})
    assert run.write(run.memory, lambda p: called.append(p) or p.write_text("x")) is None
    (tmp_path / "summary.json").write_text("rank 0's")
    run.remove(run.summary)
    with run.hold():
        pass
    shards = []
    out = run.write_sealed(run.checkpoint("last"), lambda tmp: called.append(tmp),
                           shards={"optimizer": lambda d: shards.append(d)})
    assert out == run.checkpoint("last") and not called
    assert shards == [staging(run.checkpoint("last")) / "optimizer"]  # every rank writes its shards
    assert rank1 == [1, 1]  # after the directory exists, and until rank 0 renamed it into place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # rank 0's, untouched


def test_a_path_outside_the_run_is_refused(tmp_path):
    run = RunDir(tmp_path / "run")
    with pytest.raises(ValueError, match="not under the run directory"):
        run.write_text(tmp_path / "elsewhere.txt", "x")
    assert not (tmp_path / "elsewhere.txt").exists()


def _fill(tmp: Path, text: str) -> None:
    (tmp / "model.safetensors").write_text(text)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "adapter.bin").write_text(text * 2)


def test_a_sealed_directory_is_whole_or_absent(tmp_path):
    run = RunDir(tmp_path)
    last, prev = run.checkpoint("last"), run.checkpoint("prev")
    assert run.write_sealed(last, lambda tmp: _fill(tmp, "one"), previous=prev) == last
    assert verify(last) is None and (last / MANIFEST).exists() and not staging(last).exists() and not prev.exists()

    def crash(tmp: Path) -> None:
        _fill(tmp, "two")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):  # a save that fails half way: the old one stays, whole
        run.write_sealed(last, crash, previous=prev)
    assert verify(last) is None and (last / "model.safetensors").read_text() == "one" and not prev.exists()
    assert verify(staging(last)) is not None  # what was written is not sealed: never taken for a checkpoint

    run.write_sealed(last, lambda tmp: _fill(tmp, "three"), previous=prev)
    assert (last / "model.safetensors").read_text() == "three" and (prev / "model.safetensors").read_text() == "one"
    assert verify(last) is None and verify(prev) is None and not staging(last).exists()

    final = run.checkpoint("final")  # no previous: the old one is deleted once the new one is in place
    run.write_sealed(final, lambda tmp: _fill(tmp, "a"))
    run.write_sealed(final, lambda tmp: _fill(tmp, "b"))
    assert (final / "model.safetensors").read_text() == "b" and verify(final) is None
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["final", "last", "prev"]
