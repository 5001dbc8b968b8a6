"""The tiny FrozenLake run the best-of-N and lookahead tests evaluate."""

from __future__ import annotations

import pytest
from helpers import NO_FLYWHEEL

QUICK = [*NO_FLYWHEEL, "bc.num_demos=48", "bc.epochs=3", "eval.episodes=8", "check_env=false", "rl.iterations=1",
         "rl.tasks_per_iteration=2", "rl.group_size=2", "checkpoint_every=1"]


@pytest.fixture(scope="session")
def critic_run(tmp_path_factory):
    """frozenlake-tiny's own tiny model, BC from 48 demonstrations, one GAE iteration with a
    critic: about 0.3 held-out success at T = 1, so attempts differ."""
    from turnforge.app.config import load_config
    from turnforge.app.run import train

    run = tmp_path_factory.mktemp("best_of") / "run"
    train(load_config("frozenlake-tiny", [*QUICK, "rl.advantage=gae", "critic.enabled=true"]), run, live=False)
    return run
