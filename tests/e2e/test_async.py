"""Asynchronous training end to end: on-policy equivalence at eta=0, bounded staleness,
fault injection (killed and hung env workers), Ray scale-out, bad input."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from test_train_tiny import FAST

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.envs import register
from turnforge.train.metrics import read_metrics, read_summary

pytestmark = pytest.mark.slow


def _events(run_dir):
    return read_metrics(run_dir).iterations


def test_async_eta0_is_on_policy(tmp_path):
    """eta=0: every token was sampled by the weights being updated, so all importance
    weights are 1 (up to float error between the KV-cache sampler and the trainer). Sampled at
    a tempered T = 0.7: the proximal policy scores the tokens at the temperature they were drawn
    at (scored at T = 1 the largest IS weight is 1.15), so the update trains the distribution it sampled."""
    summary = train(
        load_config("sokoban-tiny", FAST + ["engine.mode=async", "engine.eta=0", "rl.skip_zero_variance_groups=false",
                                            "rollout.temperature=0.7"]),
        tmp_path / "r", live=False,
    )
    assert summary.rl_iterations == 3 and summary.engine_mode == "async"
    for m in _events(tmp_path / "r"):
        off = m.update.offpolicy
        assert m.stream.staleness_max == 0 and off.offpolicy_token_fraction == 0
        assert abs(off.is_weight_max - 1) < 1e-3 and off.is_truncated_fraction == 0
        assert off.logprob_mismatch_max < 1e-3


def test_async_eta2_partial_rollouts_bounded(tmp_path):
    over = FAST + ["engine.mode=async", "engine.eta=2", "engine.partial_rollouts=true", "rl.iterations=5",
                   "rl.skip_zero_variance_groups=false"]
    train(load_config("sokoban-tiny", over), tmp_path / "r", live=False)
    events = _events(tmp_path / "r")
    assert len(events) == 5 and max(m.stream.staleness_max for m in events) <= 2
    assert any(m.update.offpolicy.offpolicy_token_fraction > 0 and m.stream.staleness_max >= 1 for m in events)  # it ran ahead


def test_fault_injection_every_episode_accounted_once(tmp_path):
    """Env workers die on ~5% of steps and one hangs past its timeout: the run completes,
    and every trajectory the trainer got is there once (finished, resumed or failed)."""
    register("sokoban-faulty", "faulty_env:FaultySokobanEnv", overwrite=True, dim=6, num_boxes=1)
    over = FAST + [
        "env.id=sokoban-faulty", "env.kwargs.crash_prob=0.05", f"env.kwargs.hang_flag={tmp_path / 'hang'}",
        "env.kwargs.hang_seconds=30", "engine.mode=async", "engine.eta=1", "engine.env_workers=2", "engine.step_timeout=3",
        "rl.iterations=4", "eval.episodes=4", "rollout.max_turns=5",
        # a request whose worker dies twice is an infrastructure failure (unseeded chaos: about one run in
        # ten has one); with 4-episode evaluations one is 25%, above the default limit of 10%
        "max_failure_share=0.5",
    ]
    summary = train(load_config("sokoban-tiny", over), tmp_path / "r", live=False)
    assert summary.rl_iterations == 4
    events = _events(tmp_path / "r")
    # demonstrations and evaluations play on the env workers too (the run's own pool, in the summary)
    assert summary.env_pool.restarts + events[-1].stream.env_pool.restarts >= 2  # crashes and the hang
    assert summary.env_pool.timeouts + events[-1].stream.env_pool.timeouts >= 1
    ids = []
    for it in range(4):
        table = pq.read_table(tmp_path / "r" / "trajectories" / f"rl_{it:05d}.parquet", columns=["trajectory_id"])
        ids += list(dict.fromkeys(table.column("trajectory_id").to_pylist()))  # rows are samples: one id per trajectory
    assert len(ids) == len(set(ids)) == 4 * 3 * 2
    assert sum(m.stream.resumed_steps for m in events) + sum(m.rollout.infra_failures for m in events) > 0


def test_cluster_ray_trains(tmp_path, fast_run):
    """cluster=ray: the rollout worker is a Ray actor on a local Ray instance; the trainer
    ships weights through the object store after every update. Synchronous (lock-step) it
    trains exactly what the in-process run trains; asynchronous it stays within eta."""
    ray = pytest.importorskip("ray")
    local = read_summary(fast_run)  # the same config, in process
    try:
        sync = train(load_config("sokoban-tiny", FAST + ["cluster=ray"]), tmp_path / "sync", live=False)
        over = FAST + ["cluster=ray", "engine.mode=async", "engine.eta=1", "rl.skip_zero_variance_groups=false"]
        summary = train(load_config("sokoban-tiny", over), tmp_path / "r", live=False)
    finally:
        ray.shutdown()
    assert sync.cluster == "ray" and sync.eval_after_rl == local.eval_after_rl
    a = load_file(str(fast_run / "checkpoints" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "sync" / "checkpoints" / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert summary.rl_iterations == 3 and summary.cluster == "ray"
    events = _events(tmp_path / "r")
    assert all(m.stream.staleness_max <= 1 for m in events)
    assert max(m.policy_version for m in events) == summary.policy_version


def test_sync_run_does_not_depend_on_the_env_backend(tmp_path, fast_run):
    """Evaluation, demonstrations and RL all play on env worker processes with
    engine.env_workers=2; lock-step rounds make the run token-identical to the in-process one."""
    a = read_summary(fast_run)
    b = train(load_config("sokoban-tiny", FAST + ["engine.env_workers=2"]), tmp_path / "b", live=False)
    assert a.eval_before_rl == b.eval_before_rl and a.eval_after_rl == b.eval_after_rl
    wa = load_file(str(fast_run / "checkpoints" / "final" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "checkpoints" / "final" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(m.stream.env_pool is not None for m in _events(tmp_path / "b")) and b.env_pool.steps > 0
