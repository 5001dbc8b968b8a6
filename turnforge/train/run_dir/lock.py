"""The run directory's lock: one process writes a run directory at a time.

``DIR/.lock`` carries a POSIX record lock (``fcntl.lockf``) for the whole life of the
run. The kernel drops it when the process ends, however it ends (SIGKILL included), so a
lock file left by a dead run is stale by construction and is simply taken over; record
locks are not inherited by forked children, so env workers never hold it. The file's
text names the holder (pid, host, start time) for the error a second writer gets.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from turnforge.errors import UserError

LOCK = ".lock"
_HELD: set[Path] = set()  # run directories this process holds (record locks are per process)


class RunLock:
    """Exclusive lock on ``run_dir`` (``with RunLock(dir):`` or ``acquire``/``release``)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None
        self.stale: dict | None = None  # the holder recorded by a dead run whose lock was taken over

    def acquire(self) -> "RunLock":
        key = self.path.resolve()
        if key in _HELD:
            raise UserError(f"run directory {str(self.path.parent)!r} is in use by a run of this process; use another --out")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd)
            os.close(fd)
            who = f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}" if holder else "another process"
            raise UserError(
                f"run directory {str(self.path.parent)!r} is in use by a live turnforge run ({who}); "
                "wait for it to end, or use another --out"
            ) from None
        self.stale = _read_holder(fd) or None
        os.ftruncate(fd, 0)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd
        _HELD.add(key)
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the record lock
            self._fd = None
            _HELD.discard(self.path.resolve())

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
