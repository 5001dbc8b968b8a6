"""``BwrapBox``: the terminal ``Box`` on bubblewrap, one persistent bash per episode.

Inside the box (bwrap's view, see ``bwrap.py``: read-only /usr and a few /etc files, own user,
pid, network, ipc and uts namespaces, uid 65534, no capabilities, a scrubbed environment):

- the workspace ``spec.workdir`` (e.g. /app) is a private tmpfs of ``disk_mb``, as is each of
  ``spec.extra_dirs``, /tmp (a link to /sandbox/tmp) and /dev/shm; nothing else is writable;
- pid 1 is a small bash supervisor: it starts the shell (``bash --noprofile --norc`` reading
  commands on its stdin) and a new one whenever it ends. No process of the box can signal
  pid 1, and when it dies the kernel kills every other process of the box;
- rlimits (``prlimit``) cap each process's CPU time, address space and file size, and the
  processes and threads of the whole box (RLIMIT_NPROC counts per box: its own user namespace).

Protocol: a command goes to the shell as one line, ``__tf_c=$'<command>'; . /sandbox/command``
(a read-only file holding ``eval -- "$__tf_c"``) with stdin from /dev/null, then an epilogue
that writes ``export -p`` and a frame ``\\n<nonce>:done:<status>:<cwd>:<nonce>\\n`` to fd 99,
the shell's control pipe. Commands write to one output pipe (stdout and stderr) and run with fd
99 closed; once the frame is in, the output pipe is drained of what it holds. The nonce is fresh
per call, so no output ends a command early by accident. Files move as tar streams: in on the
shell's stdin after the line (``head -c N | tar -x``), out on fd 99. Nothing of this lives in
the workspace; the host keeps the last cwd and ``export -p`` for a new shell.

Ending a command (timeout, or ``OUTPUT_KILL_BYTES`` printed) works like Ctrl-C: the shell gets
SIGUSR1, whose trap (``return``) ends the sourced command, the rest of its command line
included; then every process that was not there before the command (its children, their
daemons) is SIGKILLed, and again every 50 ms (a trap in a shell function returns from that
function only) for ``GRACE_S``. A shell that still does not answer (it ignores the trap) is
killed, and the supervisor's new shell gets the last known cwd and exports
(``shell_restarted``; unexported variables and functions are lost). Background processes of
earlier commands (a server) live on, unless a command's leftovers are a fork bomb (the box
reaches its process limit, or they took half the room left): then every process but pid 1,
the shell and those there before the command is killed (``killed_reason="processes"``).

Guarantees, each shown by an attack in ``tests/sandbox/test_box.py``: no network
(``test_no_network``); only the workspace and /tmp are writable
(``test_only_workspace_and_tmp_are_writable``); cwd and variables persist
(``test_cwd_and_exports_persist``); a fork bomb is contained (``test_fork_bomb_is_contained``);
the disk cap holds (``test_disk_fill_hits_the_cap``); a timeout ends the whole command line and
its processes, and the box goes on (``test_timeout_kills_the_command_and_the_box_goes_on``,
``test_builtin_loop_is_interrupted_and_the_shell_keeps_its_state``); a deaf shell is restarted
with cwd and exports (``test_hung_shell_is_restarted_with_cwd_and_exports``); commands get no
stdin (``test_stdin_is_dev_null``); output is cut (``test_output_over_budget_is_cut``);
snapshot/restore round-trips (``test_snapshot_restore_round_trip``); ``close`` leaves no
process, mount, fd or temp file (``test_close_leaves_nothing``).
"""

from __future__ import annotations

import os
import re
import secrets
import select
import selectors
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from turnforge.errors import UserError
from turnforge.sandbox import bwrap
from turnforge.sandbox.box import (
    Box,
    BoxSnapshot,
    BoxSpec,
    ExecResult,
    OutputBuffer,
    box_path,
    check_mode,
    pack,
    register,
    regular_files,
    writable_path,
)
from turnforge.sandbox.limits import MB, SandboxError, prlimit_argv
from turnforge.sandbox.process import SandboxProcess, spawn
from turnforge.sandbox.sandbox import Sandbox

