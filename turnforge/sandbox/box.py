"""``Box``: what a terminal env needs from a sandbox, whatever isolates it: one persistent bash
per episode, files in and out, snapshots of its state.

    from turnforge.sandbox.box import BoxSpec, open_box
    with open_box(BoxSpec(workdir="/app")) as box:
        box.put({"main.py": b"print(6 * 7)\\n"})
        r = box.exec("python3 main.py")          # r.output == "42\\n", r.cwd == "/app"

A box's commands run one after another in ONE bash: ``cd`` and ``export`` persist, as in a
terminal; each command's stdin is ``/dev/null``. Its writable places are the workspace
(``BoxSpec.workdir``), any ``BoxSpec.extra_dirs``, ``/tmp`` and ``/dev/shm``; a snapshot holds
all but /dev/shm, with the shell's cwd and exported variables. Backends register in ``BOXES``
(``@register("name")``): "bwrap" is ``shell.BwrapBox``; a Docker, Podman or remote backend
would implement the same ``Box``.

This module holds the interface, its typed data and the pure pieces every backend shares (the
output budget, file packing and path rules); it starts nothing.
"""

from __future__ import annotations

import io
import re
import tarfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import ClassVar, Self

from turnforge.errors import UserError, choices
from turnforge.sandbox.limits import Limits

# Names ``ExecResult.killed_reason`` can take.
BOX_KILL_REASONS = ("timeout", "output", "cpu", "memory", "processes", "disk")
TRUNCATED_MARK = "\n[... output truncated: {omitted} bytes not shown ...]\n"
# The limits of a terminal episode's box (see ``BoxSpec`` for how each reads for a box).
BOX_LIMITS = Limits(timeout_s=30.0, cpu_s=600, memory_mb=2048, max_processes=128, disk_mb=256, max_output_bytes=16_384)
# Top-level directories a workdir may not live under: the system view and the box's own places.
RESERVED = frozenset({"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sandbox", "sbin", "sys", "tmp",
                      "usr"})
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class BoxSpec:
    """What a box is made of. ``limits`` read for a box as:

    ``timeout_s``: a command's default timeout (``exec`` may pass its own); ``cpu_s``,
    ``memory_mb``: per process (RLIMIT_CPU, RLIMIT_AS; the shell's own CPU time counts too, so
    a shell that hits it is restarted); ``max_processes``: processes and threads of the whole
    box (a fork bomb's ceiling); ``disk_mb``: the workspace's size, and /tmp's (each its own),
    and the largest file; ``max_output_bytes``: how much of a command's output is shown (the
    rest is cut, see ``OutputBuffer``); ``network``: False, no network but loopback.
    """

    workdir: str = "/app"  # absolute; the workspace: created empty, the shell's first cwd and HOME
    env: Mapping[str, str] = field(default_factory=dict, hash=False)  # added to the box's scrubbed environment
    limits: Limits = BOX_LIMITS
    extra_dirs: tuple[str, ...] = ()  # more writable places (e.g. a verifier's /logs), each like the workspace
    binds: tuple[str, ...] = ()  # host paths shown read-only at the same place (e.g. /var/lib/dpkg: which packages exist)

    @property
    def writable(self) -> tuple[str, ...]:
        """The places a command may write, the box's own (/tmp, /dev/shm) aside: workdir first."""
        return (self.workdir, *self.extra_dirs)

    def __post_init__(self) -> None:
        dirs = (self.workdir, *self.extra_dirs) if isinstance(self.extra_dirs, tuple) else None
        if dirs is None:
            raise UserError(f"BoxSpec.extra_dirs must be a tuple of absolute paths, got {self.extra_dirs!r}")
        for key, value in zip(("workdir", *(["extra_dirs"] * len(self.extra_dirs))), dirs):
            path = PurePosixPath(value) if isinstance(value, str) else None
            if (path is None or not path.is_absolute() or str(path) != value or len(path.parts) < 2
                    or ".." in path.parts or path.parts[1] in RESERVED or "\0" in value):
                raise UserError(
                    f"BoxSpec.{key} must hold normalised absolute paths outside / itself and outside "
                    f"{', '.join('/' + r for r in sorted(RESERVED))} (e.g. '/app' or '/home/user/project'), got {value!r}"
                )
        nested = [(a, b) for a in dirs for b in dirs if a != b and PurePosixPath(b).is_relative_to(a)]
        if nested or len(set(dirs)) < len(dirs):
            raise UserError(f"BoxSpec.workdir and extra_dirs must be distinct and not inside one another, got {dirs}")
        for key, value in self.env.items():
            if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
                raise UserError(f"BoxSpec.env key {key!r} is not a variable name (letters, digits and _, not first a digit)")
            if not isinstance(value, str) or "\0" in value:
                raise UserError(f"BoxSpec.env[{key!r}] must be a string without NUL bytes, got {value!r}")
        if not isinstance(self.limits, Limits):
            raise UserError(f"BoxSpec.limits must be a turnforge.sandbox.Limits, got {type(self.limits).__name__}")
        for path in self.binds:
            if not (isinstance(path, str) and PurePosixPath(path).is_absolute() and ".." not in PurePosixPath(path).parts):
                raise UserError(f"BoxSpec.binds must hold absolute host paths, got {path!r}")
            if any(PurePosixPath(path).is_relative_to(d) or PurePosixPath(d).is_relative_to(path) for d in dirs):
                raise UserError(f"BoxSpec.binds: {path} overlaps a writable place {dirs}")


