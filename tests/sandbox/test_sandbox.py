"""Plain behaviour of turnforge.sandbox: results, files, stdin, output, errors and backends.
The attacks are in test_conformance.py."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import pytest

from turnforge.errors import UserError
from turnforge.sandbox import TRUNCATED, Limits, Result, Sandbox, SandboxError, UnsafeSandboxWarning


def test_runs_a_program_and_returns_its_result(make_sandbox):
    r = make_sandbox().run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.killed_reason) == (3, "out\n", "err\n", False, None)
    assert r.duration_s > 0 and not r.ok
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.exit_code = 0  # type: ignore[misc]


def test_files_land_in_the_work_dir_which_is_cwd_and_home(make_sandbox):
    files = {"main.py": "import os, pkg.util\nprint(os.getcwd(), os.environ['HOME'], pkg.util.X)\n",
             "pkg/__init__.py": "", "pkg/util.py": "X = 'é'\n"}
    r = make_sandbox().run(["python3", "main.py"], files=files)
    assert r.ok and r.stdout == "/sandbox/work /sandbox/work é\n", r


def test_stdin_is_fed_to_the_program(make_sandbox):
    big = "line\n" * 50_000  # larger than a pipe buffer
    r = make_sandbox().run(["python3", "-c", "import sys; d = sys.stdin.read(); print(len(d), d[:4])"], stdin=big)
    assert r.stdout == f"{len(big)} line\n"


def test_program_failures_are_results_not_errors(make_sandbox):
    crash = make_sandbox().run(["python3", "-c", "raise ValueError('boom')"])
    assert crash.exit_code == 1 and crash.stderr.strip().endswith("ValueError: boom")
    missing = make_sandbox().run(["no-such-program"])
    assert missing.exit_code == 127 and "no-such-program" in missing.stderr
    killed = make_sandbox().run(["sh", "-c", "kill -9 $$"])
    assert killed.exit_code == 137 and killed.killed_reason is None


def test_output_is_truncated_with_a_marker_and_decoded_with_replacement(make_sandbox):
    r = make_sandbox(max_output_bytes=8).run(["python3", "-c", "import sys; sys.stdout.buffer.write(b'ab\\xffcdefghijkl')"])
    assert r.stdout == "ab\ufffdcdefg" + TRUNCATED.format(limit=8)


def test_run_timeout_overrides_the_limit(make_sandbox):
    r = make_sandbox(timeout_s=30).run(["sleep", "10"], timeout=0.3)
    assert r.timed_out and r.killed_reason == "timeout" and r.exit_code == 137 and r.duration_s < 10  # not its sleep


@pytest.mark.parametrize("name", ["/etc/passwd", "../escape.py", "a/../../escape.py", "", ".", "a\0b"])
def test_bad_file_paths_are_rejected(name):
    with pytest.warns(UnsafeSandboxWarning):
        sandbox = Sandbox(backend="unsafe-none")
    with pytest.raises(UserError, match="must be relative to the work dir"):
        sandbox.run(["true"], files={name: "x"})


def test_a_path_cannot_be_both_file_and_directory():
    with pytest.warns(UnsafeSandboxWarning):
        sandbox = Sandbox(backend="unsafe-none")
    with pytest.raises(UserError, match="both a file and a directory"):
        sandbox.run(["true"], files={"a": "x", "a/b.py": "y"})


@pytest.mark.parametrize("field, value", [("cpu_s", 0), ("cpu_s", 1.5), ("timeout_s", -1.0), ("memory_mb", True), ("network", 1)])
def test_bad_limits_are_user_errors(field, value):
    with pytest.raises(UserError, match=f"Limits.{field}"):
        Limits(**{field: value})


def test_unknown_backend_is_a_user_error():
    with pytest.raises(UserError, match="'bwrap', 'unsafe-none'"):
        Sandbox(backend="docker")


def test_unsafe_backend_warns_loudly_every_time_and_still_applies_limits(capfd):
    for _ in range(2):
        with pytest.warns(UnsafeSandboxWarning, match="WITHOUT isolation"):
            sandbox = Sandbox(Limits(max_output_bytes=100), backend="unsafe-none")
        assert "WARNING: turnforge.sandbox backend 'unsafe-none'" in capfd.readouterr().err
    r = sandbox.run(["sh", "-c", "cat data.txt; cat -; ulimit -c; sleep 60"], files={"data.txt": "hi\n"}, stdin="in\n", timeout=3.0)
    assert r.stdout == "hi\nin\n0\n" and r.killed_reason == "timeout"


@pytest.fixture()
def fake_bwrap(monkeypatch) -> Iterator[Callable[[str], Path]]:
    """``fake_bwrap(script)``: put a ``bwrap`` shell script first on PATH; returns its directory.
    Not under tmp_path: bwrap runs as uid 65534 when the caller is root, and must reach it."""
    made: list[Path] = []

    def make(script: str) -> Path:
        directory = Path(tempfile.mkdtemp(prefix="tf-fake-bwrap-"))
        made.append(directory)
        directory.chmod(0o755)
        (directory / "bwrap").write_text("#!/bin/sh\n" + script)
        (directory / "bwrap").chmod(0o755)
        monkeypatch.setenv("PATH", f"{directory}:{os.environ['PATH']}")
        return directory

    yield make
    for directory in made:
        shutil.rmtree(directory)


def test_missing_bwrap_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UserError, match="apt-get install -y bubblewrap"):
        Sandbox()


def test_bwrap_without_namespaces_is_a_user_error_naming_the_cause(fake_bwrap):
    message = "bwrap: No permissions to create new namespace, likely because the kernel does not allow non-privileged user namespaces."
    fake_bwrap(f'[ "$1" = --version ] && echo "bubblewrap 0.8.0" && exit 0\necho "{message}" >&2\nexit 1\n')
    with pytest.raises(UserError, match="cannot create the sandbox's namespaces here.*non-privileged user namespaces.*unprivileged_userns_clone"):
        Sandbox()


def test_old_bwrap_is_a_user_error(fake_bwrap):
    fake_bwrap('echo "bubblewrap 0.6.1"\n')
    with pytest.raises(UserError, match="bubblewrap 0.6.1 .* is too old"):
        Sandbox()


def test_bwrap_failing_at_run_time_is_a_sandbox_error(make_sandbox, fake_bwrap):
    """bwrap works when the Sandbox is created, then fails its set-up: SandboxError, with its message."""
    make_sandbox()  # skips where bwrap cannot run
    fake = fake_bwrap(f'[ -e "$(dirname "$0")/broken" ] || exec {shutil.which("bwrap")} "$@"\n'
                      'echo "bwrap: Can\'t mount proc on /newroot/proc: Operation not permitted" >&2\nexit 1\n')
    sandbox = Sandbox()
    assert sandbox.run(["true"]).ok
    (fake / "broken").touch()
    with pytest.raises(SandboxError, match="failed to start.*Can't mount proc"):
        sandbox.run(["true"])


def test_result_fields():
    assert [f.name for f in dataclasses.fields(Result)] == ["exit_code", "stdout", "stderr", "timed_out", "killed_reason", "duration_s"]


# ---------------------------------------------------------------- long-running programs (Sandbox.start)
def test_start_runs_a_server_with_pipes_env_and_binds_until_killed(make_sandbox):
    shared = Path(tempfile.mkdtemp(prefix="tf-bind-", dir="/tmp"))  # pytest's tmp_path is private to root; under /tmp as in CI
    shared.chmod(0o755)
    (shared / "data.txt").write_text("from the host")
    (shared / "data.txt").chmod(0o644)
    sb = make_sandbox()
    proc = sb.start(["sh", "-c", 'echo "$GREETING $(cat "$0")"; cat; echo oops >&2', str(shared / "data.txt")],
                    env={"GREETING": "hello"}, binds=(str(shared),))
    assert proc.stdout.readline() == b"hello from the host\n"
    proc.stdin.write(b"echoed\n")
    assert proc.stdout.readline() == b"echoed\n"
    assert proc.alive and proc.started() and proc.poll() is None
    proc.stdin.close()
    proc.proc.wait(timeout=10)
    assert proc.poll() == 0 and proc.stderr_tail() == "oops"  # the nonce is not shown
    proc.kill()
    proc.kill()  # idempotent
    assert not proc.alive and proc.stdout.closed
    shutil.rmtree(shared)


def test_start_of_a_missing_program_and_an_unreadable_bind(make_sandbox, tmp_path, monkeypatch):
    sb = make_sandbox()
    proc = sb.start(["no-such-program-xyz"])
    assert proc.proc.wait(timeout=10) != 0 and proc.started()  # the sandbox came up; the exec failed
    assert "no-such-program-xyz" in proc.stderr_tail()
    proc.kill()
    from turnforge.sandbox import bwrap

    monkeypatch.setattr(bwrap, "unreadable", lambda path: "/root")
    with pytest.raises(UserError, match=r"cannot read /root, needed to show /root/venv in the sandbox"):
        sb.start(["true"], binds=("/root/venv",))
    with pytest.raises(UserError, match=r"cannot show /sandbox/x in the sandbox: a bind must be an absolute path outside /sandbox"):
        sb.start(["true"], binds=("/sandbox/x",))


def test_a_started_sandbox_dies_with_the_process_not_the_thread_that_started_it(make_sandbox):
    import threading

    sb = make_sandbox()
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("proc", sb.start(["cat"])))
    t.start()
    t.join()  # bwrap's --die-with-parent follows the thread that forked it: spawned from a long-lived one
    proc = box["proc"]
    proc.stdin.write(b"still here\n")
    assert proc.stdout.readline() == b"still here\n"
    proc.kill()