CTL_FD = 99  # the shell's control pipe (frames, tar streams); commands run with it closed
RUNNER = "/sandbox/command"  # read-only; sourced to run a command, so that the trap's ``return`` ends it
INTERRUPT = signal.SIGUSR1  # the shell's trap: return from the command being run
GRACE_S = 1.0  # how long a command past its end is interrupted (every 50 ms) before its shell counts as deaf
START_TIMEOUT_S = 30.0  # the box's start, or a shell's restart, up to its first frame
OP_TIMEOUT_S = 120.0  # put/get/archive/snapshot/restore
OUTPUT_KILL_BYTES = 16 * MB  # a command that printed this much is ended (killed_reason "output")
DRAIN_BYTES = 4 * MB  # after a command's frame: at most this much more is read from the output pipe
SETTLE_S = 0.5  # a command that left new background processes: watched for a fork bomb until their
BOMB_WATCH_S = 2.0  # number has not grown for SETTLE_S, at most this long (a loaded host forks slowly)
CHUNK = 1 << 16
FULL_BYTES = 64 * 1024  # a tmpfs with less free space than this is full
_MEMORY = re.compile(rb"MemoryError|Cannot allocate memory|std::bad_alloc|[Oo]ut of memory")
_UNSAFE = re.compile(rb"[^\x20-\x26\x28-\x5b\x5d-\x7e]")  # all but printable ASCII, ' and \
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what bash exports (not BASH_FUNC_f%%, an exported function)

# pid 1 of the box. $0: the box's nonce, $1: the control pipe's fd as passed in (any number, 97
# to 99 included: a busy host process has that many open). fd 98 keeps the command pipe (a
# background job's stdin would be /dev/null otherwise); the supervisor's own messages (a killed
# shell's "Killed") go nowhere, the shell's stderr to the output pipe.
SUPERVISOR = r"""
exec 99>&"$1" || exit 111
[ "$1" = 99 ] || eval "exec $1>&-"
exec 98<&0 97>&1 2>/dev/null
while :; do
  bash --noprofile --norc <&98 98<&- 2>&97 97>&- &
  builtin printf '\n%s:shell:%d:%s\n' "$0" "$!" "$0" >&99
  wait "$!"
  builtin printf '\n%s:died:%d:%s\n' "$0" "$?" "$0" >&99
done
"""

# Run first in every new shell: the trap that ends a command, and what gives a command $? of the last.
SHELL_INIT = b"trap 'return 130 2>/dev/null' USR1; __tf_status() { return \"${1:-0}\"; }; "


def quote(data: bytes) -> bytes:
    """``data`` as one bash word, ``$'...'`` with every byte but printable ASCII escaped."""
    return b"$'" + _UNSAFE.sub(lambda m: b"\\x%02x" % m[0][0], data) + b"'"


def _epilogue(nonce: str, status: str = "$?") -> bytes:
    """Writes ``export -p`` (the done frame's payload), then the frame with ``status`` and cwd,
    to fd 99; set -x traces of it go nowhere."""
    return (f"{{ __tf_s={status}; unset -v __tf_c; export -p >&{CTL_FD}; "
            f"builtin printf '\\n%s:done:%d:%s:%s\\n' {nonce} \"$__tf_s\" \"$PWD\" {nonce} >&{CTL_FD}; }} 2>/dev/null\n"
            ).encode()


def _part(nonce: str, kind: str) -> str:
    """Bash that ends a part of an internal command's data on fd 99: a frame ``kind`` with ``$?``."""
    return f"builtin printf '\\n%s:{kind}:%d:%s\\n' {nonce} $? {nonce} >&{CTL_FD}; "


@dataclass(frozen=True)
class _Frame:
    kind: str  # the shell's: "done" or a part ("tar", "env", "missing"); the supervisor's: "shell", "died"
    fields: tuple[bytes, ...]  # done: status, cwd; a part: status; shell: its pid in the box; died: status
    payload: bytes  # what came on the control pipe before it


@dataclass(frozen=True)
class _Proc:
    pid: int  # on the host
    start: int  # start time in clock ticks since boot: (pid, start) names a process
    zombie: bool
    tasks: int  # its threads


