"""turnforge's launcher (``turnforge.app.launch``): the story it tells of how the ranks ended,
from hand-built ends; the peek at a child's end that leaves it for torch's agent to reap; and,
with real ranks, a rank's own error told once, by the launcher, with its exit code."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from turnforge.app.launch import RankEnd, _ended, _oom_kills, interrupted_story, story
from turnforge.dist import RankReport
from turnforge.runs import resume_lines

LOST = RankReport(0, 1, "error: another trainer rank went away (RuntimeError: Connection closed by peer)")


def _interrupted(rank: int, where: str = "during flywheel round 1; resume with: turnforge train --resume R "
                                         "(plays the flywheel again from the BC checkpoint)") -> RankReport:
    return RankReport(rank, 143, f"interrupted {where}", interrupted=True)


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    return tmp_path


def test_a_killed_rank_is_named_the_others_stopped_and_the_resume_point_is_the_ranks_own(run_dir):
    ends = [RankEnd(0, 143, _interrupted(0), first=False), RankEnd(1, -9, None, first=True)]
    lines, code = story(ends, run_dir)
    assert lines == [
        "rank 1 was killed by SIGKILL (signal 9); possibly out of memory (the kernel's OOM killer sends SIGKILL)",
        "rank 0: stopped because rank 1 died",
        "the run stopped during flywheel round 1; resume with: turnforge train --resume R "
        "(plays the flywheel again from the BC checkpoint)",
    ]
    assert code == 1


def test_the_oom_evidence_decides_the_wording(run_dir):
    ends = [RankEnd(0, 1, LOST, first=True), RankEnd(1, -9, None, first=True)]  # both ended before the poll
    said = {oom: story(ends, run_dir, oom=oom)[0] for oom in (True, False)}
    assert said[True][0] == ("rank 1 was killed by SIGKILL (signal 9): out of memory (the kernel's OOM killer killed a "
                             "process of this run's memory cgroup)")
    assert said[False][0] == "rank 1 was killed by SIGKILL (signal 9) from outside the run (the kernel counted no out-of-memory kill here)"
    # rank 0 only lost its peer: not a cause; without a rank's own resume point, the checkpoint's
    assert said[True][1:] == ["rank 0: stopped because rank 1 died",
                              f"the run's last checkpoint is intact; resume with: turnforge train --resume {run_dir}"]


def test_a_rank_that_hung_is_the_cause_though_its_peer_failed_first(run_dir):
    ends = [RankEnd(0, 1, LOST, first=True), RankEnd(1, -9, None, first=False)]  # rank 1 killed by the agent's shutdown
    lines, code = story(ends, run_dir)
    assert lines[0].startswith("rank 1 hung: the other ranks gave up waiting for it in a collective (dist.timeout_s)")
    assert lines[1] == "rank 0: stopped because rank 1 hung" and code == 1


def test_a_rank_of_four_with_its_own_error_keeps_its_exit_code_and_others_get_a_line_each(run_dir):
    bug = RankReport(2, 1, "internal error: ValueError: boom")
    ends = [RankEnd(0, 143, _interrupted(0), first=False), RankEnd(1, 1, RankReport(1, 1, LOST.line), first=False),
            RankEnd(2, 1, bug, first=True), RankEnd(3, -15, None, first=False)]  # rank 3: SIGTERM before its handler
    lines, code = story(ends, run_dir)
    assert lines[:4] == ["rank 2 failed (exit code 1): internal error: ValueError: boom",
                         "rank 0: stopped because rank 2 failed", "rank 1: stopped because rank 2 failed",
                         "rank 3: stopped because rank 2 failed"]
    assert lines[4].startswith("the run stopped during flywheel round 1") and len(lines) == 5 and code == 1


def test_a_later_rank_with_an_error_of_its_own_says_so(run_dir):
    ends = [RankEnd(0, 1, RankReport(0, 1, "error: rl iteration 2: NaN loss"), first=False),
            RankEnd(1, 1, RankReport(1, 1, "internal error: ValueError: boom"), first=True),
            RankEnd(2, 1, RankReport(2, 1, "internal error: ValueError: boom"), first=False)]
    assert story(ends, run_dir)[0][:3] == ["rank 1 failed (exit code 1): internal error: ValueError: boom",
                                           "rank 0 failed too (exit code 1): error: rl iteration 2: NaN loss",
                                           "rank 2 failed alike (exit code 1)"]


def test_a_user_error_in_a_rank_is_exit_2_without_a_resume_line(run_dir):
    ends = [RankEnd(0, 2, RankReport(0, 2, "error: no space left on device: 'x'"), first=True),
            RankEnd(1, 143, _interrupted(1), first=False)]
    assert story(ends, run_dir) == (["rank 0 failed (exit code 2): error: no space left on device: 'x'",
                                     "rank 1: stopped because rank 0 failed"], 2)


def test_a_rank_signalled_alone_and_a_rank_gone_without_a_word(run_dir):
    alone = [RankEnd(0, 143, _interrupted(0), first=False), RankEnd(1, 143, _interrupted(1), first=True)]
    assert story(alone, run_dir)[0][:2] == [
        "rank 1 was stopped by SIGTERM sent to it alone: interrupted during flywheel round 1; resume with: turnforge "
        "train --resume R (plays the flywheel again from the BC checkpoint)", "rank 0: stopped because rank 1 was stopped"]
    silent = [RankEnd(0, 0, None, first=True), RankEnd(1, 3, None, first=True)]  # rank 0 had finished
    assert story(silent, run_dir)[0] == ["rank 1 exited with code 3 before it could say why (its own output above may)",
                                         f"the run's last checkpoint is intact; resume with: turnforge train --resume {run_dir}"]


def test_success_says_nothing_and_a_users_interrupt_is_rank_zeros_line(run_dir):
    assert story([RankEnd(0, 0, None, True), RankEnd(1, 0, None, True)], run_dir) == ([], 0)
    reports = {1: _interrupted(1, "at RL iteration 3 (checkpoint saved); resume with: x"),
               0: _interrupted(0, "at RL iteration 3 (checkpoint saved); resume with: y")}
    assert interrupted_story(reports, run_dir, signal.SIGINT) == (["interrupted at RL iteration 3 (checkpoint saved); resume with: y"], 130)
    assert interrupted_story({}, run_dir, signal.SIGTERM) == ([f"interrupted; resume with: turnforge train --resume {run_dir}"], 143)


def test_resume_lines(tmp_path):
    assert resume_lines(tmp_path / "absent") == [] and resume_lines(None) == []
    assert resume_lines(tmp_path) == [f"the run stopped before its first checkpoint; resume with: turnforge train --resume "
                                      f"{tmp_path} (starts it over)"]
    assert resume_lines(tmp_path, "at RL iteration 2; resume with: z") == ["the run stopped at RL iteration 2; resume with: z"]


def test_the_peek_sees_a_childs_end_and_leaves_it_to_be_reaped():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        assert _ended(child.pid) is None
        child.kill()
        deadline = time.time() + 30
        while _ended(child.pid) is None and time.time() < deadline:
            time.sleep(0.05)
        assert _ended(child.pid) == -signal.SIGKILL and _ended(child.pid) == -signal.SIGKILL  # not reaped by looking
        assert child.wait(timeout=5) == -signal.SIGKILL  # Popen (torch's agent) still gets its status
        while _ended(done.pid) is None and time.time() < deadline:
            time.sleep(0.05)
        assert _ended(done.pid) == 3 and done.wait(timeout=5) == 3
        assert _ended(done.pid) == 0  # reaped already: the agent's poll saw no failure there
    finally:
        child.kill()


def test_the_oom_counter_is_a_count_or_unknown():
    count = _oom_kills()
    assert count is None or count >= 0


def test_a_ranks_own_error_is_told_once_by_the_launcher(tmp_path):
    """Two real ranks under torch's agent, each failing at once with a user error (a command that
    does not exist): one line per rank from the launcher, with the exit code, and none from the
    ranks themselves, no traceback (torch's ``ChildFailedError`` included), exit 2."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    code = "import sys; from turnforge.app.launch import launch; sys.exit(launch(2, ['no-such-command'], threads=1))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
    assert all(line.startswith("rank ") for line in lines) and len(lines) == 2, proc.stderr
    assert re.fullmatch(r"rank [01] failed \(exit code 2\): error: no such command 'no-such-command'; valid commands: .*",
                        lines[0]), proc.stderr
    # the other rank: as fast (both ended before the agent looked), or stopped by the agent while it still started
    other = 1 - int(lines[0][5])
    assert lines[1] in (lines[0].replace(f"rank {1 - other}", f"rank {other}"), f"rank {other}: stopped because rank "
                        f"{1 - other} failed", f"rank {other} failed alike (exit code 2)"), proc.stderr
