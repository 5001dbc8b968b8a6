"""``Sandbox``: run an untrusted program under ``Limits``, isolated by bubblewrap (see ``bwrap.py``),
or, on explicit request, without isolation (backend ``"unsafe-none"``)."""

from __future__ import annotations

import shutil
import sys
import tempfile
import warnings
import weakref
from pathlib import Path, PurePosixPath

from turnforge.errors import UserError, choices
from turnforge.sandbox import bwrap
from turnforge.sandbox.gate import StartGate, check_slots
from turnforge.sandbox.limits import MB, Limits, Result, SandboxError, prlimit_argv
from turnforge.sandbox.process import SandboxProcess, execute, spawn

BACKENDS = ("bwrap", "unsafe-none")
UNSAFE_WARNING = (
    "turnforge.sandbox backend 'unsafe-none' runs programs WITHOUT isolation: they can read and "
    "write your files, use the network and signal your processes; only rlimits and the timeout apply. "
    "Use it for trusted code only."
)
_working: set[tuple[str, ...]] = set()  # bwrap launchers that started a sandbox in this process


class UnsafeSandboxWarning(UserWarning):
    """A ``Sandbox`` was created with the ``unsafe-none`` backend."""


class Sandbox:
    """Runs programs under ``limits``; one instance may serve many runs (and threads).

    Creating a ``bwrap`` sandbox checks once per process that bubblewrap is installed and can
    create its namespaces here, and raises ``UserError`` naming the fix if not.

    ``max_starting`` bounds how many programs of this machine's sandboxes are in their start
    at once (``gate``, a machine-wide ``StartGate``; None: one per usable core): ``run`` holds
    a slot for the whole run, so its timeout measures the program, not a queue behind other
    programs; a long-running program from ``start`` holds none by itself: its caller takes
    ``with sandbox.gate.slot():`` around the start and whatever handshake makes it ready.
    """

    def __init__(self, limits: Limits | None = None, backend: str = "bwrap", max_starting: int | None = None) -> None:
        if backend not in BACKENDS:
            raise UserError(f"unknown sandbox backend {backend!r}; choose one of {choices(BACKENDS)}")
        self.limits = limits or Limits()
        self.backend = backend
        self.gate = StartGate(check_slots(max_starting, "max_starting"))
        if backend == "unsafe-none":
            warnings.warn(UNSAFE_WARNING, UnsafeSandboxWarning, stacklevel=2)
            print(f"WARNING: {UNSAFE_WARNING}", file=sys.stderr, flush=True)
            self._prlimit = bwrap.find_tool("prlimit", "util-linux")
            return
        self._launch = bwrap.launcher()
        bwrap.find_tool("prlimit", "util-linux")
        self._prlimit = "prlimit"  # found again on the sandbox's PATH, in the read-only /usr
        if self._launch not in _working:
            self._check_namespaces()
            _working.add(self._launch)

    def run(self, argv: list[str], files: dict[str, str] | None = None, stdin: str = "",
            timeout: float | None = None) -> Result:
        """Run ``argv`` (looked up on the sandbox's PATH) in a fresh work dir holding ``files``
        (relative path -> text), feeding it ``stdin``; ``timeout`` overrides ``limits.timeout_s``.

        The program's own failure, crash or timeout is a ``Result``; ``SandboxError`` means the
        sandbox failed before the program started.
        """
        if not argv or not all(isinstance(a, str) for a in argv):
            raise UserError(f"Sandbox.run needs argv as a non-empty list of strings, got {argv!r}")
        if timeout is not None and not timeout > 0:
            raise UserError(f"Sandbox.run timeout must be > 0 seconds, got {timeout!r}")
        contents = check_files(files or {}, self.limits)
        timeout_s = timeout if timeout is not None else self.limits.timeout_s
        with self.gate.slot():
            return self._run(argv, contents, stdin, timeout_s)

    def _run(self, argv: list[str], contents: dict[PurePosixPath, bytes], stdin: str, timeout_s: float) -> Result:
        if self.backend == "unsafe-none":
            return self._run_unsafe(argv, contents, stdin.encode(), timeout_s)
        with bwrap.command(self._launch, self.limits, contents) as (prefix, fds):
            return execute(
                prefix, [*prlimit_argv(self._prlimit, self.limits, nproc=True), *argv],
                stdin=stdin.encode(), timeout_s=timeout_s, limits=self.limits, env={}, pass_fds=fds,
            )

    def start(self, argv: list[str], files: dict[str, str] | None = None, env: dict[str, str] | None = None,
              binds: tuple[str, ...] = ()) -> SandboxProcess:
        """Start ``argv`` as a long-running program (a server) in a fresh work dir holding
        ``files``, with pipes to its stdin and stdout, ``env`` added to its scrubbed
        environment and the host paths ``binds`` shown read-only at the same place. The
        limits apply but ``timeout_s``: the caller ends it with ``kill()``.

        ``UserError`` names a bind the sandbox's user cannot read; ``SandboxError`` means it
        could not be started (``SandboxProcess.started`` tells, later, whether the sandbox came up).
        """
        if not argv or not all(isinstance(a, str) for a in argv):
            raise UserError(f"Sandbox.start needs argv as a non-empty list of strings, got {argv!r}")
        contents = check_files(files or {}, self.limits)
        if self.backend == "unsafe-none":
            work = tempfile.mkdtemp(prefix="turnforge-unsafe-")
            for path, content in contents.items():
                (Path(work) / path).parent.mkdir(parents=True, exist_ok=True)
                (Path(work) / path).write_bytes(content)
            proc = spawn([], [*prlimit_argv(self._prlimit, self.limits, nproc=False), *argv],
                         env={**bwrap.program_env(work, work), **(env or {})}, cwd=work)
            weakref.finalize(proc, shutil.rmtree, work, True)
            return proc
        for path in binds:
            if not Path(path).is_absolute() or Path(path).parts[1:2] in (("sandbox",), ("proc",), ("dev",)):
                raise UserError(f"cannot show {path} in the sandbox: a bind must be an absolute path outside /sandbox, "
                                "/proc and /dev (the sandbox's own)")
            blocked = bwrap.unreadable(path)
            if blocked is not None:
                raise UserError(
                    f"the sandbox's user (uid {bwrap.SANDBOX_UID}) cannot read {blocked}, needed to show {path} "
                    f"in the sandbox; make it world-readable (chmod o+rx) or install the environment elsewhere"
                )
        with bwrap.command(self._launch, self.limits, contents, binds=tuple(binds), env=env) as (prefix, fds):
            return spawn(prefix, [*prlimit_argv(self._prlimit, self.limits, nproc=True), *argv], env={}, pass_fds=fds)

    def _run_unsafe(self, argv: list[str], contents: dict[PurePosixPath, bytes], stdin: bytes, timeout_s: float) -> Result:
        """No isolation: a host temp dir as work dir (not size-capped; RLIMIT_FSIZE caps each file),
        no RLIMIT_NPROC (it would count all of the user's processes), and the timeout kills the
        program's process group only: a child that starts its own session survives it."""
        work = Path(tempfile.mkdtemp(prefix="turnforge-unsafe-"))
        try:
            for path, content in contents.items():
                (work / path).parent.mkdir(parents=True, exist_ok=True)
                (work / path).write_bytes(content)
            return execute(
                [], [*prlimit_argv(self._prlimit, self.limits, nproc=False), *argv],
                stdin=stdin, timeout_s=timeout_s, limits=self.limits,
                env=bwrap.program_env(str(work), str(work)), cwd=str(work),
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _check_namespaces(self) -> None:
        try:
            self.run(["true"], timeout=30.0)
        except SandboxError as err:
            raise UserError(
                f"bubblewrap cannot create the sandbox's namespaces here ({err}); allow unprivileged user "
                "namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04+ also "
                "kernel.apparmor_restrict_unprivileged_userns=0; in Docker: --security-opt seccomp=unconfined "
                "--security-opt apparmor=unconfined), or use backend='unsafe-none' for trusted code only"
            ) from err


def check_files(files: dict[str, str], limits: Limits) -> dict[PurePosixPath, bytes]:
    """Validate ``files`` (relative path -> text) and encode them as UTF-8."""
    contents: dict[PurePosixPath, bytes] = {}
    for name, text in files.items():
        path = PurePosixPath(name) if isinstance(name, str) else None
        if path is None or path.is_absolute() or ".." in path.parts or not path.parts or "\0" in name:
            raise UserError(
                f"sandbox file path {name!r} must be relative to the work dir and must not contain '..' "
                "(e.g. 'main.py' or 'pkg/util.py')"
            )
        if not isinstance(text, str):
            raise UserError(f"sandbox file {name!r} must be given as text (str), got {type(text).__name__}")
        contents[path] = text.encode()
    dirs = {parent for path in contents for parent in path.parents}
    clash = sorted(str(p) for p in contents if p in dirs)
    if clash:
        raise UserError(f"sandbox file path {clash[0]!r} is both a file and a directory in files")
    total = sum(len(c) for c in contents.values())
    if total > limits.disk_mb * MB:
        raise UserError(f"sandbox files hold {total} bytes, more than Limits.disk_mb={limits.disk_mb} MB")
    return contents
