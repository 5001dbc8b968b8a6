"""Run one command with capped output and a wall-clock deadline, and tell the program's own
failure (a ``Result``) apart from the sandbox's (``SandboxError``).

The command is ``prefix + [/bin/sh -c START_SCRIPT nonce] + program``: ``prefix`` is the bwrap
command line (empty for the unsafe backend) and ``program`` is ``prlimit ... -- argv``. Once the
sandbox is set up, the start script writes a fresh random nonce to stderr and execs the
program. No nonce means the sandbox failed before the program ran, whatever the stderr says:
the program cannot fake an infrastructure failure (say, by printing ``bwrap: ...``), because
the nonce is written before it starts. The nonce is removed from the ``Result``.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import selectors
import signal
import subprocess
import tempfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

from turnforge.sandbox.limits import Limits, Result, SandboxError

START_SCRIPT = 'printf %s "$0" >&2 && exec "$@"'  # $0: the nonce
TRUNCATED = "\n[turnforge.sandbox: output truncated at {limit} bytes]\n"
GRACE_S = 1.0  # after a kill or the program's exit: how long to wait for its pipes to close
CHUNK = 1 << 16
_MEMORY_ERROR = re.compile(r"^MemoryError\b")


def execute(
    prefix: list[str],
    program: list[str],
    *,
    stdin: bytes,
    timeout_s: float,
    limits: Limits,
    env: dict[str, str],
    cwd: str = "/",
    pass_fds: tuple[int, ...] = (),
) -> Result:
    """Run ``prefix + start script + program``; raise ``SandboxError`` if the program never started."""
    nonce = secrets.token_hex(16)
    argv = [*prefix, "/bin/sh", "-c", START_SCRIPT, nonce, *program]
    cap = limits.max_output_bytes
    start = time.monotonic()
    try:
        # A new session: the timeout kills the whole process group (bwrap, or the unsafe program's).
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=pass_fds, cwd=cwd, env=env, start_new_session=True,
        )
    except OSError as err:
        raise SandboxError(f"cannot start {argv[0]}: {err}") from err
    try:
        out, err, killed = _pump(proc, stdin, start + timeout_s, (cap, cap + len(nonce)))
    except BaseException:  # e.g. KeyboardInterrupt: take the sandbox down with us
        _kill_group(proc.pid)
        proc.wait()
        raise
    proc.wait()
    duration = time.monotonic() - start
    exit_code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    started = err.find(nonce.encode())
    if started < 0:
        what = f"did not start within {timeout_s:g} s" if killed == "timeout" else f"failed to start (exit {exit_code})"
        lines = _text(err, cap).strip().splitlines()
        raise SandboxError(f"the sandbox {what}: {lines[0] if lines else 'no message'}")
    stderr = _text(err[:started] + err[started + len(nonce):], cap)
    return Result(
        exit_code=exit_code,
        stdout=_text(out, cap),
        stderr=stderr,
        timed_out=killed == "timeout",
        killed_reason=killed or _limit_hit(exit_code, stderr),
        duration_s=duration,
    )


def _pump(proc: subprocess.Popen, stdin: bytes, deadline: float, caps: tuple[int, int]) -> tuple[bytes, bytes, str | None]:
    """Feed stdin and read stdout/stderr (keeping at most ``cap + 1`` bytes of each) until the
    process has exited and its pipes are closed. Kills the process group at ``deadline``
    ("timeout") or when a stream passes its cap ("output"); returns both outputs and that reason."""
    assert proc.stdin and proc.stdout and proc.stderr
    in_fd, out_fd, err_fd = proc.stdin.fileno(), proc.stdout.fileno(), proc.stderr.fileno()
    buffers = {out_fd: bytearray(), err_fd: bytearray()}
    cap_of = {out_fd: caps[0], err_fd: caps[1]}
    pidfd = os.pidfd_open(proc.pid)
    sel = selectors.DefaultSelector()
    for fd in (out_fd, err_fd, pidfd):
        sel.register(fd, selectors.EVENT_READ)
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(in_fd, False)
        sel.register(in_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    open_streams, exited, closing = {out_fd, err_fd}, False, False
    killed: str | None = None
    try:
        while open_streams or not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if closing:  # grace over: pipes held open by leftovers of an exited program
                    break
                killed, closing, deadline = "timeout", True, time.monotonic() + GRACE_S
                _kill_group(proc.pid)
                continue
            for key, _ in sel.select(remaining):
                if key.fd == pidfd:
                    sel.unregister(pidfd)
                    exited, closing, deadline = True, True, min(deadline, time.monotonic() + GRACE_S)
                elif key.fd == in_fd:
                    pending = _feed(in_fd, pending)
                    if not pending:
                        sel.unregister(in_fd)
                        proc.stdin.close()
                elif chunk := os.read(key.fd, CHUNK):
                    buf, cap = buffers[key.fd], cap_of[key.fd]
                    buf += chunk[: cap + 1 - len(buf)]
                    if len(buf) > cap and killed is None and not exited:
                        killed, closing, deadline = "output", True, time.monotonic() + GRACE_S
                        _kill_group(proc.pid)
                else:
                    sel.unregister(key.fd)
                    open_streams.discard(key.fd)
    finally:
        if open_streams:
            _kill_group(proc.pid)
        sel.close()
        os.close(pidfd)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()
    return bytes(buffers[out_fd]), bytes(buffers[err_fd]), killed


def _feed(fd: int, pending: memoryview) -> memoryview:
    """Write what the pipe takes now; the rest is returned (nothing once the reader is gone)."""
    try:
        return pending[os.write(fd, pending[:CHUNK]):]
    except BrokenPipeError:
        return pending[:0]


def _kill_group(pgid: int) -> None:
    """SIGKILL the process group. For bwrap that is bwrap itself; its pid-namespace init dies with
    it (--die-with-parent), and the kernel then kills every process left in the namespace."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _text(data: bytes, limit: int) -> str:
    text = data[:limit].decode("utf-8", "replace")
    return text + TRUNCATED.format(limit=limit) if len(data) > limit else text


