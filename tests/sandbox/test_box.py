"""The terminal box (``turnforge.sandbox.box``, ``shell.BwrapBox``): each guarantee is shown by an
attack that must fail, run through ``Box.exec`` as an agent would type it.

Attacks carry their own safety stops (small limits, short timeouts) so that a broken guarantee
fails the test without hurting the host. Host-side checks read /proc: a unique token in a
command line tells the box's processes apart from everything else on the machine.
"""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from turnforge.errors import UserError
from turnforge.sandbox import (
    BOXES,
    BoxSnapshot,
    BoxSpec,
    BwrapBox,
    ExecResult,
    SandboxError,
    open_box,
)
from turnforge.sandbox.box import BOX_LIMITS, TRUNCATED_MARK, OutputBuffer


@pytest.fixture()
def make_box(make_sandbox):
    """``make_box(workdir=..., env=..., extra_dirs=..., **limit_overrides)``: a started ``BwrapBox``, closed after
    the test; skips where bwrap cannot run (``make_sandbox`` checks)."""
    boxes = []

    def make(workdir: str = "/app", env: dict[str, str] | None = None, extra_dirs: tuple[str, ...] = (),
             **limits) -> BwrapBox:
        spec = BoxSpec(workdir=workdir, env=env or {}, extra_dirs=extra_dirs,
                       limits=dataclasses.replace(BOX_LIMITS, timeout_s=10.0, **limits))
        boxes.append(open_box(spec))
        return boxes[-1]

    yield make
    for box in boxes:
        box.close()


def ok(box, command: str, **kw) -> ExecResult:
    r = box.exec(command, **kw)
    assert r.exit_code == 0 and r.killed_reason is None and not r.timed_out, r
    return r


# --- isolation --------------------------------------------------------------------------------

def test_no_network(make_box, listener):
    box = make_box()
    r = box.exec("""python3 -c '
import socket, sys
print("IFACES", *sorted(n for _, n in socket.if_nameindex()))
for host, port in (("1.1.1.1", 53), ("127.0.0.1", int(sys.argv[1]))):
    try:
        socket.create_connection((host, port), timeout=3).close()
        print("CONNECTED", host)
    except OSError as err:
        print("BLOCKED", host, err.errno)
' """ + str(listener.port))
    # ENETUNREACH: no route out; ECONNREFUSED: the box's own loopback, where nobody listens
    assert r.output.splitlines() == ["IFACES lo", "BLOCKED 1.1.1.1 101", "BLOCKED 127.0.0.1 111"], r
    assert listener.accepted() == 0  # the host's loopback is not the box's


@pytest.mark.parametrize("where, writable", [
    ("/usr", False), ("/etc", False), ("/", False), ("/sandbox", False), ("/home", False),
    ("/home/user/proj", True), ("/home/user/proj/sub", True), ("/tmp", True),
])
def test_only_workspace_and_tmp_are_writable(make_box, token, where, writable):
    box = make_box(workdir="/home/user/proj")
    r = box.exec(f"mkdir -p /home/user/proj/sub; echo pwned > {where}/{token} && echo WROTE")
    assert ("WROTE" in r.output) == writable, r
    if not writable:
        assert "Read-only file system" in r.output, r
    assert not Path(where, token).exists()  # never on the host, not even /tmp: the box's /tmp is its own


def test_a_read_only_place_cannot_be_put_to(make_box):
    box = make_box()
    for path in ("/usr/x", "/etc/passwd", "../x", "/app", "/tmp"):
        with pytest.raises(UserError, match="cannot write|without '..'"):
            box.put({path: b"x"})


def test_pid_1_cannot_be_killed_and_kill_all_spares_the_box(make_box):
    box = make_box()
    ok(box, "cd /tmp && export X=1")
    r = box.exec("kill -9 1; kill -9 -1; echo SURVIVED")
    assert "SURVIVED" in r.output, r
    assert ok(box, "echo $X; pwd").output == "1\n/tmp\n"


