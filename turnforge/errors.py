"""Errors a user can fix. The CLI prints their message on one line and exits with code 2."""

from __future__ import annotations

from typing import Iterable, Sequence


class UserError(Exception):
    """Bad input from the user (recipe, config key, path, env id). Never a traceback."""


def choices(valid: Iterable[str]) -> str:
    """Format valid choices for an error message: ``'a', 'b', 'c'``."""
    return ", ".join(repr(v) for v in sorted(valid))


def spoken_list(names: Sequence[str]) -> str:
    """``a, b, c or d``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


class RunStopped(Exception):
    """A run stopped on purpose before its end (not a user error, not a bug): too many
    infrastructure failures in a stage, or non-finite losses. The CLI prints
    ``error: <message>`` on one line and exits with ``exit_code`` (1)."""

    exit_code = 1


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped a run. The message says where it stopped and how to
    resume; the CLI prints it on one line and exits with 128 + the signal number
    (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


#: The run directory of the run in progress in this process (set by ``turnforge.app.run.train``),
#: so that an internal error can end with a line saying where the run's logs are.
current_run_dir: list[str] = []
