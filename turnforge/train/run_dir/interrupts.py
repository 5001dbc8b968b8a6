"""SIGINT and SIGTERM during a run: stop at a checkpoint, say how to resume, exit 130/143.

Inside the RL stage the first signal asks the loop to finish the iteration it is in,
save a resumable checkpoint and stop (``requested``); a second signal stops at once.
Elsewhere (behaviour cloning, evaluations, the final save) there is no iteration to
finish, so the first signal stops at once. Either way ``Interrupted`` carries one line
saying where the run stopped and the resume command, and the CLI exits 128 + signal.
Stopping at once is safe: checkpoints are written beside the old one and swapped in.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Callable

from turnforge.dist import stopped_by_launcher
from turnforge.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    """``with Interrupts(where):`` handles SIGINT/SIGTERM for a run; ``where()`` describes
    the point the run would resume from (called when a signal stops it)."""

    def __init__(self, where: Callable[[], str]) -> None:
        self.where = where
        self.graceful = False  # True while an RL iteration can be finished first
        self.requested: int | None = None  # the signal that asked for a stop at the iteration's end
        self._previous: dict[int, object] = {}

    def stop_now(self, signum: int) -> Interrupted:
        return Interrupted(f"interrupted {self.where()}", signum)

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGTERM and stopped_by_launcher():  # the launcher stopping this rank because another one failed:
            self.requested = None                                # at once and silently; the launcher tells why
            raise self.stop_now(signum)
        if self.graceful and self.requested is None:
            self.requested = signum
            print(f"{signal.Signals(signum).name}: stopping after this RL iteration's checkpoint "
                  "(send it again to stop now)", file=sys.stderr, flush=True)
            return
        self.requested = None  # stopping now, not at the iteration's end
        raise self.stop_now(signum)

    def __enter__(self) -> "Interrupts":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