# --- the shell ----------------------------------------------------------------------------------

def test_cwd_and_exports_persist(make_box):
    box = make_box(env={"GREETING": "hi"})
    r = ok(box, "cd /tmp && mkdir -p a/b && cd a/b && export X=1 && Y=2")
    assert r.cwd == "/tmp/a/b"
    r = ok(box, 'echo "$X $Y $GREETING"; pwd')
    assert r.output == "1 2 hi\n/tmp/a/b\n" and r.cwd == "/tmp/a/b"
    r = ok(box, "cd; pwd")  # HOME is the workspace
    assert r.output == "/app\n" and r.cwd == "/app"


def test_output_interleaves_stdout_and_stderr_and_reports_the_exit_code(make_box):
    box = make_box()
    r = box.exec("echo out; echo err >&2; echo out2; exit_with() { return $1; }; exit_with 3")
    assert (r.output, r.exit_code, r.timed_out, r.shell_restarted) == ("out\nerr\nout2\n", 3, False, False)
    syntax = box.exec('echo "unterminated')
    assert syntax.exit_code == 2 and "unexpected EOF" in syntax.output  # the shell lives on
    assert ok(box, "echo fine").output == "fine\n"


def test_stdin_is_dev_null(make_box):
    box = make_box()
    r = box.exec("read x; echo \"got=[$x]\"; cat; python3 -c 'input()' 2>&1 | tail -1", timeout_s=5)
    assert r.output == "got=[]\nEOFError: EOF when reading a line\n" and not r.timed_out, r
    assert r.seconds < 5


def test_timeout_kills_the_command_and_the_box_goes_on(make_box, token, survivors):
    box = make_box()
    ok(box, f"cd /tmp; python3 -c 'import time; time.sleep(60)' server-{token} &")  # started before: lives on
    r = box.exec(f"(setsid python3 -c 'import time; time.sleep(60)' daemon-{token} &); sleep 60; echo NOT-KILLED",
                 timeout_s=0.5)
    assert r.timed_out and r.killed_reason == "timeout" and not r.shell_restarted, r
    assert "NOT-KILLED" not in r.output and 0.5 <= r.seconds < 5
    time.sleep(0.1)
    assert survivors(f"daemon-{token}") == []  # its detached grandchild died with it
    assert len(survivors(f"server-{token}")) == 1  # the background process of an earlier command did not
    assert r.notice and "timed out" in r.notice
    assert ok(box, "pwd").output == "/tmp\n"


def test_builtin_loop_is_interrupted_and_the_shell_keeps_its_state(make_box):
    box = make_box()
    ok(box, "cd /tmp && export X=1 && Y=2 && f() { echo f-here; }")
    r = box.exec("while true; do :; done; echo NOT-REACHED", timeout_s=0.5)  # no process to kill: the shell itself spins
    assert r.timed_out and not r.shell_restarted and "NOT-REACHED" not in r.output, r
    # In a function, an interrupt returns from the function; the next one, 50 ms on, from the command.
    nested = box.exec("g() { while :; do :; done; }; g; sleep 60; echo NOT-REACHED", timeout_s=0.5)
    assert nested.timed_out and not nested.shell_restarted and "NOT-REACHED" not in nested.output, nested
    assert ok(box, 'echo "$X $Y"; f; pwd').output == "1 2\nf-here\n/tmp\n"  # the same shell: even functions


def test_hung_shell_is_restarted_with_cwd_and_exports(make_box):
    box = make_box()
    ok(box, "cd /tmp && export X=1 && Y=2")
    r = box.exec("trap '' USR1; while true; do :; done", timeout_s=0.5)  # deaf to the interrupt: only a restart helps
    assert r.timed_out and r.shell_restarted and r.killed_reason == "timeout", r
    assert r.cwd == "/tmp" and "restarted" in r.notice
    assert ok(box, 'echo "$X|$Y"; pwd').output == "1|\n/tmp\n"  # exports and cwd kept; a plain variable is not
    gone = box.exec("cd /; export Z=3; exit 7")  # the shell ends itself: the state before this command is kept
    assert gone.exit_code == 7 and gone.shell_restarted and not gone.timed_out and gone.cwd == "/tmp", gone
    assert ok(box, 'echo "$X|$Z"; pwd').output == "1|\n/tmp\n"
    r = box.exec("sleep 60", timeout_s=0.3)  # and the new shell can be interrupted in its turn
    assert r.timed_out and not r.shell_restarted, r


