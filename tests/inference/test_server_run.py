"""A whole LoRA run with ``rollout.backend=server`` on two ``turnforge serve`` replicas, one of
which is killed mid-run: the run goes on with the other, in one line, and samples the same
tokens as sampling in the trainer's process with per-episode noise (nothing of the dead replica
is used); after the first full push every update moves the adapter only; the metrics carry the
replicas' counters and the mismatch watch, which the viewer charts."""

from __future__ import annotations

import duckdb
import pytest
from helpers import NO_FLYWHEEL, TINY_TEST_SHAPE

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.inference.client import ServerSampler
from turnforge.train.metrics import read_metrics
from turnforge.view.rundir import read_series

pytestmark = pytest.mark.slow

FAST = [
    *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()], *NO_FLYWHEEL,
    "model.lora.r=4", "bc.num_demos=8", "bc.epochs=2", "bc.batch_size=8",
    "rl.advantage=w_reinforce",  # failures pushed down even where every episode fails alike: the adapters move
    "rl.iterations=2", "rl.tasks_per_iteration=4", "rl.group_size=2", "rl.minibatch_size=32",
    "eval.episodes=8", "eval.every=0", "eval.bc_temperatures=[1.0]", "eval.pass_at_k_samples=0", "checkpoint_every=5",
]


def _tokens(run) -> list:
    return duckdb.sql(f"SELECT trajectory_id, token_ids, versions FROM '{run}/trajectories/rl_*.parquet' "
                      "ORDER BY trajectory_id, first_turn").fetchall()


def test_a_server_run_samples_the_in_process_tokens_and_pushes_adapters_through_a_replica_death(tmp_path, monkeypatch,
                                                                                                   capsys):
    served, local = tmp_path / "served", tmp_path / "local"
    push = ServerSampler.push

    def push_then_kill(self, model, version):  # replica 1 dies right after the second push, mid-run
        pushed = push(self, model, version)
        if pushed is not None and pushed.push == 2:
            self.replicas[1].process.kill()
            self.replicas[1].process.wait()
        return pushed

    monkeypatch.setattr(ServerSampler, "push", push_then_kill)
    train(load_config("frozenlake-tiny", FAST + ["rollout.backend=server", "rollout.server.replicas=2"]), served, live=False)
    died = [line for line in capsys.readouterr().err.splitlines() if line.startswith("inference: replica 1")]
    assert len(died) == 1 and "failed to sample" in died[0] and died[0].endswith("1 of 2 replicas left")
    train(load_config("frozenlake-tiny", FAST + ["rollout.noise=episode"]), local, live=False)
    a, b = _tokens(served), _tokens(local)
    assert len({x[0] for x in a}) == 16 and [x[1] for x in a] == [x[1] for x in b]  # 2 iterations x 4 tasks x 2 episodes
    versions = sorted({int(v) for _, _, vs in a for v in vs if v >= 0})
    assert versions == [0, 1]  # iteration i sampled with version i
    iters = read_metrics(served).iterations
    assert all(it.update.loss != 0 for it in iters)  # the weights moved: the pushes carry trained adapters
    last = iters[-1].inference
    assert last.replicas_alive == 1 and last.replicas_lost == 1 and last.retried_rows > 0  # its rows sampled again
    # the BC policy's evaluation and iteration 1 sample version 0 (one full push), iteration 2 version 1 (the adapter)
    assert (last.pushes, last.full_pushes, last.last_push.version, last.last_push.kind) == (2, 1, 1, "adapter")
    assert last.last_push.bytes * 5 < last.push_bytes - last.last_push.bytes  # (a test-sized model: rank 4 is a tenth of it)
    off = iters[-1].update.offpolicy
    assert off.ratio_out_of_band == 0.0 and off.log_ratio_abs_max < 1e-3
    assert (served / "logs" / "replica-0.log").exists() and (served / "weights").is_dir()
    columns = read_series(served / "metrics.jsonl")[0]["rl_iter"].columns  # what the viewer's charts offer
    assert {"update.offpolicy.ratio_out_of_band", "update.offpolicy.log_ratio_abs_mean", "inference.pushes",
            "inference.replicas_alive", "inference.last_push.version"} <= set(columns)
