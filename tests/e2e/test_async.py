"""Asynchronous training end to end: on-policy equivalence at eta=0, bounded staleness,
fault injection (killed and hung env workers), Ray scale-out, bad input."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from test_train_tiny import FAST
from turnforge.config import load_config
from turnforge.envs import register
from turnforge.train.run import train

pytestmark = pytest.mark.slow


def _events(run_dir, name="rl_iter"):
    return [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if e["event"] == name]


def test_async_eta0_is_on_policy(tmp_path):
    """eta=0: every token was sampled by the weights being updated, so all importance
    weights are 1 (up to float error between the KV-cache sampler and the trainer)."""
    summary = train(
        load_config("sokoban-tiny", FAST + ["engine.mode=async", "engine.eta=0", "rl.skip_zero_variance_groups=false"]),
        tmp_path / "r", live=False,
    )
    assert summary["rl_iterations"] == 3 and summary["engine"]["mode"] == "async"
    for e in _events(tmp_path / "r"):
        assert e["staleness_max"] == 0 and e["offpolicy_token_fraction"] == 0
        assert abs(e["is_weight_max"] - 1) < 1e-3 and e["is_truncated_fraction"] == 0
        assert e["logprob_mismatch_max"] < 1e-3


def test_async_eta2_partial_rollouts_bounded(tmp_path):
    over = FAST + ["engine.mode=async", "engine.eta=2", "engine.partial_rollouts=true", "rl.iterations=5",
                   "rl.skip_zero_variance_groups=false"]
    train(load_config("sokoban-tiny", over), tmp_path / "r", live=False)
    events = _events(tmp_path / "r")
    assert len(events) == 5 and max(e["staleness_max"] for e in events) <= 2
    assert any(e["offpolicy_token_fraction"] > 0 and e["staleness_max"] >= 1 for e in events)  # it did run ahead


def test_fault_injection_every_episode_accounted_once(tmp_path):
    """Env workers die on ~5% of steps and one hangs past its timeout: the run completes,
    and every trajectory the trainer got is there once (finished, resumed or failed)."""
    register("sokoban-faulty", "faulty_env:FaultySokobanEnv", overwrite=True, dim=6, num_boxes=1)
    over = FAST + [
        "env.id=sokoban-faulty", "env.kwargs.crash_prob=0.05", f"env.kwargs.hang_flag={tmp_path / 'hang'}",
        "env.kwargs.hang_seconds=30", "engine.mode=async", "engine.eta=1", "engine.env_workers=2", "engine.step_timeout=3",
        "rl.iterations=4", "eval.episodes=4", "rollout.max_turns=5",
    ]
    summary = train(load_config("sokoban-tiny", over), tmp_path / "r", live=False)
    assert summary["rl_iterations"] == 4
    events = _events(tmp_path / "r")
    assert sum(e["env_worker_restarts"] for e in events[-1:]) >= 2  # crashes and the hang
    assert events[-1]["env_timeouts"] >= 1
    ids = []
    for it in range(4):
        table = pq.read_table(tmp_path / "r" / "trajectories" / f"rl_{it:05d}.parquet", columns=["trajectory_id"])
        ids += list(dict.fromkeys(table.column("trajectory_id").to_pylist()))  # rows are samples: one id per trajectory
    assert len(ids) == len(set(ids)) == 4 * 3 * 2
    assert sum(e["resumed_steps"] for e in events) + sum(e["infra_failures"] for e in events) > 0


def test_cluster_ray_trains(tmp_path):
    """cluster=ray: the rollout worker is a Ray actor on a local Ray instance; the trainer
    ships weights through the object store after every update."""
    ray = pytest.importorskip("ray")
    over = FAST + ["cluster=ray", "engine.mode=async", "engine.eta=1", "rl.skip_zero_variance_groups=false"]
    try:
        summary = train(load_config("sokoban-tiny", over), tmp_path / "r", live=False)
    finally:
        ray.shutdown()
    assert summary["rl_iterations"] == 3 and summary["engine"]["cluster"] == "ray"
    events = _events(tmp_path / "r")
    assert all(e["staleness_max"] <= 1 for e in events)
    assert max(e["policy_version"] for e in events) == summary["policy_version"]