@register("bwrap")
class BwrapBox(Box):
    """The bubblewrap backend (``apt-get install -y bubblewrap``, 0.8+). Creating one checks once
    per process that bwrap can create its namespaces (``UserError`` naming the fix if not); its
    start queues behind ``max_starting`` others on this machine (``StartGate``, default one per
    core); its commands do not queue."""

    def __init__(self, spec: BoxSpec | None = None, *, max_starting: int | None = None) -> None:
        self.spec = spec or BoxSpec()
        if not isinstance(self.spec, BoxSpec):
            raise UserError(f"BwrapBox needs a BoxSpec, got {type(self.spec).__name__}")
        limits = self.spec.limits
        self._sandbox = Sandbox(limits, max_starting=max_starting)  # finds bwrap, checks namespaces once per process
        self._budget = limits.max_output_bytes
        # At the process limit, give or take processes that are exiting: where a fork bomb hovers.
        self._crowded = limits.max_processes - max(2, limits.max_processes // 8)
        self._ctl_cap = (len(self.spec.writable) + 2) * limits.disk_mb * MB + MB  # writable places, /tmp, tar headers
        self._nonce = secrets.token_hex(8)  # of the supervisor's frames
        self._lock = threading.Lock()
        self._ctl = bytearray()  # control pipe bytes not parsed yet
        self._cwd = self.spec.workdir.encode()
        self._exports = b""  # ``export -p`` after the last command: what a new shell starts with
        self._pid1 = self._shell = 0  # host pids
        self._dead: str | None = None  # why the box is gone
        self._restarted = False  # the shell was restarted since the last result
        ctl_r, ctl_w = os.pipe()
        try:
            with self._sandbox.gate.slot(), bwrap.command(
                bwrap.launcher(), limits, {}, self.spec.binds, env=dict(self.spec.env), workdir=self.spec.workdir,
                extra_dirs=self.spec.extra_dirs, ro_files={RUNNER: b'eval -- "$__tf_c"\n'}, as_pid_1=True,
            ) as (prefix, fds):
                program = [*prlimit_argv("prlimit", limits, nproc=True), "bash", "--noprofile", "--norc", "-c",
                           SUPERVISOR, self._nonce, str(ctl_w)]
                self._proc: SandboxProcess = spawn(prefix, program, env={}, pass_fds=(*fds, ctl_w))
        except BaseException:
            os.close(ctl_r)
            raise
        finally:
            os.close(ctl_w)
        self._in, self._out, self._ctl_fd = self._proc.stdin.fileno(), self._proc.stdout.fileno(), ctl_r
        self._pidfd = os.pidfd_open(self._proc.pid)
        self._sel = selectors.DefaultSelector()  # control pipe and bwrap's exit; the output pipe during commands
        self._handles = _Handles(self._proc, [ctl_r, self._pidfd], self._sel)
        self._closer = weakref.finalize(self, self._handles.release)
        for fd in (self._in, self._out, self._ctl_fd):
            os.set_blocking(fd, False)
        self._sel.register(self._ctl_fd, selectors.EVENT_READ)
        self._sel.register(self._pidfd, selectors.EVENT_READ)
        try:
            self._await_shell(time.monotonic() + START_TIMEOUT_S)
        except SandboxError as err:
            self.close()
            raise SandboxError(f"the box did not start: {err}") from None

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            Sandbox()  # bwrap installed, recent enough, and able to create its namespaces here
        except UserError as err:
            return str(err)
        return None

    # --- the Box interface --------------------------------------------------------------------

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        if not isinstance(command, str):
            raise UserError(f"Box.exec needs the command as a str, got {type(command).__name__}")
        timeout = self.spec.limits.timeout_s if timeout_s is None else timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise UserError(f"Box.exec timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        start = time.monotonic()
        with self._lock:
            self._check_open()
            out = OutputBuffer(self._budget)
            if "\0" in command:  # a bash string ends at NUL: refuse rather than run a cut command
                out.add(b"bash: the command contains a NUL byte; nothing was run\n")
                return self._result(out, 2, False, None, start)
            self._revive_if_died()
            before = self._tree()
            reason = None
            if 1 + sum(p.tasks for p in before.values()) >= self._crowded:  # a fork bomb that got past _bombed
                self._kill(set())
                reason, before = "processes", self._tree()
            nonce = secrets.token_hex(8)
            self._send(b"__tf_c=" + quote(command.encode("utf-8", "replace"))
                       + f'; __tf_status "$__tf_s"; . {RUNNER} </dev/null {CTL_FD}>&-; '.encode() + _epilogue(nonce))
            frame = self._await(nonce, start + timeout, out, flood=OUTPUT_KILL_BYTES)
            timed_out = frame is None
            if not isinstance(frame, _Frame):
                reason = "timeout" if frame is None else "output"
                frame = self._interrupt(nonce, before, out)
            self._drain(out)
            status = _int(frame.fields[0])
            if frame.kind == "died":  # the shell ended (``exit``) or was killed: a new one in the last state
                self._restarted = True
                self._await_shell(time.monotonic() + START_TIMEOUT_S)
            else:
                self._cwd, self._exports = frame.fields[1], frame.payload
                if reason is None and self._bombed(before):
                    reason = "processes"
                    self._drain(out)  # what the bomb wrote before it was killed
            return self._result(out, status, timed_out, reason or self._limit_hit(status, out), start)

    def put(self, files: Mapping[str, bytes], modes: Mapping[str, int] | None = None) -> None:
        paths = {name: writable_path(name, self.spec) for name in files}
        unknown = set(modes or {}) - set(files)
        if unknown:
            raise UserError(f"Box.put modes name files not given in files: {sorted(unknown)}")
        if not files:
            return
        data = pack({paths[n]: files[n] for n in files}, {paths[n]: check_mode(n, m) for n, m in (modes or {}).items()})
        if len(data) > self._ctl_cap:
            raise UserError(f"Box.put of {len(data)} bytes cannot fit the box (disk_mb={self.spec.limits.disk_mb})")
        with self._lock:
            frames = self._op(lambda n: f"/usr/bin/head -c {len(data)} | /usr/bin/tar -x -p --keep-directory-symlink "
                                        f"-f - -C / 2>&{CTL_FD} >/dev/null; {_part(n, 'tar')}".encode(), payload=data)
        if frames["tar"].fields[0] != b"0":
            raise SandboxError(f"Box.put failed: {frames['tar'].payload.decode('utf-8', 'replace').strip()}")

    def get(self, paths: Iterable[str]) -> dict[str, bytes]:
        wanted = {str(box_path(p, self.spec.workdir)).lstrip("/"): p for p in paths}
        if not wanted:
            return {}
        names = " ".join(quote(name.encode()).decode() for name in wanted)
        with self._lock:
            frames = self._op(lambda n: f"/usr/bin/tar -c -f - -C / --dereference --no-recursion -- {names} "
                                        f"2>/dev/null >&{CTL_FD}; {_part(n, 'tar')}".encode())
        found = regular_files(frames["tar"].payload)
        return {wanted[name]: content for name, content in found.items() if name in wanted}

    def archive(self, path: str) -> bytes:
        where = quote(str(box_path(path, self.spec.workdir)).encode()).decode()
        with self._lock:
            frames = self._op(lambda n: f"if [ -d {where} ]; then /usr/bin/tar -c -f - -C {where} . 2>/dev/null "
                                        f">&{CTL_FD}; {_part(n, 'tar')} else {_part(n, 'missing')} fi; ".encode())
        if "tar" not in frames:
            raise FileNotFoundError(f"no directory {path!r} in the box")
        return frames["tar"].payload

    def snapshot(self) -> BoxSnapshot:
        places = " ".join(quote(p.lstrip("/").encode()).decode() for p in self.spec.writable)
        with self._lock:
            frames = self._op(lambda n: f"/usr/bin/tar -c -f - --numeric-owner -C / {places} -C /sandbox tmp "
                                        f"2>/dev/null >&{CTL_FD}; {_part(n, 'tar')}"
                                        f"/usr/bin/env -0 2>/dev/null >&{CTL_FD}; {_part(n, 'env')}".encode())
        if frames["tar"].fields[0] not in (b"0", b"1"):  # 1: a file changed while it was read
            raise SandboxError(f"Box.snapshot failed: tar exited with {frames['tar'].fields[0].decode()}")
        pairs = (item.decode("utf-8", "surrogateescape").partition("=") for item in frames["env"].payload.split(b"\0"))
        env = {k: v for k, _, v in pairs if _ENV_NAME.fullmatch(k) and k not in ("PWD", "OLDPWD", "SHLVL", "_")}
        return BoxSnapshot(self.spec.workdir, frames["tar"].payload,
                           frames["done"].fields[1].decode("utf-8", "surrogateescape"), env, self.spec.extra_dirs)

    def restore(self, snap: BoxSnapshot) -> None:
        if (not isinstance(snap, BoxSnapshot) or snap.workdir != self.spec.workdir
                or not set(snap.extra_dirs) <= set(self.spec.extra_dirs)):
            raise UserError(f"Box.restore needs a BoxSnapshot of a box with workdir {self.spec.workdir!r} and extra_dirs "
                            f"among {self.spec.extra_dirs}, got {getattr(snap, 'workdir', type(snap).__name__)!r} "
                            f"and {getattr(snap, 'extra_dirs', ())}")
        places = " ".join(quote(p.encode()).decode() for p in (*self.spec.writable, "/sandbox/tmp", "/dev/shm"))
        exports = b" ".join(key.encode() + b"=" + quote(value.encode("utf-8", "surrogateescape"))
                            for key, value in snap.env.items() if _ENV_NAME.fullmatch(key))
        with self._lock:
            self._check_open()
            self._revive_if_died()
            self._kill(set())  # every process but pid 1 and the shell; then the shell: a new one, nothing left over
            self._signal_shell(signal.SIGKILL)
            if self._await(self._nonce, time.monotonic() + START_TIMEOUT_S, None, until_died=True) is None:
                raise SandboxError(f"the box's shell did not end within {START_TIMEOUT_S:g} s of SIGKILL")
            self._await_shell(time.monotonic() + START_TIMEOUT_S, revive=False)
            frames = self._op(lambda n: SHELL_INIT + (
                f"{{ /usr/bin/chmod -R u+rwX -- {places}; /usr/bin/find {places} -mindepth 1 -delete; }} >/dev/null 2>&1; "
                f"/usr/bin/head -c {len(snap.files)} | /usr/bin/tar -x -p --keep-directory-symlink -f - -C / "
                f"2>&{CTL_FD} >/dev/null; {_part(n, 'tar')}unset -v $(compgen -e) 2>/dev/null; ").encode()
                + (b"export " + exports + b"; " if exports else b"")
                + b"builtin cd -- " + quote(snap.cwd.encode("utf-8", "surrogateescape")) + b" 2>/dev/null || builtin cd; ",
                payload=snap.files)
            self._cwd, self._exports = frames["done"].fields[1], frames["done"].payload
            self._restarted = False
        if frames["tar"].fields[0] != b"0":
            raise SandboxError(f"Box.restore failed: {frames['tar'].payload.decode('utf-8', 'replace').strip()}")

    def close(self) -> None:
        if self._closer.alive:
            self._dead = "it was closed"
            self._handles.kill()  # first, without the lock: a command running in another thread sees the box end
            with self._lock:
                self._closer()

    # --- the shell ----------------------------------------------------------------------------

    def _await_shell(self, deadline: float, *, revive: bool = True) -> None:
        """Wait for the supervisor's report of a new shell; then (``revive``) set it up: the trap,
        and for a later shell the last known exports and cwd (the first has the box's own)."""
        frame = self._await(self._nonce, deadline, None)
        if not isinstance(frame, _Frame) or frame.kind != "shell":
            raise SandboxError(f"no shell started within {START_TIMEOUT_S:g} s ({self._why_dead()})")
        if not self._pid1:
            kids = _children(self._proc.pid)
            if len(kids) != 1:
                raise SandboxError(f"the box's pid 1 is not the one child of bwrap (children: {kids})")
            self._pid1 = kids[0]
            self._handles.pid1fd = os.pidfd_open(self._pid1)
        self._shell = _host_pid(self._pid1, _int(frame.fields[0]))
        if revive:
            exports = b"unset -v $(compgen -e) 2>/dev/null; eval -- " + quote(self._exports) + b" 2>/dev/null; "
            frames = self._op(lambda n: SHELL_INIT + (exports if self._exports else b"")
                              + b"builtin cd -- " + quote(self._cwd) + b" 2>/dev/null || builtin cd; ")
            self._cwd, self._exports = frames["done"].fields[1], frames["done"].payload

    def _revive_if_died(self) -> None:
        """A shell that ended between calls (a background process killed it) is replaced first."""
        self._read_ctl()
        if self._parse("", until_died=True) is not None:
            self._restarted = True
            self._await_shell(time.monotonic() + START_TIMEOUT_S)

    def _op(self, line, *, payload: bytes = b"") -> dict[str, _Frame]:
        """Run an internal command, ``line(nonce)`` (its output goes nowhere; its data comes on fd
        99, each part ended by a ``_part`` frame), ``payload`` after it on the shell's stdin;
        return its frames by kind, up to the epilogue's "done"."""
        self._check_open()
        nonce = secrets.token_hex(8)
        self._send(line(nonce) + _epilogue(nonce) + payload)
        frames: dict[str, _Frame] = {}
        deadline = time.monotonic() + OP_TIMEOUT_S
        while "done" not in frames:
            frame = self._await(nonce, deadline, None)
            if not isinstance(frame, _Frame) or frame.kind == "died":
                raise SandboxError("the box's shell did not answer an internal command: "
                                   + ("it ended" if isinstance(frame, _Frame) else f"no answer in {OP_TIMEOUT_S:g} s"))
            frames[frame.kind] = frame
        return frames

    def _send(self, data: bytes) -> None:
        """Write ``data`` to the shell's stdin (nonblocking; the control pipe is read meanwhile)."""
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._in, view[:CHUNK]):]
            except BlockingIOError:
                self._pump(None, 0.05, writable=True)
            except BrokenPipeError:
                self._dead = self._dead or f"its shell's stdin closed ({self._why_dead()})"
                self._check_open()

    def _await(self, nonce: str, deadline: float, out: OutputBuffer | None, *, until_died: bool = False,
               flood: int | None = None) -> _Frame | str | None:
        """The next frame of ``nonce`` or of the supervisor, whichever comes first; None at
        ``deadline``; "output" once ``out`` holds more than ``flood`` bytes. ``until_died`` skips
        everything up to the supervisor's "died". Reads the output pipe into ``out`` meanwhile
        (given while a command runs: then nothing but frames is expected on fd 99)."""
        while True:
            frame = self._parse(nonce, until_died)
            if frame is not None:
                return frame
            if out is not None and len(self._ctl) > MB:
                del self._ctl[: len(self._ctl) - 4096]  # bytes no frame claims: a command writing to fd 99 itself
            if flood is not None and out is not None and out.total > flood:
                return "output"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._pump(out, remaining)

    def _pump(self, out: OutputBuffer | None, wait_s: float, writable: bool = False) -> None:
        """Wait up to ``wait_s`` for the control pipe (and the output pipe, or room in stdin) and
        read what came."""
        if out is not None:
            self._sel.register(self._out, selectors.EVENT_READ)
        if writable:
            self._sel.register(self._in, selectors.EVENT_WRITE)
        try:
            events = self._sel.select(wait_s)
        finally:
            if out is not None:
                self._sel.unregister(self._out)
            if writable:
                self._sel.unregister(self._in)
        for key, _ in events:
            if key.fd == self._pidfd:
                self._dead = self._dead or f"bwrap exited ({self._why_dead()})"
                self._check_open()
            elif key.fd == self._out and out is not None:
                self._read_into(out, CHUNK)
            elif key.fd == self._ctl_fd:
                self._read_ctl()

    def _read_ctl(self) -> None:
        while True:
            try:
                chunk = os.read(self._ctl_fd, 4 * CHUNK)
            except BlockingIOError:
                return
            if not chunk:
                self._dead = self._dead or f"its control pipe closed ({self._why_dead()})"
                self._check_open()
            self._ctl += chunk
            if len(self._ctl) > self._ctl_cap:
                self._ctl.clear()
                raise SandboxError(f"the box sent more than {self._ctl_cap} bytes on its control pipe")

    def _read_into(self, out: OutputBuffer, limit: int) -> int:
        try:
            chunk = os.read(self._out, min(limit, CHUNK))
        except BlockingIOError:
            return 0
        out.add(chunk)
        return len(chunk)

    def _drain(self, out: OutputBuffer) -> None:
        """What a command wrote is in the output pipe before its frame comes: read it (at most
        ``DRAIN_BYTES``: a background process may go on writing)."""
        left = DRAIN_BYTES
        while left > 0 and (n := self._read_into(out, left)):
            left -= n

    def _parse(self, nonce: str, until_died: bool) -> _Frame | None:
        """Take the first complete frame of ``nonce`` or of the supervisor off the control buffer
        (``until_died``: the supervisor's "died", dropping what comes before it)."""
        buf = self._ctl
        while True:
            found = [(at, tag) for tag in ((self._nonce,) if until_died else (nonce, self._nonce))
                     if (at := buf.find(f"\n{tag}:".encode())) >= 0]
            if not found:
                return None
            at, tag = min(found)
            head = at + len(tag) + 2
            end = buf.find(f":{tag}\n".encode(), head)
            if end < 0:
                return None
            kind, *fields = bytes(buf[head:end]).split(b":", 2 if tag == nonce else 1)
            frame = _Frame(kind.decode("ascii", "replace"), tuple(fields), bytes(buf[:at]))
            del buf[: end + len(tag) + 2]
            if not until_died or frame.kind == "died":
                return frame

    # --- processes ----------------------------------------------------------------------------

    def _tree(self) -> dict[tuple[int, int], _Proc]:
        """Every process of the box but pid 1 (host pids), by (pid, start time)."""
        found: dict[tuple[int, int], _Proc] = {}
        todo = _children(self._pid1)
        while todo:
            pid = todo.pop()
            info = _proc(pid)
            if info is not None:
                found[pid, info.start] = info
                todo += _children(pid)
        return found

    def _kill(self, spare: Mapping | set) -> None:
        """SIGKILL every process of the box but pid 1, the shell and those in ``spare``, again
        and again until none is left (a fork bomb forks while it is killed)."""
        for attempt in range(1000):
            targets = [key for key, p in self._tree().items() if key not in spare and not p.zombie and p.pid != self._shell]
            if not targets:
                return
            for pid, start in targets:
                _signal(pid, start, signal.SIGKILL)
            if attempt > 20:
                time.sleep(0.001)
        raise SandboxError("processes of the box survived 1000 rounds of SIGKILL")

    def _interrupt(self, nonce: str, before: Mapping, out: OutputBuffer) -> _Frame:
        """End a command that ran too long, like Ctrl-C (see the module docstring); the frame
        that ended it: its "done", or the supervisor's "died" of a deaf shell killed here."""
        stop = time.monotonic() + GRACE_S
        while True:
            self._signal_shell(INTERRUPT)  # first: the trap must be pending when the foreground child dies
            self._kill(before)
            frame = self._await(nonce, min(stop, time.monotonic() + 0.05), out)
            if isinstance(frame, _Frame):
                return frame
            if time.monotonic() >= stop:
                break
        self._signal_shell(signal.SIGKILL)
        frame = self._await(nonce, time.monotonic() + START_TIMEOUT_S, out, until_died=True)
        if not isinstance(frame, _Frame):
            raise SandboxError(f"the box's shell did not end within {START_TIMEOUT_S:g} s of SIGKILL")
        return frame

    def _signal_shell(self, signum: int) -> None:
        info = _proc(self._shell) if self._shell else None
        if info is not None:
            _signal(self._shell, info.start, signum)

    def _tasks(self) -> int:
        """Processes and threads of the box, pid 1 included: what RLIMIT_NPROC counts."""
        return 1 + sum(p.tasks for p in self._tree().values())

    def _bombed(self, before: Mapping) -> bool:
        """Whether the processes a command left running are a fork bomb: they fill the box, or
        at some moment took half the room it had left (one that hit the limit and is dying
        out). Watched, if it left any, until their number has not grown for ``SETTLE_S`` (at
        most ``BOMB_WATCH_S``: on a loaded host a bomb grows slowly); a bomb's are killed."""
        if all(key in before for key in self._tree()):
            return False
        had = 1 + sum(p.tasks for p in before.values())
        room = self.spec.limits.max_processes - had
        start = grew = time.monotonic()
        peak = 0
        while True:
            tasks, now = self._tasks(), time.monotonic()
            if tasks > peak:
                peak, grew = tasks, now
            if tasks >= self._crowded or peak - had >= max(8, room // 2):
                self._kill(before)
                return True
            if now - grew >= SETTLE_S or now - start >= BOMB_WATCH_S:
                return False
            time.sleep(0.01)

    # --- results ------------------------------------------------------------------------------

    def _full(self) -> bool:
        """Whether a writable place (/tmp too) is full, seen through pid 1's root."""
        for place in (*self.spec.writable, "/sandbox/tmp"):
            try:
                st = os.statvfs(f"/proc/{self._pid1}/root{place}")
            except OSError:
                continue
            if st.f_bavail * st.f_frsize < FULL_BYTES:
                return True
        return False

    def _limit_hit(self, status: int, out: OutputBuffer) -> str | None:
        """The limit a command that ended by itself ran into, as far as can be told: SIGXCPU
        (cpu); SIGXFSZ, or the workspace or /tmp full after it (disk: said after every command
        until space is freed); a failure whose output ends naming an allocation failure
        (memory: RLIMIT_AS makes allocations fail rather than killing)."""
        if status == 128 + signal.SIGXCPU:
            return "cpu"
        if status == 128 + signal.SIGXFSZ or self._full():
            return "disk"
        if status != 0 and _MEMORY.search(out.text().encode()[-2000:]):
            return "memory"
        return None

    def _result(self, out: OutputBuffer, status: int, timed_out: bool, reason: str | None, start: float) -> ExecResult:
        restarted, self._restarted = self._restarted, False
        return ExecResult(
            output=out.text(), exit_code=status, cwd=self._cwd.decode("utf-8", "replace"), timed_out=timed_out,
            truncated=out.truncated, shell_restarted=restarted, killed_reason=reason,
            seconds=time.monotonic() - start,
        )

    def _check_open(self) -> None:
        if self._dead is not None:
            raise SandboxError(f"the box is gone: {self._dead}")

    def _why_dead(self) -> str:
        return f"bwrap: {self._proc.stderr_tail() or 'no message'}"


class _Handles:
    """What a box holds on the host, apart from the box object: its finalizer's state."""

    def __init__(self, proc: SandboxProcess, fds: list[int], sel: selectors.BaseSelector) -> None:
        self.proc, self.fds, self.sel, self.pid1fd = proc, fds, sel, -1

    def kill(self) -> None:
        """SIGKILL pid 1 (the kernel then kills every other process of the box); bwrap, its
        parent, reaps it and exits, and is reaped here. ``SandboxProcess.kill`` kills bwrap's
        process group, if it is still there, and closes its pipes."""
        if self.pid1fd >= 0:
            try:
                signal.pidfd_send_signal(self.pid1fd, signal.SIGKILL)
                self.proc.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):  # ProcessLookupError: gone already
                pass
        self.proc.kill()

    def release(self) -> None:
        """Kill the box, wait until its pid 1 has exited (by then the kernel has reaped every
        other process of its pid namespace, and its mounts went with the last of them), close
        every fd. Runs once: from ``close``, or when the box is collected."""
        self.kill()
        if self.pid1fd >= 0:
            select.select([self.pid1fd], [], [], 10.0)  # a pidfd is readable once its process has exited
            os.close(self.pid1fd)
        self.sel.close()
        for fd in self.fds:
            os.close(fd)


