"""Trainer ranks placed by Ray (``cluster=ray``, ``turnforge.app.ray_ranks``) on a local two-node
cluster: the ranks can only go to one node (custom resource ``trainer``), the env workers only
to the other (``envs``); two RL iterations end with the run directory of a run on torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from helpers import NO_FLYWHEEL, TINY_TEST_SHAPE  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from turnforge.app.setup import load_run_config
from turnforge.train.metrics import read_metrics, read_summary  # noqa: E402

RUN = [
    *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()], *NO_FLYWHEEL,
    "bc.num_demos=8", "bc.epochs=1", "bc.batch_size=8", "rl.iterations=2", "rl.tasks_per_iteration=2", "rl.group_size=2",
    "rollout.max_turns=4", "eval.episodes=2", "threads=2",
]


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"trainer": 2}})
    cluster.add_node(num_cpus=2, resources={"envs": 2})
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


@pytest.mark.slow
def test_trainer_ranks_and_env_workers_on_different_nodes(two_nodes, tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "turnforge.cli", "train", "sokoban-tiny", *RUN, "cluster=ray",
         f"engine.ray_address={two_nodes.address}", "engine.env_workers=1", "dist.ray_resources={trainer: 1}",
         "engine.ray_env_resources={envs: 1}", "--out", str(out), "--nproc", "2"],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training on Ray: 2 ranks on 1 node(s)" in proc.stderr
    summary = read_summary(out)
    assert summary.rl_iterations == 2 and summary.eval_after_rl.episodes == 2
    assert [m.iteration for m in read_metrics(out).iterations] == [1, 2]
    assert load_run_config(out).dist.nproc == 2 and (out / "checkpoints" / "final" / "model.safetensors").exists()


def test_a_cluster_without_room_is_one_line(two_nodes, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "turnforge.cli", "train", "sokoban-tiny", *RUN, "cluster=ray",
         f"engine.ray_address={two_nodes.address}", "dist.ray_resources={gpu_box: 1}", "--out", str(tmp_path / "run"),
         "--nproc", "2"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "the Ray cluster has no room for dist.nproc=2 trainer ranks" in last, proc.stderr[-2000:]
