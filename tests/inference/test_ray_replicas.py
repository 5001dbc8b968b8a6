"""Inference replicas as Ray actors (``rollout.server.launch=ray``) on a local Ray instance: a
LoRA run samples on two actor replicas, one killed by Ray mid-run; the run goes on with the
other, in one line, and samples the same tokens as sampling in the trainer's process."""

from __future__ import annotations

import duckdb
import pytest
from helpers import NO_FLYWHEEL, TINY_TEST_SHAPE

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.inference.client import ServerSampler
from turnforge.train.metrics import read_metrics

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

FAST = [
    *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()], *NO_FLYWHEEL,
    "model.lora.r=4", "bc.num_demos=8", "bc.epochs=2", "bc.batch_size=8", "rl.advantage=w_reinforce",
    "rl.iterations=2", "rl.tasks_per_iteration=4", "rl.group_size=2", "rl.minibatch_size=32",
    "eval.episodes=8", "eval.every=0", "eval.bc_temperatures=[1.0]", "eval.pass_at_k_samples=0", "checkpoint_every=5",
]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """A local Ray instance for this module, shut down after it (so no other test finds it running)."""
    import ray

    from turnforge.envpool import connect_ray

    connect_ray(None, num_cpus=2)
    yield
    ray.shutdown()


def _tokens(run) -> list:
    return duckdb.sql(f"SELECT trajectory_id, token_ids FROM '{run}/trajectories/rl_*.parquet' "
                      "ORDER BY trajectory_id, first_turn").fetchall()


def test_ray_actor_replicas_sample_the_in_process_tokens_through_an_actor_death(tmp_path, monkeypatch, capsys):
    import ray

    served, local = tmp_path / "served", tmp_path / "local"
    push, killed = ServerSampler.push, []

    def push_then_kill(self, model, version):  # replica 1's actor is killed right after the second push
        pushed = push(self, model, version)
        if pushed is not None and pushed.push == 2:
            assert self.replicas[1].actor is not None and self.replicas[1].process is None
            ray.kill(self.replicas[1].actor)
            killed.append(self.replicas[1].url)
        return pushed

    monkeypatch.setattr(ServerSampler, "push", push_then_kill)
    train(load_config("frozenlake-tiny", FAST + ["rollout.backend=server", "rollout.server.replicas=2",
                                                 "rollout.server.launch=ray", "rollout.server.threads=1",
                                                 "rollout.server.timeout_s=300"]), served, live=False)
    died = [line for line in capsys.readouterr().err.splitlines() if line.startswith("inference: replica 1")]
    assert killed and len(died) == 1 and "failed to sample" in died[0] and died[0].endswith("1 of 2 replicas left")
    assert killed[0].startswith("http://") and not killed[0].startswith("http://0.0.0.0")  # the node's address
    train(load_config("frozenlake-tiny", FAST + ["rollout.noise=episode"]), local, live=False)
    a, b = _tokens(served), _tokens(local)
    assert len({x[0] for x in a}) == 16 and [x[1] for x in a] == [x[1] for x in b]  # 2 iterations x 4 tasks x 2 episodes
    last = read_metrics(served).iterations[-1].inference
    assert last.replicas_alive == 1 and last.replicas_lost == 1 and last.retried_rows > 0