def _int(field: bytes) -> int:
    """A number from a frame; -1 if it is none (a command forged a frame)."""
    try:
        return int(field)
    except ValueError:
        return -1


def _children(pid: int) -> list[int]:
    """Host pids of ``pid``'s children (of all its threads); [] if it is gone."""
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids += map(int, f.read().split())
    except (FileNotFoundError, ProcessLookupError):
        pass
    return kids


def _proc(pid: int) -> _Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        tasks = len(os.listdir(f"/proc/{pid}/task"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    rest = stat[stat.rindex(b")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime 22
    return _Proc(pid, int(rest[19]), rest[0] == b"Z", tasks)


def _host_pid(pid1: int, ns_pid: int) -> int:
    """The host pid of pid 1's child whose pid in the box is ``ns_pid`` (0 if it is gone already)."""
    for kid in _children(pid1):
        try:
            with open(f"/proc/{kid}/status", "rb") as f:
                nspid = next(line for line in f if line.startswith(b"NSpid:")).split()
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
        if int(nspid[-1]) == ns_pid:
            return kid
    return 0


def _signal(pid: int, start: int, signum: int) -> None:
    """Send ``signum`` to host pid ``pid`` if it is still the process that started at ``start``
    (a pidfd pins it, so a recycled pid is never hit)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # ProcessLookupError: gone
        return
    try:
        info = _proc(pid)
        if info is not None and info.start == start:
            signal.pidfd_send_signal(fd, signum)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)
