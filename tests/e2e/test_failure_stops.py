"""Infrastructure failures through a tiny ``train()``: every stage counts them, the Parquet files
hold them, and more than ``max_failure_share`` of a stage's episodes stop the run, never a
success rate or reward of 0."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from helpers import NO_FLYWHEEL, TINY_TEST_SHAPE

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.envs import make, register
from turnforge.errors import RunStopped
from turnforge.seeding import stable_hash
from turnforge.train.metrics import read_metrics

pytestmark = pytest.mark.slow

EchoEnv = type(make("test-echo"))  # tests/conftest.py


class FlakyEnv(EchoEnv):
    """The test echo env with infrastructure failures injected: ``reset()`` raises on tasks whose
    index % ``every`` is in ``reset_fails`` and on the env seeds in ``seed_fails``; ``step()``
    raises on the first step of tasks whose index % ``every`` is in ``step_fails``, and on the
    action 'boom' (one of its two action names: random actors play it, the expert never)."""

    action_names = ("up", "boom")

    def __init__(self, *, every: int = 1, reset_fails: list[int] = (), step_fails: list[int] = (),
                 seed_fails: list[int] = (), **kwargs) -> None:
        super().__init__(**kwargs)
        self.every, self.reset_fails, self.step_fails, self.seed_fails = every, set(reset_fails), set(step_fails), set(seed_fails)

    def reset(self, task=None, seed=None):
        if task.index % self.every in self.reset_fails or seed in self.seed_fails:
            raise RuntimeError("simulated reset failure")
        return super().reset(task=task, seed=seed)

    def apply(self, action):
        if action == "boom" or (self.state["t"] == 0 and self.current_task.index % self.every in self.step_fails):
            raise RuntimeError("simulated step failure")
        return super().apply(action)


register("test-flaky", FlakyEnv, overwrite=True)

FAST = [
    *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()], *NO_FLYWHEEL,
    "env.id=test-flaky", "check_env=false", "bc.num_demos=8", "bc.expert_noise=0", "bc.epochs=1", "bc.batch_size=8",
    "rl.iterations=1", "rl.tasks_per_iteration=4", "rl.group_size=2", "rl.minibatch_size=16",
    "rollout.max_turns=3", "eval.episodes=8", "eval.every=0", "threads=1",
]


def _run(tmp_path, env_kwargs: dict, *overrides: str):
    cfg = load_config("sokoban-tiny", FAST + [f"env.kwargs={json.dumps(env_kwargs)}", *overrides])
    return train(cfg, tmp_path / "run", live=False)


def _events(tmp_path) -> list[str]:
    return [json.loads(line)["event"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def _rows(tmp_path, name: str) -> list[dict]:
    return pq.read_table(tmp_path / "run" / "trajectories" / name).to_pylist()


def test_every_reset_failing_stops_the_run_at_the_demonstrations(tmp_path):
    with pytest.raises(RunStopped) as err:
        _run(tmp_path, {"reset_fails": [0]})
    msg = str(err.value)
    assert msg.startswith("bc: 8 of 8 demonstration episodes on env 'test-flaky' failed")
    assert "first error: env reset() raised on test-flaky:train:0" in msg and "RuntimeError: simulated reset failure" in msg
    assert _events(tmp_path) == []  # no BC record, no evaluation, no RL iteration: nothing scored 0
    demos = _rows(tmp_path, "bc_demos.parquet")  # every failed reset is a row without tokens
    assert [r["trajectory_id"] for r in demos] == [f"demo-{i}" for i in range(8)]
    assert all(r["token_ids"] is None and r["turn_index"] is None and r["reward"] is None and r["success"] is None
               and "simulated reset failure" in r["infra_failure"] for r in demos)


def test_every_step_failing_stops_the_run_at_the_demonstrations(tmp_path):
    with pytest.raises(RunStopped, match=r"^bc: 8 of 8 demonstration episodes .*first error: env step\(\) raised on "
                                         r"test-flaky:train:0 \(seed \d+\): RuntimeError: simulated step failure$"):
        _run(tmp_path, {"step_fails": [0]})
    assert _events(tmp_path) == []
    assert all(r["infra_failure"] for r in _rows(tmp_path, "bc_demos.parquet"))


def test_without_bc_an_evaluation_where_every_episode_fails_raises_even_at_share_1(tmp_path):
    with pytest.raises(RunStopped, match=r"^eval before-rl: 8 of 8 heldout evaluation episodes .*nothing is left"):
        _run(tmp_path, {"step_fails": [0]}, "bc.enabled=false", "max_failure_share=1.0")
    assert "eval" not in _events(tmp_path)


def test_failing_rl_rollouts_stop_the_run_with_their_batch_written(tmp_path):
    rl_seeds = [stable_hash(0, "rl", 0, j, g) for j in range(4) for g in range(2)]
    with pytest.raises(RunStopped, match=r"^rl iteration 1: 8 of 8 rollout episodes .*simulated reset failure$"):
        _run(tmp_path, {"seed_fails": rl_seeds})
    assert _events(tmp_path) == ["bc_epoch", "bc_done", "eval"]  # no rl_iter with reward 0
    rows = _rows(tmp_path, "rl_00000.parquet")
    assert len(rows) == 8 and all(r["infra_failure"] and r["token_ids"] is None for r in rows)


def test_failing_value_pretraining_stops_the_run(tmp_path):
    vp_seeds = [stable_hash(0, "value-pretrain", i) for i in range(8)]
    with pytest.raises(RunStopped, match=r"^value pretraining: 8 of 8 BC-policy episodes .*simulated reset failure$"):
        _run(tmp_path, {"seed_fails": vp_seeds}, "rl.advantage=gae", "critic.enabled=true", "critic.pretrain_episodes=8")
    assert "value_pretrain" not in _events(tmp_path)


def test_failing_monte_carlo_rollouts_stop_the_run(tmp_path):
    """Random Monte-Carlo rollouts play 'boom' half the time; the policy and the expert never do."""
    with pytest.raises(RunStopped, match=r"^rl iteration 1, Monte-Carlo values: \d+ of \d+ Monte-Carlo rollouts .*"
                                         r"more than max_failure_share=0.1 allows.*simulated step failure$"):
        _run(tmp_path, {}, "rl.advantage=gae", "critic.mc_weight=1", "critic.mc_rollouts=2")
    assert "rl_iter" not in _events(tmp_path)


def test_a_moderate_failure_share_is_counted_and_written(tmp_path):
    """Tasks 3 (reset) and 5 (first step) of every 8 fail: 2 of the 8 demonstrations, 2 of the 8
    held-out episodes, and in RL iteration 1 (tasks drawn from the seed) the 2 episodes of its
    task with index % 8 == 3: a share of 0.25, under max_failure_share=0.3."""
    summary = _run(tmp_path, {"every": 8, "reset_fails": [3], "step_fails": [5]}, "max_failure_share=0.3")
    metrics = read_metrics(tmp_path / "run")
    assert metrics.bc.demo_infra_failures == 2 and metrics.bc.demonstrations == 6
    assert [(e.result.episodes, e.result.infra_failures) for e in metrics.evals] == [(6, 2), (6, 2)]
    assert summary.eval_after_rl.infra_failures == 2
    (it,) = metrics.iterations
    assert (it.rollout.episodes, it.rollout.infra_failures) == (8, 2)

    demos = _rows(tmp_path, "bc_demos.parquet")
    assert {r["trajectory_id"] for r in demos} == {f"demo-{i}" for i in range(8)}  # every demonstration is there
    failed = {r["trajectory_id"]: r for r in demos if r["infra_failure"]}
    assert set(failed) == {"demo-3", "demo-5"}
    assert failed["demo-3"]["token_ids"] is None and "env reset() raised" in failed["demo-3"]["infra_failure"]
    assert failed["demo-5"]["token_ids"] and "env step() raised" in failed["demo-5"]["infra_failure"]
    assert all(r["reward"] is None and r["success"] is None for r in failed.values())
    assert all(r["reward"] is not None and r["token_ids"] for r in demos if not r["infra_failure"])

    rl = _rows(tmp_path, "rl_00000.parquet")
    assert len({r["trajectory_id"] for r in rl}) == 8
    crashed = [r for r in rl if r["infra_failure"]]
    assert len(crashed) == 2 and all(r["token_ids"] is None and "simulated reset failure" in r["infra_failure"] for r in crashed)
