"""The terminal env end to end with the tiny model: BC on the reference commands, a GRPO
iteration on the verifier's reward, evaluations per family."""

from __future__ import annotations

import pytest

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.data.query import TrajectoryStore
from turnforge.envs.terminal.generated import FAMILIES
from turnforge.sandbox.box import BOXES

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(BOXES["bwrap"].unavailable() is not None, reason="needs bubblewrap")]

FAST = ["model.tiny.corpus_episodes=20", "bc.num_demos=24", "bc.epochs=1", "rl.iterations=1", "rl.tasks_per_iteration=4",
        "rl.group_size=2", "eval.episodes=8", "eval.bc_temperatures=[]", "engine.env_slots=16", "threads=1"]


def test_terminal_tiny_trains_on_verified_rewards(tmp_path):
    summary = train(load_config("terminal-tiny", FAST), tmp_path / "run", live=False)
    assert summary is not None and summary.eval_after_rl.episodes == 8
    store = TrajectoryStore(tmp_path / "run")
    rows = store.sql("SELECT stage, count(*) AS n, sum(CAST(success AS INT)) AS wins, count(infra_failure) AS infra "
                     "FROM trajectories GROUP BY stage ORDER BY stage").to_pylist()
    by_stage = {r["stage"]: r for r in rows}
    assert by_stage["bc"]["n"] == 24 and by_stage["bc"]["wins"] == 24  # the reference commands pass their hidden tests
    assert by_stage["rl"]["n"] == 8 and by_stage["rl"]["infra"] == 0
    labels = set(FAMILIES) | {f"heldout/{f}" for f, family in FAMILIES.items() if family.heldout}
    assert summary.eval_after_rl.by_label and {x.label for x in summary.eval_after_rl.by_label} <= labels