@dataclass(frozen=True)
class ExecResult:
    """One command's outcome, as the agent should be told it. ``output`` is stdout and stderr
    interleaved in the order written, as a terminal shows them (one pipe), decoded as UTF-8 with
    U+FFFD for bad bytes, cut to ``max_output_bytes`` (see ``OutputBuffer``). Output that the
    box's background processes wrote since the last command comes first."""

    output: str
    exit_code: int  # $? of the command (128 + N: signal N; 130: stopped); a shell that ended: its exit status
    cwd: str  # the shell's working directory after the command
    timed_out: bool  # it ran past its timeout: it was stopped (like Ctrl-C) and the processes it started were killed
    truncated: bool  # output was cut (the mark in ``output`` says how many bytes)
    shell_restarted: bool  # the shell ended (or ignored the stop) and a new one took over, with the last cwd and exports
    killed_reason: str | None  # a limit it ran into, one of BOX_KILL_REASONS, or None
    seconds: float  # wall time of the whole call

    @property
    def notice(self) -> str | None:
        """One line telling the agent what happened besides the output (None: nothing to tell)."""
        parts = []
        if self.timed_out:
            parts.append("the command timed out: it was stopped and every process it started was killed")
        elif self.killed_reason == "output":
            parts.append("the command printed too much: it was stopped and every process it started was killed")
        elif self.killed_reason == "processes":
            parts.append("the box reached its process limit: its background processes were killed")
        elif self.killed_reason in ("disk", "memory", "cpu"):
            parts.append({"disk": "the disk (workspace or /tmp) is full", "memory": "a process ran out of memory",
                          "cpu": "a process used up its CPU time and was killed"}[self.killed_reason])
        if self.shell_restarted:
            parts.append(f"the shell was restarted in {self.cwd} with its last exported variables "
                         "(other variables and functions are gone)")
        return "; ".join(parts) or None


@dataclass(frozen=True)
class BoxSnapshot:
    """A box's state, enough to start again from it (in the same box or another of the same
    workdir, and the extra dirs of this one's among its own): ``files`` is an uncompressed tar of
    the workspace, the extra dirs and /tmp (member names relative to /, e.g. ``app/main.py``,
    ``tmp/x``; modes and mtimes kept), ``cwd`` and ``env`` the
    shell's working directory and exported variables (without PWD, OLDPWD, SHLVL and _).
    Running processes, shell functions and unexported variables are not part of it."""

    workdir: str
    files: bytes
    cwd: str
    env: Mapping[str, str] = field(hash=False)
    extra_dirs: tuple[str, ...] = ()  # those of the box it was taken in

