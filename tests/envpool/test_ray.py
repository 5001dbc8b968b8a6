"""RayEnvPool on a local Ray instance started once for this module: the same results as
in-process envs, async recv, recovery from a dead or hung actor, and connect_ray's errors.

Actors import script_env by reference, as worker processes do; Ray workers do not inherit the
driver's sys.path, so the fixture puts this folder on their PYTHONPATH.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from script_env import run_reference  # noqa: E402
from turnforge.envpool import EnvResult, RayEnvPool, connect_ray, ray_pool  # noqa: E402
from turnforge.envs import make  # noqa: E402
from turnforge.envs.sokoban import ACTIONS  # noqa: E402
from turnforge.errors import UserError  # noqa: E402
from turnforge.types import StepResult  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    connect_ray(None, num_cpus=2, runtime_env={"env_vars": {"PYTHONPATH": f"{HERE}{os.pathsep}${{PYTHONPATH}}"}})
    yield
    ray.shutdown()


def gone(pids: list[int]) -> bool:
    for _ in range(400):  # ray.kill is asynchronous (and slow on a loaded machine)
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            return True
        time.sleep(0.05)
    return False


def outcome(r: EnvResult | StepResult) -> tuple:
    return r.observation, r.reward, r.terminated, r.truncated, r.invalid_action, r.success, dict(r.info)


def test_matches_in_process_sokoban_and_close_stops_the_actors():
    n = 4
    ref = [make("sokoban") for _ in range(n)]
    rng = random.Random(0)
    texts = list(ACTIONS) + ["jump"]
    with RayEnvPool("sokoban", num_envs=n, num_workers=2) as pool:
        pids = pool.worker_pids()
        assert len(set(pids)) == 2 and os.getpid() not in pids
        pool.send_reset(range(n), list(range(n)))
        got = {r.env_id: r for r in pool.recv(batch_size=n)}
        assert [got[i].observation for i in range(n)] == [ref[i].reset(seed=i) for i in range(n)]
        for _ in range(10):
            actions = [rng.choice(texts) for _ in range(n)]
            results = pool.step_all(list(range(n)), actions)
            assert [(r.env_id, r.status, r.kind) for r in results] == [(i, "ok", "step") for i in range(n)]
            wants = [ref[i].step(a) for i, a in enumerate(actions)]
            assert [outcome(r) for r in results] == [outcome(w) for w in wants]
            assert [(r.anchor_key, r.potential) for r in results] == [
                ("" if w.terminated or w.truncated else ref[i].anchor_key(), 0.0 if w.terminated else ref[i].potential())
                for i, w in enumerate(wants)]
            done = [i for i in range(n) if ref[i].done]
            if done:
                pool.send_reset(done, [100 + i for i in done])
                for r in pool.recv(batch_size=len(done)):
                    assert r.observation == ref[r.env_id].reset(seed=100 + r.env_id)
        stats = pool.stats()
        assert (stats.steps, stats.restarts, stats.failed) == (10 * n, 0, 0) and stats.resets >= n
        assert 0.0 < stats.env_utilization <= 1.0
    assert gone(pids)


def test_recv_returns_each_result_as_soon_as_it_is_ready():
    with RayEnvPool("test-script", num_envs=3, num_workers=3) as pool:
        pool.send_reset(range(3), [0, 1, 2])
        pool.recv(batch_size=3)
        t0 = time.perf_counter()
        pool.send_step(range(3), ["sleep 1.2", "sleep 0.6", "sleep 0"])
        # one result per recv, in the order they became ready: recv did not wait for the batch
        (first,) = pool.recv(batch_size=1)
        assert first.env_id == 2
        (second,) = pool.recv(batch_size=1)
        assert second.env_id == 1 and time.perf_counter() - t0 >= 0.6
        (third,) = pool.recv(batch_size=1)
        assert third.env_id == 0 and third.seconds >= 1.2


def test_dead_actor_resumes_the_running_step_and_restarts_the_queued_reset(tmp_path):
    with RayEnvPool("test-script", num_envs=4, num_workers=2) as pool:
        pool.send_reset(range(4), [10, 11, 12, 13])
        pool.recv(batch_size=4)
        # env 0's step makes its actor call os._exit; env 2 (same actor) waits behind it
        pool.send_step([0, 1], [f"crash_once {tmp_path / 'c'}", "m"])
        pool.send_reset([2], [5])
        got = {r.env_id: r for r in pool.recv(batch_size=3)}
        assert got[0].status == "resumed" and got[0].observation == run_reference(10, ["m"])[1]
        assert got[1].status == "ok" and got[1].observation == run_reference(11, ["m"])[1]
        assert got[2].status == "restarted" and got[2].observation == run_reference(5, [])[0]
        # killed from outside in the middle of a step: same story
        pool.send_step([0], ["sleep 0.5"])
        time.sleep(0.2)
        os.kill(pool.worker_pids()[0], signal.SIGKILL)
        (res,) = pool.recv()
        assert res.status == "resumed" and res.observation == run_reference(10, ["m", "x"])[2]
        (res,) = pool.step_all([2], ["m"])  # restored from its snapshot in the newest actor
        assert res.status == "ok" and res.observation == run_reference(5, ["m"])[1]
        stats = pool.stats()
        assert (stats.steps, stats.resets, stats.restarts, stats.failed) == (4, 5, 2, 0)


def test_hang_past_step_timeout_restarts_the_actor(tmp_path):
    with RayEnvPool("test-script", num_envs=2, num_workers=1, step_timeout=0.5) as pool:
        pid = pool.worker_pids()[0]
        pool.send_reset([0, 1], [0, 1])
        pool.recv(batch_size=2)
        (res,) = pool.step_all([0], [f"hang_once {tmp_path / 'h'}"])
        assert res.status == "resumed" and res.error is None
        assert res.observation == run_reference(0, ["x"])[1]
        assert pool.worker_pids() != [pid] and gone([pid])
        stats = pool.stats()
        assert (stats.timeouts, stats.restarts, stats.failed) == (1, 1, 0)


def test_crash_twice_fails_the_request_and_the_pool_goes_on():
    with RayEnvPool("test-script", num_envs=2, num_workers=1) as pool:
        pool.send_reset([0, 1], [0, 1])
        pool.recv(batch_size=2)
        pool.send_step([0, 1], ["crash", "m"])
        got = {r.env_id: r for r in pool.recv(batch_size=2)}
        assert got[0].status == "failed" and "worker died" in got[0].error and "twice" in got[0].error
        assert got[1].status == "resumed" and got[1].observation == run_reference(1, ["m"])[1]
        results = pool.step_all([0, 1], ["raise", "m"])  # an env exception fails only its request
        assert results[0].status == "failed" and results[0].error == "RuntimeError: boom from the env"
        assert results[1].status == "ok" and results[1].observation == run_reference(1, ["m", "m"])[2]
        assert (pool.stats().restarts, pool.stats().failed) == (2, 2)


def test_memory_limit_is_on_top_of_the_ray_worker_and_fails_a_huge_allocation():
    # a Ray worker maps several GB before any env runs, so an absolute 2 GB limit would fail everything
    with RayEnvPool("test-script", num_envs=1, num_workers=1, memory_limit_mb=2048) as pool:
        pool.send_reset([0], [0])
        pool.recv()
        results = [pool.step_all([0], [action])[0] for action in ("alloc 64", "alloc 4096", "m")]
        assert [r.status for r in results] == ["ok", "failed", "ok"]
        assert results[1].error.startswith("MemoryError") and pool.stats().restarts == 0


def test_bad_env_or_unreachable_address_is_a_fast_one_line_user_error(monkeypatch):
    with pytest.raises(UserError, match="unknown env 'nope'"):
        RayEnvPool("nope", num_envs=2, num_workers=2)
    t0 = time.perf_counter()
    for address in ("127.0.0.1:1", "ray://127.0.0.1:1"):
        with pytest.raises(UserError, match=f"'{address}'") as err:
            connect_ray(address)
        assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="'127.0.0.1:1'"):
        RayEnvPool("test-script", num_envs=1, num_workers=1, address="127.0.0.1:1")
    with pytest.raises(UserError, match="is not 'local'"):
        connect_ray("nowhere")
    assert time.perf_counter() - t0 < 30
    monkeypatch.setattr(ray_pool, "ray", None)
    with pytest.raises(UserError, match='pip install "turnforge\\[ray\\]"'):
        connect_ray(None)


def test_importing_the_package_does_not_import_ray():
    code = "import sys, turnforge.envpool; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
