"""Judge rewards in training runs: an env run and an agent run scored by a judge model, the
verdicts in the trajectory store, and a judge that gives no score stopping the run."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import TINY_TEST_SHAPE

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.errors import RunStopped

REPO = Path(__file__).resolve().parents[2]
SHAPE = [f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()]
CALC = [*SHAPE, "model.tiny.corpus_episodes=20", "bc.num_demos=16", "bc.epochs=1", "rl.iterations=2",
        "rl.tasks_per_iteration=2", "rl.group_size=2", "eval.episodes=4", "eval.every=2",
        "eval.pass_at_k_samples=0"]


def _rl_rows(run: Path) -> list[dict]:
    return [r for f in sorted((run / "trajectories").glob("rl_*.parquet")) for r in pq.read_table(f).to_pylist()]


@pytest.mark.slow
def test_an_env_run_trains_on_the_judges_reward_and_stores_its_verdicts(tmp_path):
    run = tmp_path / "run"
    summary = train(load_config("calculator-tiny", CALC + ["reward.judge.enabled=true", "reward.judge.mode=yes_no"]),
                    run, live=False)
    assert summary.rl_iterations == 2
    rows = [r for r in _rl_rows(run) if r["infra_failure"] is None]
    assert len({r["trajectory_id"] for r in rows}) == 8
    for r in rows:
        assert r["judge_prompt"].endswith("Answer:") and "Is the agent's final answer correct?" in r["judge_prompt"]
        assert r["judge_output"].startswith(("Yes (p=", "No (p=")) and 0 <= r["judge_score"] <= 1
        # the last turn's reward is the judge's P(Yes); earlier turns keep the env's invalid-action
        # penalties (-0.5 each in this recipe); the env's own return is kept beside it
        penalties = (r["reward"] - r["judge_score"]) / -0.5
        assert penalties == pytest.approx(round(penalties), abs=1e-5) and round(penalties) >= 0
        assert r["verifier_reward"] is not None
    assert any(r["reward"] != r["verifier_reward"] for r in rows)
    # evaluation still scores the env's own success
    assert summary.eval_after_rl.episodes == 4


@pytest.mark.slow
def test_a_judge_that_gives_no_score_stops_the_run_instead_of_scoring_zero(tmp_path):
    # the tiny policy as its own judge writes no number after "Score:": every episode fails
    with pytest.raises(RunStopped, match="the judge gave no score in 0..10"):
        train(load_config("calculator-tiny", CALC + ["reward.judge.enabled=true", "reward.judge.max_new_tokens=2"]),
              tmp_path / "run", live=False)
    rows = _rl_rows(tmp_path / "run")
    assert rows and all(r["infra_failure"].startswith("the judge gave no score") for r in rows)
    assert all(r["reward"] is None and r["judge_output"] is not None for r in rows)


@pytest.mark.slow
def test_an_agent_run_with_agent_reward_judge(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    args = [*SHAPE, "rl.iterations=1", "rl.tasks_per_iteration=2", "rl.group_size=2", "eval.episodes=4", "eval.pass_at_k_samples=0",
            "agent.reward=judge", "reward.judge.mode=yes_no", "reward.judge.rubric=Is this a move? {final}"]
    summary = train(load_config("agent-tiny", args), tmp_path / "run", live=False)
    assert summary.rl_iterations == 1
    rows = [r for r in _rl_rows(tmp_path / "run") if r["infra_failure"] is None]
    assert rows and all(r["judge_prompt"].count("Is this a move?") == 1 and 0 <= r["judge_score"] <= 1 for r in rows)
    assert all(r["reward"] == pytest.approx(r["judge_score"], abs=1e-6) for r in rows)  # one turn: the reward is the score