class Box(ABC):
    """One persistent bash in an isolated place, for one episode; a context manager.

    Not for use from several threads at once (``close`` may come from any thread). A program
    failure, a timeout or a hung shell is an ``ExecResult``; ``SandboxError`` means the box
    itself failed (drop the sample); ``UserError`` a bad argument."""

    name: ClassVar[str]  # its key in BOXES
    spec: BoxSpec

    @classmethod
    @abstractmethod
    def unavailable(cls) -> str | None:
        """Why this backend cannot run here, naming the fix, or None."""

    @abstractmethod
    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        """Run ``command`` (bash source, several lines allowed) in the box's shell, stdin from
        /dev/null, for at most ``timeout_s`` (None: ``spec.limits.timeout_s``)."""

    @abstractmethod
    def put(self, files: Mapping[str, bytes], modes: Mapping[str, int] | None = None) -> None:
        """Write ``files`` (path -> content; absolute in a writable place, or relative to the
        workdir), creating parent directories; ``modes`` (path -> e.g. 0o755) default to 0o644."""

    @abstractmethod
    def get(self, paths: Iterable[str]) -> dict[str, bytes]:
        """The contents of the regular files among ``paths`` (absolute, or relative to the
        workdir), keyed as given; a path that is missing or not a file is left out."""

    @abstractmethod
    def archive(self, path: str) -> bytes:
        """An uncompressed tar of the directory ``path`` (members relative to it, ``./...``);
        ``FileNotFoundError`` if it is not a directory."""

    @abstractmethod
    def snapshot(self) -> BoxSnapshot:
        """The files of the writable places (not /dev/shm), the shell's cwd and its exported variables."""

    @abstractmethod
    def restore(self, snap: BoxSnapshot) -> None:
        """Make the box as ``snap`` was: its files exactly (files created since are gone), a new
        shell in its cwd with its exported variables; every running process is killed first.
        ``UserError`` unless the snapshot's workdir is this box's and its extra dirs are among
        this box's (a verifier's box with more places may restore an episode's snapshot)."""

    @abstractmethod
    def close(self) -> None:
        """Kill every process of the box and free what it holds; idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


BOXES: dict[str, type[Box]] = {}


def register(name: str) -> Callable[[type[Box]], type[Box]]:
    """Class decorator: make a ``Box`` backend available as ``name`` in ``BOXES``."""

    def add(cls: type[Box]) -> type[Box]:
        if name in BOXES and BOXES[name] is not cls:
            raise ValueError(f"box backend {name!r} is registered twice ({BOXES[name].__name__}, {cls.__name__})")
        cls.name = name
        BOXES[name] = cls
        return cls

    return add


def open_box(spec: BoxSpec | None = None, backend: str = "bwrap", **options: object) -> Box:
    """Start a box of ``backend`` (a key of ``BOXES``) made as ``spec`` says (None: ``BoxSpec()``)."""
    if backend not in BOXES:
        raise UserError(f"unknown box backend {backend!r}; choose one of {choices(BOXES)}")
    return BOXES[backend](spec or BoxSpec(), **options)  # type: ignore[call-arg]


# --- pure pieces every backend shares ---------------------------------------------------------

class OutputBuffer:
    """A command's output, kept within a budget: the first and last ``budget // 2`` bytes (about)
    are shown, with ``TRUNCATED_MARK`` between them saying how many bytes were left out. Holds
    at most ``3 * budget`` bytes however much is added; ``total`` counts everything."""

    def __init__(self, budget: int) -> None:
        self.budget, self.total = budget, 0
        self._head, self._tail = bytearray(), bytearray()

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.budget - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self._tail += chunk
            if len(self._tail) > 2 * self.budget:
                del self._tail[: len(self._tail) - self.budget]

    @property
    def truncated(self) -> bool:
        return self.total > self.budget

    def text(self) -> str:
        if not self.truncated:
            return self._head.decode("utf-8", "replace")
        keep_head = self.budget // 2
        keep_tail = self.budget - keep_head
        tail = (self._head + self._tail)[-keep_tail:]
        mark = TRUNCATED_MARK.format(omitted=self.total - keep_head - keep_tail)
        return self._head[:keep_head].decode("utf-8", "replace") + mark + tail.decode("utf-8", "replace")


def box_path(path: str, workdir: str) -> PurePosixPath:
    """``path`` as an absolute path in the box (relative ones are under ``workdir``); ``UserError``
    for an empty path, one with ``..`` or a NUL byte."""
    if not isinstance(path, str) or not path or "\0" in path or ".." in PurePosixPath(path).parts:
        raise UserError(f"box path {path!r} must be a non-empty path without '..' or NUL bytes "
                        "(e.g. 'src/main.py' or '/app/x')")
    return PurePosixPath(workdir) / path


def writable_path(path: str, spec: BoxSpec) -> PurePosixPath:
    """``box_path`` of a file to be written: it must lie inside a writable place of ``spec`` or /tmp."""
    full = box_path(path, spec.workdir)
    if not any(full != PurePosixPath(root) and full.is_relative_to(root) for root in (*spec.writable, "/tmp")):
        raise UserError(f"cannot write {path!r} in the box: files go under {', '.join(spec.writable)} or /tmp "
                        "(the rest of the box is read-only)")
    return full


def pack(files: Mapping[PurePosixPath, bytes], modes: Mapping[PurePosixPath, int]) -> bytes:
    """An uncompressed tar of ``files`` (absolute box paths; members named relative to /)."""
    buf = io.BytesIO()
    now = time.time()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for path, content in files.items():
            if not isinstance(content, (bytes, bytearray)):
                raise UserError(f"box file {str(path)!r} must be given as bytes, got {type(content).__name__}")
            info = tarfile.TarInfo(str(path).lstrip("/"))
            info.size, info.mode, info.mtime = len(content), modes.get(path, 0o644), now
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def check_mode(path: str, mode: object) -> int:
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise UserError(f"mode of box file {path!r} must be an int such as 0o644 or 0o755, got {mode!r}")
    return mode


def regular_files(data: bytes) -> dict[str, bytes]:
    """The regular files of an uncompressed tar, by member name."""
    found: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for member in tar:
            if member.isreg():
                extracted = tar.extractfile(member)
                assert extracted is not None
                found[member.name] = extracted.read()
    return found