def test_shell_killed_between_commands_is_replaced(make_box):
    box = make_box()
    ok(box, "cd /tmp && export X=1")
    ok(box, "(sleep 0.2; kill -9 $$) >/dev/null 2>&1 &")  # $$: the shell, killed after this command returned
    time.sleep(0.6)
    r = ok(box, 'echo "$X"; pwd')
    assert r.shell_restarted and r.output == "1\n/tmp\n", r


def test_exit_status_of_the_previous_command_is_kept(make_box):
    box = make_box()
    assert box.exec("false").exit_code == 1
    assert ok(box, "echo $?").output == "1\n"


def test_nul_byte_in_a_command_is_refused_without_running(make_box):
    box = make_box()
    r = box.exec("touch /app/x\0; echo")
    assert r.exit_code == 2 and "NUL" in r.output
    assert ok(box, "ls /app").output == ""


# --- resources --------------------------------------------------------------------------------

def test_fork_bomb_is_contained(make_box):
    box = make_box(max_processes=32)
    bomb = box.exec(":(){ :|:& };:", timeout_s=5)
    after = box.exec("echo ALIVE; ls /proc | grep -c '^[0-9]'", timeout_s=5)
    said = [r.killed_reason for r in (bomb, after)]
    assert "processes" in said, (bomb, after)  # the bomb's result, or at worst the next one, says so
    last = ok(box, "echo ALIVE; ls /proc | grep -c '^[0-9]'", timeout_s=5)
    assert last.output.startswith("ALIVE\n") and int(last.output.split()[1]) <= 5, last  # pid 1, shell, ls, grep
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still fork


def test_disk_fill_hits_the_cap(make_box):
    box = make_box(disk_mb=8)
    r = box.exec("dd if=/dev/zero of=big bs=1M count=10000 2>&1 | tail -1; ls -l big")
    assert r.killed_reason == "disk", r
    size = int(box.exec("stat -c %s big").output)
    assert size <= 8 * 2**20
    assert "disk" in r.notice
    tmp = box.exec("yes > /tmp/f; stat -c %s /tmp/f")
    assert tmp.killed_reason == "disk" and int(tmp.output.split()[-1]) <= 8 * 2**20, tmp
    assert ok(box, "rm big /tmp/f; echo ok > small; cat small").output == "ok\n"


def test_memory_cap(make_box):
    box = make_box(memory_mb=256)
    r = box.exec("python3 -c 'x = bytearray(1 << 30)'")
    assert r.exit_code == 1 and r.output.strip().endswith("MemoryError") and r.killed_reason == "memory", r


def test_output_over_budget_is_cut(make_box):
    box = make_box(max_output_bytes=1000)
    r = box.exec("seq 100000")
    total = len("".join(f"{i}\n" for i in range(1, 100001)))
    mark = TRUNCATED_MARK.format(omitted=total - 1000)
    assert r.truncated and r.exit_code == 0 and mark in r.output, r.output[:200]
    head, tail = r.output.split(mark)
    assert head.startswith("1\n2\n3\n") and tail.endswith("99999\n100000\n") and len(head) + len(tail) == 1000
    flood = box.exec("yes", timeout_s=30)  # never ends by itself: stopped by the amount, long before the timeout
    assert flood.killed_reason == "output" and flood.truncated and not flood.timed_out and flood.seconds < 20, flood


# --- files and snapshots ------------------------------------------------------------------------

