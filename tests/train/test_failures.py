"""Failure accounting: the one decision (``check_failures``) against hand-computed shares, the
Parquet rows of failed episodes, and an evaluation that scores nothing."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from helpers import inline_engine
from turnforge.config import RolloutConfig, TrainConfig
from turnforge.data.store import write_trajectories
from turnforge.errors import RunStopped
from turnforge.train.evaluate import evaluate, summarize
from turnforge.train.run_dir.failures import DEFAULT_MAX_FAILURE_SHARE, check_failures, count_failures
from turnforge.types import Sample, Task, Trajectory, Turn

ERR = "env reset() raised on t:train:3 (seed 3): RuntimeError: boom"


def check(failed: int, total: int, share: float) -> None:
    check_failures("bc", "sokoban", failed, total, ERR if failed else None, share, kind="demonstration episodes")


@pytest.mark.parametrize("failed, total, share", [
    (4, 16, 0.25),  # 4/16 = 0.25: exactly the share goes on
    (3, 30, 0.1),  # 3/30 = 0.1 (the nearest doubles agree; 0.1 * 30 would be 3.0000000000000004)
    (1, 10, 0.1),
    (0, 16, 0.0),  # no failure: goes on even at share 0
    (0, 0, 0.0),  # no episode: nothing to decide
    (15, 16, 1.0),  # share 1 tolerates everything but all of them
])
def test_at_or_below_the_share_the_stage_goes_on(failed, total, share):
    check(failed, total, share)


@pytest.mark.parametrize("failed, total, share", [
    (5, 16, 0.25),  # 5/16 = 0.3125 > 0.25
    (4, 30, 0.1),  # 0.1333 > 0.1
    (1, 16, 0.0),  # 0.0625 > 0
    (2, 3, 0.5),  # 0.667 > 0.5
])
def test_above_the_share_the_run_stops(failed, total, share):
    with pytest.raises(RunStopped, match=rf"more than max_failure_share={share:g} allows"):
        check(failed, total, share)


def test_the_message_names_stage_env_count_knob_and_first_error():
    with pytest.raises(RunStopped) as err:
        check(12, 16, 0.1)
    assert str(err.value) == (
        "bc: 12 of 16 demonstration episodes on env 'sokoban' failed in the env machinery (not the policy), more than "
        "max_failure_share=0.1 allows (fix the env, or raise max_failure_share to go on without them); first error: " + ERR
    )


@pytest.mark.parametrize("share", [0.1, 1.0])
def test_all_failed_stops_whatever_the_share(share):
    with pytest.raises(RunStopped, match=r"^bc: 3 of 3 demonstration episodes .*nothing is left to use .*RuntimeError: boom$"):
        check(3, 3, share)


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="max_share must be in"):
        check(1, 2, 1.5)
    with pytest.raises(ValueError, match="failed must be in"):
        check(3, 2, 0.5)


def test_the_default_share_is_the_configs():
    assert DEFAULT_MAX_FAILURE_SHARE == TrainConfig().max_failure_share == 0.1


# ---------------------------------------------------------------------------- the Parquet rows
def _traj(tid: str, samples: int, failure: str | None, turns: int | None = None) -> Trajectory:
    sample = Sample(token_ids=np.array([5, 6, 7]), loss_mask=np.array([0, 1, 1], np.int8),
                    logprobs=np.array([np.nan, -0.5, -0.25], np.float32), versions=np.array([-1, 0, 0], np.int32),
                    trajectory_id=tid, turn_index=0)
    n_turns = samples if turns is None else turns
    return Trajectory(
        trajectory_id=tid, task=Task("t", "train", 0), group_id="g", env_seed=0,
        turns=tuple(Turn("obs", "up", 0.5, False, "") for _ in range(n_turns)),
        samples=tuple(sample for _ in range(samples)), episode_return=0.5 * n_turns, success=failure is None,
        terminated=failure is None, truncated=False, truncation_reason=None, policy_version=0, infra_failure=failure,
    )


def test_failed_episodes_get_rows_and_are_not_scored(tmp_path):
    trajs = [_traj("ok", 2, None), _traj("reset", 0, ERR), _traj("step", 1, "env step() raised: boom", turns=0)]
    assert count_failures(trajs) == (2, 3, ERR)
    n = write_trajectories(tmp_path / "x.parquet", trajs, stage="rl", iteration=0, advantages={"ok": [1.0, 2.0]})
    rows = pq.read_table(tmp_path / "x.parquet").to_pylist()
    assert n == len(rows) == 4 and [r["trajectory_id"] for r in rows] == ["ok", "ok", "reset", "step"]
    ok, reset, step = rows[0], rows[2], rows[3]
    assert ok["reward"] == 1.0 and ok["success"] is True and ok["infra_failure"] is None and ok["advantage"] == 1.0
    # a failed reset: one episode row, no tokens, not scored, the error kept
    assert reset["turn_index"] is None and reset["token_ids"] is None and reset["logprobs"] is None
    assert reset["loss_mask"] is None and reset["versions"] is None and reset["advantage"] is None
    assert reset["reward"] is None and reset["success"] is None and reset["infra_failure"] == ERR
    # a failed step keeps the sample it had, unscored
    assert step["token_ids"] == [5, 6, 7] and step["logprobs"] == [None, -0.5, -0.25]
    assert step["reward"] is None and step["success"] is None and step["infra_failure"] == "env step() raised: boom"


def test_an_episode_without_samples_that_did_not_fail_is_a_scored_row(tmp_path):
    write_trajectories(tmp_path / "x.parquet", [_traj("overflow", 0, None, turns=0)], stage="rl", iteration=0)
    (row,) = pq.read_table(tmp_path / "x.parquet").to_pylist()
    assert row["token_ids"] is None and row["reward"] == 0.0 and row["success"] is True and row["infra_failure"] is None


# ---------------------------------------------------------------------------- evaluation
def test_an_evaluation_that_scores_nothing_raises_even_at_share_1(tiny_policy):
    """Echo task 0 crashes on its first step (``crash_on=1``): the only episode fails."""
    engine = inline_engine(tiny_policy, "test-echo", RolloutConfig(max_turns=3, max_new_tokens=4), 1, crash_on=1)
    with pytest.raises(RunStopped, match=r"^evaluation: 1 of 1 train evaluation episodes on env 'test-echo' .*"
                                         r"nothing is left .*simulated env crash$"):
        evaluate(engine, tiny_policy, episodes=1, split="train", max_failure_share=1.0)


def test_evaluate_counts_failures_and_stops_above_its_share(tiny_policy):
    """Tasks 0 and 4 of 0..7 crash: 2 of 8 = 0.25."""
    engine = inline_engine(tiny_policy, "test-echo", RolloutConfig(max_turns=3, max_new_tokens=4), 4, crash_on=1)
    result, _ = evaluate(engine, tiny_policy, episodes=8, split="train")  # default share 1.0: counted, reported
    assert (result.episodes, result.infra_failures) == (6, 2)
    result, _ = evaluate(engine, tiny_policy, episodes=8, split="train", max_failure_share=0.25)
    assert result.infra_failures == 2
    with pytest.raises(RunStopped, match=r"^eval rl-3: 2 of 8 train evaluation episodes .*max_failure_share=0.2 allows"):
        evaluate(engine, tiny_policy, episodes=8, split="train", max_failure_share=0.2, stage="eval rl-3")


def test_summarize_refuses_an_empty_evaluation():
    with pytest.raises(ValueError, match="no heldout episode of env 'e' to score"):
        summarize("e", "heldout", [])


def test_the_tool_call_rate_counts_scored_episodes_with_a_call():
    def episode(tid, calls, failure=None):
        turns = tuple(Turn("obs", "a", 0.0, False, "", info={"n_tool_calls": c}) for c in calls)
        return Trajectory(trajectory_id=tid, task=Task("t", "heldout", 0), group_id="g", env_seed=0, turns=turns, samples=(),
                          episode_return=0.0, success=False, terminated=True, truncated=False, truncation_reason=None,
                          policy_version=0, infra_failure=failure)
    # 4 scored episodes, 2 of them call the tool (once in their second turn, twice in the first); the failed one is left out
    episodes = [episode("a", [0, 1]), episode("b", [2, 0]), episode("c", [0]), episode("d", []), episode("e", [1], ERR)]
    assert summarize("calc", "heldout", episodes, has_tools=True).tool_call_rate == 0.5
    assert summarize("calc", "heldout", episodes).tool_call_rate is None  # an env without tools: not counted


def test_a_start_point_whose_monte_carlo_rollouts_all_failed_has_no_value_not_zero():
    import numpy as np

    from turnforge.critic.mc import MCEstimate
    from turnforge.train.mc import known_values

    ok = MCEstimate(np.array([0.5, -1.0]), np.array([0.1, 0.2]), env_steps=8, failed=1, episodes=8, first_error="boom")
    assert known_values(ok, "mc", "e").tolist() == [0.5, -1.0]
    lost = MCEstimate(np.array([0.5, np.nan]), np.array([0.1, np.nan]), env_steps=4, failed=4, episodes=8, first_error="boom")
    with pytest.raises(RunStopped, match=r"^mc: 1 of 2 start points on env 'e' have no value .*first error: boom$"):
        known_values(lost, "mc", "e")


def test_success_per_label_by_hand():
    from dataclasses import replace

    from turnforge.train.evaluate import by_label

    t = [replace(_traj(f"t{i}", 1, None), success=ok) for i, ok in enumerate([True, False, True, True])]
    t.append(_traj("t4", 1, "env step() raised"))  # an infrastructure failure: not scored under its label
    result = summarize("x", "heldout", t, labels=["b", "a", "b", "a", "a"])
    assert [(x.label, x.episodes, x.successes) for x in result.by_label] == [("a", 2, 1), ("b", 2, 2)]
    assert [x.success_rate for x in result.by_label] == [0.5, 1.0]
    assert summarize("x", "heldout", t).by_label == () and by_label(t[:1], ["z"])[0].success_rate == 1.0
    with pytest.raises(ValueError):
        by_label(t, ["a"])  # one label per trajectory


def test_envs_label_their_tasks():
    from turnforge.envs import make

    gui = make("gui-click")
    assert {gui.task_label(gui.task("heldout", i)) for i in range(30)} == {"click", "type", "scroll"}
    mix = make("mix", weights=[1, 0])
    assert {mix.task_label(mix.task("heldout", i)) for i in range(10)} == {"sokoban"}
