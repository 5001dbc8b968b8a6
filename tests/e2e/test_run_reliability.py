"""Run directories that cannot silently go wrong: the lock, atomic checkpoints, corrupt
checkpoints, interrupts, finished runs, and runs restarted before their first checkpoint.

Each resumed run must end with the final weights of one uninterrupted run (``reference``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import NO_FLYWHEEL, TINY_TEST_SHAPE

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.app.setup import load_run_config
from turnforge.errors import UserError
from turnforge import runs
from turnforge.runs import RunDir, RunLock
from turnforge.train.metrics import read_summary
from turnforge.train.run_dir import checkpoint
from turnforge.train.run_dir.checkpoint import find_resumable

pytestmark = pytest.mark.slow

FAST = [
    *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()], *NO_FLYWHEEL,
    "bc.num_demos=6", "bc.epochs=1", "bc.batch_size=8",
    "rl.iterations=4", "rl.tasks_per_iteration=2", "rl.group_size=2", "rl.minibatch_size=16",
    "rollout.max_turns=5", "eval.episodes=4", "eval.every=0", "checkpoint_every=1",
]


def cli(*args, **kw):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "turnforge.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


def sha(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run of the FAST config."""
    out = tmp_path_factory.mktemp("ref") / "run"
    train(load_config("sokoban-tiny", FAST), out, live=False)
    return out


def wait_for(predicate, proc, timeout=120.0):
    t0 = time.time()
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.05)


# ------------------------------------------------------------------ the lock
def test_second_writer_and_resume_next_to_a_live_run_are_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from turnforge.runs import RunLock\n"
        f"RunLock(Path({str(run)!r})).acquire(); print('locked', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        (run / "config.yaml").write_text("seed: 0\n")
        for args in (["train", *FAST, "--out", str(run)], ["train", "--resume", str(run)]):
            proc = cli(*args)
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 2, err
            assert err.strip().splitlines() == [err.strip()] and "is in use by a live turnforge run (pid" in err, err
        assert sorted(p.name for p in run.iterdir()) == [".lock", "config.yaml"]  # nothing written
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing: the lock file is stale and is taken over
    lock = RunLock(run).acquire()
    assert lock.stale is not None and lock.stale["pid"] == holder.pid
    with pytest.raises(UserError, match="in use by a run of this process"):
        RunLock(run).acquire()
    lock.release()


# ------------------------------------------------------------------ checkpoints
def test_crash_between_the_swap_renames_resumes_from_the_new_checkpoint(tmp_path, reference, monkeypatch):
    out = tmp_path / "run"
    cfg = load_config("sokoban-tiny", FAST)
    train(cfg, out, live=False, stop_after=2)
    renames = []
    real_rename = Path.rename

    def crash_on_second_rename(self, target):  # last -> prev succeeds, last.tmp -> last "crashes"
        renames.append(Path(target).name)
        if len(renames) == 2:
            raise OSError("simulated crash between the renames")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", crash_on_second_rename)
    with pytest.raises(OSError, match="simulated crash"):
        train(cfg, out, resume=True, live=False, stop_after=3)
    monkeypatch.undo()
    assert renames == ["prev", "last"] and not (out / "checkpoints" / "last").exists()
    found = find_resumable(out)
    assert found.path.name == "last.tmp" and found.state.iteration == 3  # before: restarted from BC silently
    summary = train(load_run_config(out), out, resume=True, live=False)
    assert summary.rl_iterations == 4
    assert sha(out / "checkpoints" / "final") == sha(reference / "checkpoints" / "final")
    assert read_summary(out).eval_after_rl == read_summary(reference).eval_after_rl


