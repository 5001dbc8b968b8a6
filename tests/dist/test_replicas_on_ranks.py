"""Two trainer ranks (gloo, FSDP2) sampling on two shared inference replicas
(``rollout.backend=server``): the same episodes and weights as one process on the same replicas,
every push sent by rank 0 from the gathered weights (broadcast over gloo here, files there); a
replica killed mid-run leaves the rotation of both ranks and the run goes on with the other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import psutil
import pytest

from helpers import NO_FLYWHEEL, TINY_TEST_SHAPE
from turnforge.train.metrics import read_metrics

pytestmark = pytest.mark.slow

RUN = [
    *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()], *NO_FLYWHEEL,
    "model.lora.r=4", "bc.num_demos=8", "bc.epochs=2", "bc.batch_size=8",
    "flywheel.rounds=1", "flywheel.filters=[infra]", "flywheel.env_steps_per_round=40", "flywheel.eval_episodes=4",
    "rl.advantage=w_reinforce", "rl.iterations=2", "rl.tasks_per_iteration=4", "rl.group_size=2", "rl.minibatch_size=32",
    "rollout.max_turns=8", "eval.episodes=4", "eval.every=0", "checkpoint_every=5", "threads=1",
    "rollout.backend=server", "rollout.server.replicas=2", "rollout.server.threads=1",
]
# float32 rounding differs between one rank's whole minibatch and two half ones (the scale-out tests' bound)
ATOL = 1e-4


def _train(out: Path, *extra: str, nproc: int = 1, timeout: float = 420) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "turnforge.cli", "train", "frozenlake-tiny", *RUN, *extra, "--out", str(out),
                           "--nproc", str(nproc)], capture_output=True, text=True, timeout=timeout, env=env)


def _tokens(run: Path, files: str) -> list:
    return duckdb.sql(f"SELECT trajectory_id, token_ids, versions FROM '{run}/trajectories/{files}' "
                      "ORDER BY trajectory_id, first_turn").fetchall()


def _difference(a: Path, b: Path) -> float:
    """The largest difference between two saved models' weights (a LoRA run's: merged)."""
    from safetensors.torch import load_file

    wa, wb = (load_file(str(p / "model.safetensors")) for p in (a, b))
    assert wa.keys() == wb.keys() and wa
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    for n, transport in ((1, "file"), (2, "gloo")):
        proc = _train(root / f"r{n}", f"rollout.server.transport={transport}", nproc=n)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "r1", root / "r2"


def test_two_ranks_on_shared_replicas_sample_and_train_as_one_process(one_and_two):
    one, two = one_and_two
    for files in ("flywheel_*.parquet", "rl_*.parquet"):  # each rank played its share on the replicas
        a, b = _tokens(one, files), _tokens(two, files)
        assert a and [x[1:] for x in a] == [x[1:] for x in b], files
    assert sorted({int(v) for _, _, vs in _tokens(two, "rl_*.parquet") for v in vs if v >= 0}) == [1, 2]  # the round made version 1
    assert [(e.tag, e.result) for e in read_metrics(one).evals] == [(e.tag, e.result) for e in read_metrics(two).evals]
    assert _difference(one / "checkpoints" / "bc", one / "checkpoints" / "final") > 100 * ATOL  # it did learn
    assert _difference(one / "checkpoints" / "final", two / "checkpoints" / "final") < ATOL
    last = read_metrics(two).iterations[-1].inference
    # rank 0 pushed after BC (full: a new adapter on a merged base), then after the round and after each RL
    # iteration's update (adapters), every rank's requests counted
    assert (last.pushes, last.full_pushes, last.last_push.version, last.last_push.kind) == (4, 1, 3, "adapter")
    assert last.requests > 0 and last.replicas_alive == 2 and last.replicas_lost == 0
    assert (one / "weights").is_dir() and not (two / "weights").exists()  # a broadcast writes no file


def _replica(out: Path, index: int) -> psutil.Process | None:
    """The ``turnforge serve`` process the run in ``out`` started as replica ``index`` (its seed says which)."""
    import yaml

    from turnforge.seeding import stable_hash

    seed = str(stable_hash(yaml.safe_load((out / "config.yaml").read_text())["seed"], "replica", index))
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "serve" in cmd and any(str(out) in c for c in cmd) and cmd[cmd.index("--seed") + 1] == seed:
            return proc
    return None


def test_a_replica_killed_mid_run_leaves_both_ranks_rotation(tmp_path):
    out = tmp_path / "run"
    killed: list[int] = []

    def kill_once_rl_starts():  # once the flywheel round's push is written, replica 1 dies
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            pushes = [json.loads(p.read_text()) for p in (out / "weights").glob("push-*/push.json")] if out.exists() else []
            victim = _replica(out, 1) if any(p["version"] >= 1 for p in pushes) else None
            if victim is not None:
                victim.kill()
                killed.append(victim.pid)
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=kill_once_rl_starts, daemon=True)
    watcher.start()
    proc = _train(out, "rl.iterations=3", nproc=2)
    watcher.join(1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert killed
    lines = [line for line in proc.stderr.splitlines() if line.startswith("inference: replica 1")]
    assert len(lines) == 1 and lines[0].endswith("1 of 2 replicas left"), proc.stderr[-3000:]
    last = read_metrics(out).iterations[-1].inference
    assert last.replicas_alive == 1 and last.replicas_lost == 1 and last.last_push.version == 4
