"""A finished run of the FAST sokoban-tiny config, trained once per test worker: the
reference that several end-to-end tests compare another run with (read only)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def fast_run(tmp_path_factory):
    """Run directory of ``train(load_config("sokoban-tiny", test_train_tiny.FAST))``,
    uninterrupted, in process; tests must not write into it."""
    from test_train_tiny import FAST

    from turnforge.app.config import load_config
    from turnforge.app.run import train

    out = tmp_path_factory.mktemp("fast_run") / "run"
    train(load_config("sokoban-tiny", FAST), out, live=False)
    return out
