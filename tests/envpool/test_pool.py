"""EnvPool: equivalence with in-process envs, async recv, crash/hang/raise recovery, lifecycle.

The scripted test env lives in script_env.py; workers import it by reference when they unpickle
the registry spec (spawned workers inherit the parent's sys.path, which pytest extended).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import random
import signal
import time

import pytest

from script_env import run_reference
from turnforge.envpool import EnvPool
from turnforge.envs import make
from turnforge.envs.sokoban import ACTIONS
from turnforge.errors import UserError


_BEFORE: set[int] = set()


@pytest.fixture(autouse=True)
def _children_before_test():
    """Children alive before the test (e.g. the MC critic's process pool kept by an earlier
    test) are not this test's: the checks below look only at processes started since."""
    _BEFORE.clear()
    _BEFORE.update(p.pid for p in mp.active_children())


def new_children() -> list:
    return [p for p in mp.active_children() if p.pid not in _BEFORE]


def no_children() -> bool:
    for _ in range(50):  # give joined processes a moment to be reaped
        if not new_children():
            return True
        time.sleep(0.02)
    return False


def test_matches_in_process_sokoban_over_random_steps():
    n, steps = 4, 300
    ref = [make("sokoban") for _ in range(n)]
    rng = random.Random(0)
    texts = list(ACTIONS) + ["jump", "<answer>Up</answer>"]
    with EnvPool("sokoban", num_envs=n, num_workers=2) as pool:
        seeds = list(range(n))
        pool.send_reset(range(n), seeds)
        got = {r.env_id: r for r in pool.recv(batch_size=n)}
        assert [got[i].observation for i in range(n)] == [ref[i].reset(seed=seeds[i]) for i in range(n)]
        assert all(r.status == "ok" and r.kind == "reset" for r in got.values())
        next_seed = n
        for _ in range(steps // n):
            actions = [rng.choice(texts) for _ in range(n)]
            results = pool.step_all(list(range(n)), actions)
            for i, (res, action) in enumerate(zip(results, actions)):
                want = ref[i].step(action)
                assert (res.env_id, res.status, res.kind) == (i, "ok", "step")
                assert (res.observation, res.reward, res.terminated, res.truncated, res.invalid_action,
                        res.success, dict(res.info)) == (want.observation, want.reward, want.terminated,
                                                         want.truncated, want.invalid_action, want.success,
                                                         dict(want.info))
            done = [i for i in range(n) if ref[i].done]
            if done:
                pool.send_reset(done, [next_seed + k for k in range(len(done))])
                for r in pool.recv(batch_size=len(done)):
                    assert r.observation == ref[r.env_id].reset(seed=next_seed + done.index(r.env_id))
                next_seed += len(done)
        stats = pool.stats()
        assert stats.steps == steps and stats.restarts == 0 and stats.failed == 0
        assert stats.resets == next_seed
        assert 0.0 < stats.env_utilization <= 1.0
    assert no_children()


def test_recv_returns_the_fast_result_before_the_slow_one():
    with EnvPool("test-script", num_envs=2, num_workers=2) as pool:
        pool.send_reset([0, 1], [0, 1])
        pool.recv(batch_size=2)
        pool.send_step([0, 1], ["sleep 1.0", "sleep 0"])
        first = pool.recv(batch_size=1)
        assert [r.env_id for r in first] == [1]  # returned alone: recv did not wait for the slow one
        second = pool.recv(batch_size=1)
        assert [r.env_id for r in second] == [0] and second[0].seconds >= 1.0


def test_waiting_requests_reach_the_worker_by_priority_and_outlive_its_crash():
    """With one request on the worker at a time, the others wait in the parent and go lowest
    priority first; a request that kills the worker twice fails, and those waiting behind it
    still run (nothing is left waiting once the worker is replaced)."""
    with EnvPool("test-script", num_envs=4, num_workers=1, dispatch_depth=1) as pool:
        pool.send_reset(range(4), [0, 1, 2, 3])
        pool.recv(batch_size=4)
        pool.send_step(range(4), ["sleep 0.2", "m", "m", "m"], priorities=[3, 2, 1, 0])
        got = pool.recv(batch_size=4)
        assert [r.env_id for r in got] == [0, 3, 2, 1]  # env 0 went at once (the worker was free), then by priority
        assert all(r.status == "ok" and r.observation == run_reference(r.env_id, ["m"])[1] for r in got)
        pool.send_step(range(4), ["crash", "m", "m", "m"], priorities=[0, 1, 2, 3])
        got = {r.env_id: r for r in pool.recv(batch_size=4)}
        assert got[0].status == "failed" and "worker died" in got[0].error
        assert [got[i].observation for i in (1, 2, 3)] == [run_reference(i, ["m", "m"])[2] for i in (1, 2, 3)]
        assert pool.stats().restarts == 2


def test_killed_worker_restores_envs_and_resumes_the_in_flight_step():
    actions = ["a", "b", "sleep 0.5", "c", "d"]
    with EnvPool("test-script", num_envs=4, num_workers=2) as pool:
        pool.send_reset(range(4), [10, 11, 12, 13])
        obs = {r.env_id: [r.observation] for r in pool.recv(batch_size=4)}
        for k, action in enumerate(actions):
            # env 0 gets the script; envs 1..3 make plain moves (env 2 shares env 0's worker)
            pool.send_step(range(4), [action, "m", "m", "m"])
            if k == 2:
                time.sleep(0.1)  # env 0's sleep is running now
                os.kill(pool.worker_pids()[0], signal.SIGKILL)
            results = pool.recv(batch_size=4)
            for r in results:
                obs[r.env_id].append(r.observation)
            status = {r.env_id: r.status for r in results}
            if k == 2:
                assert status[0] == "resumed"
                assert status[1] == "ok"  # other worker untouched
                assert status[2] in ("ok", "resumed")  # queued behind env 0's step: re-run or already done
            else:
                assert set(status.values()) == {"ok"}
        assert obs[0] == run_reference(10, actions)
        for i in (1, 2, 3):
            assert obs[i] == run_reference(10 + i, ["m"] * len(actions))
        assert pool.stats().restarts == 1 and pool.stats().failed == 0


def test_sokoban_worker_killed_between_steps_continues_the_episode():
    ref = make("sokoban")
    with EnvPool("sokoban", num_envs=1, num_workers=1) as pool:
        pool.send_reset([0], [7])
        assert pool.recv()[0].observation == ref.reset(seed=7)
        for k, action in enumerate(["Up", "Left", "Down", "Right", "Up"]):
            if k == 2:
                os.kill(pool.worker_pids()[0], signal.SIGKILL)
            (res,) = pool.step_all([0], [action])
            assert res.observation == ref.step(action).observation
            # the step right after the kill went to a dead worker and was re-sent to its successor
            assert res.status == ("resumed" if k == 2 else "ok")
        assert pool.stats().restarts == 1


def test_hang_once_is_resumed_and_a_deterministic_hang_fails(tmp_path):
    with EnvPool("test-script", num_envs=2, num_workers=1, step_timeout=0.5) as pool:
        pool.send_reset([0, 1], [0, 1])
        pool.recv(batch_size=2)
        (res,) = pool.step_all([0], [f"hang_once {tmp_path / 'h'}"])
        assert res.status == "resumed" and res.error is None
        assert res.observation == run_reference(0, ["x"])[1]
        (res,) = pool.step_all([0], ["sleep 5"])
        assert res.status == "failed" and "timed out" in res.error
        (res,) = pool.step_all([1], ["m"])  # the run goes on
        assert res.status == "ok"
        stats = pool.stats()
        assert (stats.timeouts, stats.restarts, stats.failed) == (3, 3, 1)


def test_deterministic_crash_fails_once_and_crash_once_resumes(tmp_path):
    with EnvPool("test-script", num_envs=2, num_workers=1) as pool:
        pool.send_reset([0, 1], [0, 1])
        pool.recv(batch_size=2)
        pool.send_step([0], [f"crash_once {tmp_path / 'c'}"])
        pool.send_reset([1], [5])  # queued behind the crashing step
        got = {r.env_id: r for r in pool.recv(batch_size=2)}
        assert got[0].status == "resumed" and got[0].observation == run_reference(0, ["m"])[1]
        assert got[1].status == "restarted" and got[1].observation == run_reference(5, [])[0]
        assert (pool.stats().steps, pool.stats().resets) == (1, 3)  # nothing lost, nothing counted twice
        pool.send_step([0, 1], ["crash", "m"])
        got = {r.env_id: r for r in pool.recv(batch_size=2)}
        assert got[0].status == "failed" and "worker died" in got[0].error
        assert got[1].status == "resumed" and got[1].observation == run_reference(5, ["m"])[1]
        assert pool.stats().restarts == 3


def test_env_exception_fails_the_request_and_the_worker_lives():
    with EnvPool("test-script", num_envs=2, num_workers=1) as pool:
        pid = pool.worker_pids()[0]
        pool.send_reset([0, 1], [0, 1])
        pool.recv(batch_size=2)
        results = pool.step_all([0, 1], ["raise", "m"])
        assert results[0].status == "failed" and results[0].error == "RuntimeError: boom from the env"
        assert results[1].status == "ok" and results[1].observation == run_reference(1, ["m"])[1]
        assert pool.worker_pids() == [pid] and pool.stats().restarts == 0 and pool.stats().failed == 1


def test_a_signal_that_stops_the_run_inside_an_inline_env_is_not_the_envs_failure():
    """SIGTERM's handler raises ``Interrupted`` wherever the trainer's main thread is; inside an env
    of the trainer's own process it must stop the run, not count as an infra failure (it once did,
    and BC then failed on its failure share instead of exiting with 143)."""
    from turnforge.envpool.inline import InlineEnvs
    from turnforge.errors import Interrupted

    envs = InlineEnvs("test-script", num_envs=1)
    envs.send_reset([0], [0])
    envs.recv()

    def interrupted(action):
        raise Interrupted("interrupted during behaviour cloning", 15)

    envs.host.envs[0].step = interrupted
    with pytest.raises(Interrupted):
        envs.send_step([0], ["m"])
    assert envs.stats().failed == 0


def test_memory_limit_turns_a_huge_allocation_into_a_failed_request():
    with EnvPool("test-script", num_envs=1, num_workers=1, memory_limit_mb=2048) as pool:
        pid = pool.worker_pids()[0]
        pool.send_reset([0], [0])
        pool.recv()
        (res,) = pool.step_all([0], ["alloc 4096"])
        assert res.status == "failed" and res.error.startswith("MemoryError")
        (res,) = pool.step_all([0], ["alloc 16"])
        assert res.status == "ok" and pool.worker_pids() == [pid]


def test_cpu_budget_fails_a_spinning_request_and_the_worker_lives():
    with EnvPool("test-script", num_envs=1, num_workers=1, cpu_limit_s=1) as pool:
        pid = pool.worker_pids()[0]
        pool.send_reset([0], [0])
        pool.recv()
        (res,) = pool.step_all([0], ["spin 5"])
        assert res.status == "failed" and "CpuBudgetExceeded" in res.error
        (res,) = pool.step_all([0], ["spin 0.2"])  # within budget; the budget is per request
        (again,) = pool.step_all([0], ["sleep 1.5"])  # sleeping uses no CPU
        assert res.status == again.status == "ok" and pool.worker_pids() == [pid]


def test_too_many_restarts_raise():
    with EnvPool("test-script", num_envs=1, num_workers=1, max_restarts=0) as pool:
        pool.send_reset([0], [0])
        pool.recv()
        pool.send_step([0], ["crash"])
        with pytest.raises(RuntimeError, match="max_restarts=0"):
            pool.recv()
    assert no_children()


def test_bad_env_id_or_option_raises_before_any_worker_starts():
    assert no_children()
    with pytest.raises(UserError, match="unknown env 'nope'"):
        EnvPool("nope", num_envs=2, num_workers=2)
    with pytest.raises(UserError, match="no option 'dimm'"):
        EnvPool("sokoban", num_envs=2, num_workers=2, env_kwargs={"dimm": 5})
    assert not new_children()


def test_one_request_in_flight_per_env_and_close_leaves_no_children():
    pool = EnvPool("test-script", num_envs=2, num_workers=2)
    pool.send_reset([0], [0])
    with pytest.raises(ValueError, match="env 0 already has a request in flight"):
        pool.send_step([0], ["m"])
    with pytest.raises(ValueError, match="batch_size=2"):
        pool.recv(batch_size=2)
    assert pool.recv()[0].env_id == 0
    pool.close()
    pool.close()
    assert no_children()
    with pytest.raises(RuntimeError, match="closed"):
        pool.send_reset([0], [0])


def test_forkserver_workers_give_the_same_results():
    with EnvPool("test-script", num_envs=3, num_workers=2, start_method="forkserver") as pool:
        pool.send_reset(range(3), [0, 1, 2])
        assert {r.observation for r in pool.recv(batch_size=3)} == {run_reference(i, [])[0] for i in range(3)}
        results = pool.step_all([2, 0], ["a", "b"])
        assert [r.observation for r in results] == [run_reference(2, ["a"])[1], run_reference(0, ["b"])[1]]
    assert no_children()


def test_garbage_collected_pool_stops_its_workers():
    pool = EnvPool("test-script", num_envs=1, num_workers=1)
    assert len(new_children()) == 1
    del pool
    gc.collect()
    assert no_children()



def test_workers_start_at_most_one_per_core_at_a_time(monkeypatch):
    """A worker starts only when fewer than usable_cores() others are still starting, so a run
    with many env workers on a small machine does not time its last ones out."""
    from turnforge.envpool import pool as pool_module

    monkeypatch.setattr(pool_module, "usable_cores", lambda: 2)
    starting, peak = set(), [0]

    class FakeWorker:
        def start(self, spec, env_kwargs, assignments):
            starting.add(id(self))
            peak[0] = max(peak[0], len(starting))

        def wait_ready(self, timeout):
            starting.discard(id(self))

        def kill(self, grace=0.0):
            pass

        stop = kill

    pool = pool_module.BasePool("test-script", 7, 7, None, step_timeout=5, max_restarts=0, start_timeout=5,
                                new_workers=lambda n: [FakeWorker() for _ in range(n)], wait=lambda ws, t: None)
    assert peak[0] == 2 and not starting  # all seven started, two at a time
    pool.close()