def test_truncated_checkpoint_falls_back_to_the_previous_one(tmp_path, reference, capsys):
    out = tmp_path / "run"
    train(load_config("sokoban-tiny", FAST), out, live=False, stop_after=2)
    weights = out / "checkpoints" / "last" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    summary = train(load_run_config(out), out, resume=True, live=False)
    err = capsys.readouterr().err
    assert f"warning: {weights} is truncated (" in err and "resuming from the previous checkpoint" in err
    assert "resuming " + str(out) + " from prev/ at RL iteration 1" in err
    assert summary.rl_iterations == 4
    assert sha(out / "checkpoints" / "final") == sha(reference / "checkpoints" / "final")
    # every checkpoint damaged: one line naming the files, no silent restart from BC
    for name in ("last", "prev"):
        (out / "checkpoints" / name / "trainer_state.pt").write_bytes(b"")
    (out / "summary.json").unlink()
    with pytest.raises(UserError, match=r"no complete checkpoint to resume from: .*last/trainer_state.pt is truncated"):
        train(load_run_config(out), out, resume=True, live=False)


def test_resuming_a_finished_run_is_a_no_op(reference, capsys):
    before = {p: p.read_bytes() for p in (reference / "metrics.jsonl", reference / "summary.json")}
    summary = train(load_run_config(reference), reference, resume=True, live=False)
    assert summary == read_summary(reference)
    assert "is finished (4 RL iterations" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in before} == before  # no second final evaluation, nothing rewritten


# ------------------------------------------------------------------ interrupts
def test_ctrl_c_in_rl_checkpoints_exits_130_and_resumes_exactly(tmp_path, reference):
    out = tmp_path / "run"
    proc = cli("train", *FAST, "--out", str(out))
    wait_for(lambda: (out / "metrics.jsonl").exists() and '"rl_iter"' in (out / "metrics.jsonl").read_text(), proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted at RL iteration ") and last.endswith(f"resume with: turnforge train --resume {out}"), err
    stopped_at = find_resumable(out).state.iteration
    assert 1 <= stopped_at < 4 and f"at RL iteration {stopped_at} (checkpoint saved)" in last
    proc = cli("train", "--resume", str(out))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert sha(out / "checkpoints" / "final") == sha(reference / "checkpoints" / "final")


def test_sigterm_before_the_first_checkpoint_then_a_new_model_config(tmp_path):
    out = tmp_path / "run"
    # a BC stage of minutes, so the signal lands before the first checkpoint on any machine (with FAST's
    # 3 BC steps an idle machine finished the whole run before the signal arrived)
    proc = cli("train", *FAST, "bc.epochs=2000", "--out", str(out))
    # metrics.jsonl is written once the signal handlers are in place (base_model/ appears while the
    # base model is still being written, before them: a signal then ended the process unhandled)
    wait_for(lambda: (out / "metrics.jsonl").exists(), proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1].startswith("interrupted before the first checkpoint"), err
    assert json.loads((out / "base_model" / "config.json").read_text())["num_hidden_layers"] == 2
    # a new run into the directory with another model shape: the old base model is not reused
    summary = train(load_config("sokoban-tiny", [*FAST, "model.tiny.num_hidden_layers=3", "rl.iterations=0"]), out, live=False)
    assert summary.rl_iterations == 0
    assert json.loads((out / "base_model" / "config.json").read_text())["num_hidden_layers"] == 3
    assert json.loads((out / "checkpoints" / "final" / "config.json").read_text())["num_hidden_layers"] == 3
    assert load_run_config(out).model.tiny.num_hidden_layers == 3


def test_atomic_save_leaves_no_partial_directory(tmp_path, monkeypatch, tiny_model_dir):
    """A crash while the new checkpoint is written leaves the old one complete and in place."""
    from turnforge.policy.model import load_policy

    policy = load_policy(tiny_model_dir)
    state, training = checkpoint.TrainerState(stage="rl", iteration=1), checkpoint.TrainingState(version=1)
    checkpoint.save_resumable(RunDir(tmp_path), policy, state, training)
    monkeypatch.setattr(runs, "seal", lambda d: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_resumable(RunDir(tmp_path), policy, checkpoint.TrainerState(stage="rl", iteration=2), training)
    found = find_resumable(tmp_path)
    assert found.path.name == "last" and found.state.iteration == 1 and found.skipped == ()