def test_put_get_archive(make_box):
    box = make_box()
    box.put({"bin/run.sh": b"#!/bin/sh\necho ran \"$@\"\n", "/tmp/data.bin": bytes(range(256)), "é.txt": "é".encode()},
            modes={"bin/run.sh": 0o755})
    assert ok(box, "bin/run.sh x; stat -c '%a' bin/run.sh /tmp/data.bin").output == "ran x\n755\n644\n"
    got = box.get(["bin/run.sh", "/tmp/data.bin", "é.txt", "missing", "bin"])
    assert got == {"bin/run.sh": b"#!/bin/sh\necho ran \"$@\"\n", "/tmp/data.bin": bytes(range(256)), "é.txt": "é".encode()}
    with tarfile.open(fileobj=io.BytesIO(box.archive("/app/bin"))) as tar:
        assert sorted(tar.getnames()) == [".", "./run.sh"] and tar.getmember("./run.sh").mode == 0o755
    with pytest.raises(FileNotFoundError):
        box.archive("nothing-here")


def test_snapshot_restore_round_trip(make_box):
    box = make_box()
    box.put({"run.sh": b"#!/bin/sh\necho run\n", "src/a.txt": b"A", "/tmp/t.txt": b"T"}, modes={"run.sh": 0o755})
    ok(box, "cd src && export X=1 && export 'W=two\nlines'")
    snap = box.snapshot()
    assert snap.cwd == "/app/src" and snap.env["X"] == "1" and snap.env["W"] == "two\nlines" and "PWD" not in snap.env
    with tarfile.open(fileobj=io.BytesIO(snap.files)) as tar:
        assert {"app/run.sh", "app/src/a.txt", "tmp/t.txt"} <= set(tar.getnames())

    ok(box, "cd /; unset X; export Z=9; rm /app/run.sh; echo new > /app/new.txt; touch /tmp/new; sleep 60 &")
    box.restore(snap)
    r = ok(box, 'pwd; echo "X=$X Z=$Z W=$W"; ls -A /app /tmp; stat -c %a /app/run.sh; ls /proc | grep -c "^[0-9]"')
    assert r.output == "/app/src\nX=1 Z= W=two\nlines\n/app:\nrun.sh\nsrc\n\n/tmp:\nt.txt\n755\n4\n", r.output  # sleep gone
    other = make_box()  # a snapshot starts another box of the same workdir in the same state
    other.restore(snap)
    assert ok(other, "pwd; cat a.txt /tmp/t.txt; ./../run.sh").output == "/app/src\nAT" + "run\n"
    with pytest.raises(UserError, match="workdir"):
        make_box(workdir="/work").restore(snap)


def test_extra_dirs_are_writable_and_go_into_snapshots(make_box):
    episode = make_box()
    episode.put({"main.py": b"print(1)\n"})
    snap = episode.snapshot()
    verifier = make_box(extra_dirs=("/tests", "/logs"))
    verifier.restore(snap)  # an episode's workspace in a box with more places
    verifier.put({"/tests/test.sh": b"#!/bin/sh\npython3 /app/main.py > /logs/out\n"}, {"/tests/test.sh": 0o755})
    assert ok(verifier, "/tests/test.sh && cat /logs/out && touch /elsewhere 2>&1 | grep -c Read-only").output == "1\n1\n"
    assert verifier.get(["/logs/out"]) == {"/logs/out": b"1\n"}
    back = verifier.snapshot()
    with tarfile.open(fileobj=io.BytesIO(back.files)) as tar:
        assert {"app/main.py", "tests/test.sh", "logs/out"} <= set(tar.getnames())
    with pytest.raises(UserError, match="extra_dirs"):
        episode.restore(back)  # where would /logs go?
    with pytest.raises(UserError, match="inside one another"):
        BoxSpec(workdir="/app", extra_dirs=("/app/logs",))