def _limit_hit(exit_code: int, stderr: str) -> str | None:
    """The limit a program that ended by itself ran into, as far as its exit tells.

    bwrap reports death by signal N as exit 128 + N, so a program that calls exit(152) reads as
    killed by SIGXCPU ("cpu"); one that catches SIGXCPU dies of SIGKILL a second later (137, no
    reason: bwrap's exit carries no CPU time to tell it from other kills). "memory" is best
    effort: RLIMIT_AS makes allocations fail rather than killing, so it is reported only for
    Python's uncaught ``MemoryError`` (the last line of stderr).
    """
    if exit_code == 128 + signal.SIGXCPU:
        return "cpu"
    if exit_code == 128 + signal.SIGXFSZ:
        return "file_size"
    lines = stderr.strip().splitlines()
    if exit_code != 0 and lines and _MEMORY_ERROR.match(lines[-1]):
        return "memory"
    return None


class SandboxProcess:
    """A program that keeps running (an MCP server) with its stdin and stdout as pipes.

    Its stderr goes to an unnamed temp file (capped by RLIMIT_FSIZE like any file it writes),
    read back by ``stderr_tail``. ``kill`` takes the whole sandbox down (the process group:
    bwrap, whose pid-namespace init takes every process in it along), reaps it and closes
    every pipe and file; it is idempotent, and a ``weakref.finalize`` calls it when the
    object is collected or the interpreter exits. bwrap's ``--die-with-parent`` ends the
    sandbox when the process that started it dies.
    """

    def __init__(self, proc: subprocess.Popen, stderr_file, nonce: str) -> None:
        self.proc, self._stderr, self._nonce = proc, stderr_file, nonce
        assert proc.stdin is not None and proc.stdout is not None
        self.stdin, self.stdout = proc.stdin, proc.stdout
        self._finalizer = weakref.finalize(self, _kill_and_close, proc, stderr_file)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        """The exit code (128 + N for signal N), or None while it runs."""
        code = self.proc.poll()
        return None if code is None else (code if code >= 0 else 128 - code)

    def started(self) -> bool:
        """Whether the sandbox came up and the program was started (the nonce was written)."""
        return self._nonce.encode() in self._read_stderr()

    def stderr_tail(self, lines: int = 1) -> str:
        """The last ``lines`` non-empty lines of its stderr so far (the nonce removed)."""
        text = self._read_stderr().replace(self._nonce.encode(), b"").decode("utf-8", "replace")
        kept = [line for line in text.splitlines() if line.strip()]
        return "\n".join(kept[-lines:])

    def _read_stderr(self) -> bytes:
        """Its stderr so far: the head (where the nonce is) and, when long, the tail. ``pread``
        leaves the file offset it shares with the program alone."""
        if self._stderr.closed:
            return b""
        fd, size = self._stderr.fileno(), os.fstat(self._stderr.fileno()).st_size
        if size <= 2 * CHUNK:
            return os.pread(fd, size, 0)
        return os.pread(fd, CHUNK, 0) + b"\n" + os.pread(fd, CHUNK, size - CHUNK)

    def kill(self) -> None:
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and self.proc.poll() is None


def _kill_and_close(proc: subprocess.Popen, stderr_file) -> None:
    _kill_group(proc.pid)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL was ignored (uninterruptible sleep)
        pass
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()
    stderr_file.close()


@functools.cache
def _spawner() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="turnforge-sandbox-spawner")


def spawn(prefix: list[str], program: list[str], *, env: dict[str, str], cwd: str = "/",
          pass_fds: tuple[int, ...] = ()) -> SandboxProcess:
    """Start ``prefix + start script + program`` in a new session, with pipes to its stdin and
    stdout; ``SandboxError`` if it cannot be started at all."""
    nonce = secrets.token_hex(16)
    argv = [*prefix, "/bin/sh", "-c", START_SCRIPT, nonce, *program]
    stderr_file = tempfile.TemporaryFile(mode="a+b")  # O_APPEND: reads never move its writes
    try:
        # Started from one long-lived thread: bwrap's --die-with-parent (PR_SET_PDEATHSIG) fires
        # when the *thread* that forked it exits, and a caller's worker thread may end first.
        proc = _spawner().submit(
            subprocess.Popen, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr_file,
            pass_fds=pass_fds, cwd=cwd, env=env, start_new_session=True, bufsize=0,
        ).result()
    except OSError as err:
        stderr_file.close()
        raise SandboxError(f"cannot start {argv[0]}: {err}") from err
    return SandboxProcess(proc, stderr_file, nonce)
