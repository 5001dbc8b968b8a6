"""Errors a user can fix. The CLI prints their message on one line and exits with code 2."""

from __future__ import annotations

from typing import Iterable


class UserError(Exception):
    """Bad input from the user (recipe, config key, path, env id). Never a traceback."""


def choices(valid: Iterable[str]) -> str:
    """Format valid choices for an error message: ``'a', 'b', 'c'``."""
    return ", ".join(repr(v) for v in sorted(valid))
