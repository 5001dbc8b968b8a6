"""``turnforge train --nproc 2`` with rank 1 killed by a real SIGKILL in the middle of a flywheel
round: every rank stops, the launcher names rank 1 and the signal on one line and rank 0 on one
more, says where to resume, prints no traceback and no "interrupted" (the launcher's SIGTERM to
rank 0 is not a user's interrupt), exits 1; the run then resumes on one process to its end. And
a user's Ctrl-C to the launcher is the run's own "interrupted" line, once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_TEST_SHAPE

from turnforge.train.metrics import read_metrics, read_summary

pytestmark = pytest.mark.slow

RUN = [
    *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()], "eval.bc_temperatures=[]", "eval.pass_at_k_samples=0",
    "bc.num_demos=8", "bc.epochs=1", "bc.batch_size=8", "eval.episodes=2", "rollout.max_turns=5", "threads=2",
    # one flywheel round long enough to be killed in (a few seconds on two ranks), that trains on every episode
    "flywheel.rounds=1", "flywheel.env_steps_per_round=3000", "flywheel.mechanisms=[]", "flywheel.filters=[infra]",
    "flywheel.eval_episodes=2", "rl.iterations=0",
]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of trainer rank ``rank``: the launcher's child whose environment says ``RANK=<rank>``."""
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if f"RANK={rank}".encode() in env:
            return int(proc.name)
    return None


def _start_mid_flywheel(out: Path) -> tuple[subprocess.Popen, tuple[int, int]]:
    """``turnforge train --nproc 2`` started, once it plays its flywheel round: the launcher and
    the pids of ranks 0 and 1."""
    proc = subprocess.Popen([sys.executable, "-m", "turnforge.cli", "train", "sokoban-tiny", *RUN, "--out", str(out),
                             "--nproc", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (out / "checkpoints" / "last").exists():  # BC's checkpoint: written just before the flywheel's round starts
            pids = _rank_pid(proc.pid, 0), _rank_pid(proc.pid, 1)
            if None not in pids:
                return proc, pids
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the run did not reach its flywheel round on two ranks: {proc.communicate()[1][-3000:]}")


def test_a_rank_killed_mid_flywheel_is_named_and_the_run_resumes(tmp_path):
    out = tmp_path / "run"
    proc, pids = _start_mid_flywheel(out)
    try:
        os.kill(pids[1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert read_metrics(out).flywheel == [], "rank 1 was killed after the round, not in it"  # mid-round indeed
    lines = stderr.strip().splitlines()
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr
    assert not any("interrupted" in line for line in lines), stderr
    named = [line for line in lines if line.startswith("rank 1")]
    assert len(named) == 1 and named[0].startswith("rank 1 was killed by SIGKILL (signal 9)"), stderr
    assert [line for line in lines if line.startswith("rank 0")] == ["rank 0: stopped because rank 1 died"], stderr
    assert lines[-1].startswith(f"the run stopped during flywheel round 1; resume with: turnforge train --resume {out}"), stderr
    assert lines[-3:-1] == [named[0], "rank 0: stopped because rank 1 died"], stderr  # the story comes last, in this order
    assert not Path(f"/proc/{pids[0]}").exists(), "rank 0 is still running"

    resumed = subprocess.run([sys.executable, "-m", "turnforge.cli", "train", "--resume", str(out), "--nproc", "1"],
                             capture_output=True, text=True, timeout=600, env=_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr and len(read_metrics(out).flywheel) == 1
    assert read_summary(out) is not None and (out / "checkpoints" / "final" / "model.safetensors").exists()


def test_a_users_ctrl_c_to_the_launcher_is_one_interrupted_line(tmp_path):
    """The launcher, not the ranks, gets a terminal's Ctrl-C (torch's agent starts each rank in a
    session of its own) and passes it on; the run's own "interrupted" line once, exit 130."""
    out = tmp_path / "run"
    proc, pids = _start_mid_flywheel(out)
    try:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and not any(line.startswith("rank ") for line in stderr.splitlines()), stderr
    assert stderr.strip().splitlines()[-1] == (f"interrupted during flywheel round 1; resume with: turnforge train --resume "
                                               f"{out} (plays the flywheel again from the BC checkpoint)"), stderr
    assert not Path(f"/proc/{pids[0]}").exists() and not Path(f"/proc/{pids[1]}").exists()