def test_snapshot_is_backend_neutral_data():
    snap = BoxSnapshot("/app", b"", "/app", {"X": "1"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.cwd = "/"  # type: ignore[misc]


# --- lifetime ---------------------------------------------------------------------------------

def _fds() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the listdir's own fd
    return out


def _ours(names: set[str]) -> set[str]:
    return {n for n in names if n.startswith("turnforge") and not n.startswith("turnforge-start-gate")}


def test_close_leaves_nothing(make_sandbox, token, survivors):
    tmp_before, fds_before = set(os.listdir(tempfile.gettempdir())), _fds()
    box = BwrapBox(BoxSpec())
    ok(box, f"python3 -c 'import time; time.sleep(60)' {token} & sleep 60 &")
    pid1 = box._pid1
    assert len(survivors(token)) == 1  # the check sees a box's process while it runs
    assert " /app " in Path(f"/proc/{pid1}/mountinfo").read_text()  # and its workspace mount
    box.close()
    box.close()  # idempotent
    assert survivors(token) == []
    assert not Path(f"/proc/{pid1}").exists() and not Path(f"/proc/{box._proc.pid}").exists()  # pid 1 and bwrap
    assert _fds() == fds_before  # no pipe, pidfd or temp file left open
    assert _ours(set(os.listdir(tempfile.gettempdir()))) <= _ours(tmp_before)
    with pytest.raises(SandboxError, match="closed"):
        box.exec("true")


@pytest.mark.parametrize("ctl_fd", [97, 98, 99])
def test_any_fd_number_of_the_control_pipe_works(make_sandbox, ctl_fd):
    """A busy host process (64 boxes in threads) has a hundred fds open: the control pipe passed
    into the box can be one of the fds its supervisor uses for itself."""
    held = []
    try:
        while (fd := os.open("/dev/null", os.O_RDONLY)) < ctl_fd - 2:  # fill every fd below ctl_fd - 1
            held.append(fd)
        held.append(fd)
        if fd != ctl_fd - 2:
            pytest.skip(f"fd {ctl_fd - 1} is taken already")
        with BwrapBox(BoxSpec()) as box:  # its os.pipe(): read end ctl_fd - 1, write end (passed in) ctl_fd
            assert box._ctl_fd == ctl_fd - 1
            assert ok(box, "echo hi").output == "hi\n"
    finally:
        for fd in held:
            os.close(fd)


def test_context_manager_closes(make_sandbox, token, survivors):
    with open_box(BoxSpec()) as box:
        ok(box, f"python3 -c 'import time; time.sleep(60)' {token} &")
    assert survivors(token) == []


# --- plain pieces -----------------------------------------------------------------------------

def test_output_buffer_keeps_head_and_tail():
    buf = OutputBuffer(10)
    for chunk in (b"0123", b"456789", b"abcdefghij" * 3, b"XYZ"):
        buf.add(chunk)
    assert buf.total == 43 and buf.truncated
    assert buf.text() == "01234" + TRUNCATED_MARK.format(omitted=33) + "hijXYZ"[-5:]
    small = OutputBuffer(10)
    small.add(b"ab\xffc")
    assert small.text() == "ab\ufffdc" and not small.truncated


@pytest.mark.parametrize("workdir", ["app", "/", "/usr/app", "/tmp/x", "/sandbox", "/app/../etc", "/app/"])
def test_spec_rejects_bad_workdirs(workdir):
    with pytest.raises(UserError, match="workdir"):
        BoxSpec(workdir=workdir)


def test_spec_rejects_bad_env():
    with pytest.raises(UserError, match="variable name"):
        BoxSpec(env={"1X": "a"})
    with pytest.raises(UserError, match="NUL"):
        BoxSpec(env={"X": "a\0b"})


def test_registry(make_sandbox):
    assert BOXES["bwrap"] is BwrapBox and BwrapBox.name == "bwrap" and BwrapBox.unavailable() is None
    with pytest.raises(UserError, match="'bwrap'"):
        open_box(BoxSpec(), backend="docker")
