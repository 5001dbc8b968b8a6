"""``StartGate``: a bounded number of sandboxed programs starting (or running) at once on this
machine, the rest queued.

Why: a per-episode process (an MCP server, a test run, later a browser) spends its first
second or so importing and initialising. Started all at once, N of them share the cores and
the last one is ready after N times that cost: 64 Python MCP servers on a 2-core EPYC took over
30 s, past their start timeout, and every episode became an infrastructure failure. Queued,
each start gets a core and its timeout measures its own start, not the queue.

The gate is machine-wide: its slots are lock files (``flock``) in a directory of the system
temp dir, shared by every process of the same user (env pool workers, pytest-xdist workers, two
runs side by side). A lock is released by the kernel when its holder dies, so a crashed worker
never leaks a slot. Inside one process a semaphore queues the threads first, so only as many
threads as there are slots poll the lock files. A gate of ``n`` slots uses slot files
``0 .. n-1``: gates of different sizes on one machine share their lower slots.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from turnforge.errors import UserError

POLL_S = 0.01  # first wait between tries when every slot is taken (doubles up to POLL_MAX_S)
POLL_MAX_S = 0.1


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. under ``taskset``), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def check_slots(value: int | None, key: str) -> int:
    """``value`` (None: the usable core count) as a slot count; ``UserError`` naming ``key`` if
    it is not a whole number >= 1."""
    if value is None:
        return usable_cores()
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{key} must be a whole number >= 1 (or null for the core count), got {value!r}")
    return value


class StartGate:
    """At most ``slots`` holders at once across this machine's processes of this user.

    ``with gate.slot(): ...`` waits for a free slot (as long as it takes: every holder's work is
    bounded by its own timeout) and holds it for the block. ``waited_s`` of the yielded
    ``SlotTicket`` is the time spent queued, which a caller leaves out of its start timeout.
    """

    def __init__(self, slots: int, directory: str | Path | None = None) -> None:
        self.slots = check_slots(slots, "StartGate slots")
        self.directory = Path(directory) if directory is not None else default_directory()
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._local = _local_semaphore(str(self.directory), self.slots)

    @contextmanager
    def slot(self) -> Iterator["SlotTicket"]:
        start = time.monotonic()
        with self._local:
            fd = self._take()
            ticket = SlotTicket(time.monotonic() - start)
            try:
                yield ticket
            finally:
                os.close(fd)  # closing the last fd of the open file releases the flock

    def _take(self) -> int:
        """An fd holding the lock of one free slot file, waiting until one is free."""
        wait = POLL_S
        while True:
            for index in range(self.slots):
                fd = os.open(self.directory / f"slot-{index}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return fd
                except OSError as err:
                    os.close(fd)
                    if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
            time.sleep(wait)
            wait = min(POLL_MAX_S, wait * 2)


@dataclass(frozen=True)
class SlotTicket:
    """What a caller learns from its slot."""

    waited_s: float  # seconds spent queued before the slot was free


def default_directory() -> Path:
    """The machine-wide gate's directory: one per user in the system temp dir."""
    return Path(tempfile.gettempdir()) / f"turnforge-start-gate-{os.getuid()}"


@functools.cache
def _local_semaphore(directory: str, slots: int) -> threading.BoundedSemaphore:
    """One semaphore per (gate directory, size) in this process: threads queue here, not on the files."""
    return threading.BoundedSemaphore(slots)


# A forked child (an env pool worker) must not inherit permits its parent's threads held at fork.
os.register_at_fork(after_in_child=_local_semaphore.cache_clear)


__all__ = ["StartGate", "SlotTicket", "check_slots", "default_directory", "usable_cores"]
