"""What a sandboxed program may use (``Limits``), what it leaves behind (``Result``), and the
one error that means the sandbox itself failed (``SandboxError``)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from turnforge.errors import UserError

MB = 1024 * 1024

# Names ``Result.killed_reason`` can take.
KILL_REASONS = ("timeout", "cpu", "memory", "file_size", "output")


class SandboxError(RuntimeError):
    """The sandbox failed, not the program: bwrap missing or crashing, or its own set-up failing
    before the program started. An infrastructure fault: callers drop the sample from advantages
    instead of scoring it. The program's crash, timeout or nonzero exit is a normal ``Result``."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run. The defaults suit a short test or script run by an agent.

    ``memory_mb`` is RLIMIT_AS, per process: ``max_processes * memory_mb + 2 * disk_mb`` (two
    tmpfs) bounds the memory a whole sandbox can pin (no cgroup is used).
    """

    timeout_s: float = 10.0  # wall clock; then the whole sandbox (every process in it) is killed
    cpu_s: int = 10  # CPU seconds per process (RLIMIT_CPU): SIGXCPU at cpu_s, SIGKILL one second later
    memory_mb: int = 512  # address space per process (RLIMIT_AS): allocations beyond it fail
    max_processes: int = 64  # processes and threads of the sandbox user, counted per sandbox (RLIMIT_NPROC)
    disk_mb: int = 64  # size of the tmpfs holding the work dir and /tmp, and of /dev/shm's; the largest file (RLIMIT_FSIZE)
    max_output_bytes: int = 1_000_000  # per stream (stdout, stderr); the program is killed past it
    network: bool = False  # False: own network namespace with only loopback; True: the host's network

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "network":
                if not isinstance(value, bool):
                    raise UserError(f"Limits.network must be True or False, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise UserError(f"Limits.{f.name} must be a number > 0, got {value!r}")
            elif f.type == "int" and not isinstance(value, int):
                raise UserError(f"Limits.{f.name} must be a whole number, got {value!r}")


def prlimit_argv(prlimit: str, limits: Limits, *, nproc: bool) -> list[str]:
    """``prlimit`` options that set the limits on the program, then exec it (argv follows ``--``).

    Both soft and hard limits are set, so the program cannot raise them; CPU gets a soft limit
    (SIGXCPU) one second before the hard one (SIGKILL). ``nproc=False`` leaves RLIMIT_NPROC
    alone: outside a user namespace it counts every process of the user on the host.
    """
    argv = [
        prlimit,
        f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
        f"--as={limits.memory_mb * MB}",
        f"--fsize={limits.disk_mb * MB}",
        "--core=0",
    ]
    if nproc:
        argv.append(f"--nproc={limits.max_processes}")
    return [*argv, "--"]


@dataclass(frozen=True)
class Result:
    """How a sandboxed program ended. Output past ``Limits.max_output_bytes`` is cut and ends
    with ``TRUNCATED``; bytes that are not UTF-8 read as U+FFFD."""

    exit_code: int  # the program's exit status; 128 + N when a signal N killed it (shell convention)
    stdout: str
    stderr: str
    timed_out: bool  # the wall-clock timeout killed it (killed_reason == "timeout")
    killed_reason: str | None  # the limit that ended it, one of KILL_REASONS, or None
    duration_s: float  # wall time of the whole sandbox, set-up included

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None
