"""Solver-anchored rollouts (``turnforge.train.anchors``): where a task starts, how its anchor
moves, which requests a round plays, and what graduates or is dropped; hand-computed."""

from __future__ import annotations

import pytest

from turnforge.app.config import load_config
from turnforge.train import anchors
from turnforge.train.anchors import Anchor, AnchorPool, first_anchor, move_anchor
from turnforge.types import EnvSnapshot, Task, Trajectory, Turn

CFG = load_config("sokoban-tiny", ["flywheel.mechanisms=[replay,anchor]", "flywheel.anchor_tasks=2",
                                   "flywheel.anchor_rollouts=3", "flywheel.anchor_pool=3", "flywheel.anchor_patience=2"])


def _task(i: int) -> Task:
    return Task("sokoban", "train", i)


def _id(i: int) -> str:
    return _task(i).task_id


def _snaps(n: int) -> tuple[EnvSnapshot, ...]:
    return tuple(EnvSnapshot("sokoban", i) for i in range(n))


def _traj(task: Task, success: bool, turns: int = 1, snapshots: tuple = (), failure: str | None = None) -> Trajectory:
    return Trajectory(f"{task.task_id}-x", task, f"{task.task_id}-g", 0, tuple(Turn("o", "a", 0.0, False, "") for _ in range(turns)),
                      (), float(success), success, success, False, None, 0, failure, snapshots=snapshots)


@pytest.mark.parametrize("moves, start, k", [(8, 0.5, 4), (5, 0.5, 3), (1, 0.5, 0), (4, 0.99, 3), (6, 0.0, 0), (2, 0.5, 1)])
def test_first_anchor_leaves_the_policy_at_least_one_move(moves, start, k):
    assert first_anchor(moves, start) == k


@pytest.mark.parametrize("k, success, expected", [
    (4, 0.5, (2, "back")),        # reached anchor_advance: two moves back
    (1, 1.0, (0, "back")),        # never past the real start
    (0, 0.5, (0, "graduated")),   # reached it at the real start
    (0, 0.25, (0, "stay")),       # some success, not enough
    (5, 0.0, (7, "forward")),     # no success: two more expert moves, at most moves - 1 = 7
    (6, 0.0, (7, "forward")),
    (7, 0.0, (7, "stuck")),       # already at the most help
])
def test_move_anchor(k, success, expected):
    assert move_anchor(k, 8, 2, success, 0.5) == expected


def test_requests_round_robin_start_states_and_turn_budget():
    pool = AnchorPool({_id(i): Anchor(_task(i), _snaps(6), k, 1) for i, k in enumerate([3, 0, 5])})
    reqs = anchors.requests(pool, CFG, 0, reseed=False)
    assert [r.task.task_id for r in reqs] == [_id(0)] * 3 + [_id(1)] * 3  # anchor_tasks=2, anchor_rollouts=3
    assert reqs[0].start == EnvSnapshot("sokoban", 3) and reqs[0].max_turns == CFG.rollout.max_turns - 3
    assert reqs[3].start is None and reqs[3].max_turns == CFG.rollout.max_turns  # k=0: the task's real start
    assert len({r.trajectory_id for r in reqs}) == 6 and len({r.env_seed for r in reqs[:3]}) == 3
    assert list(pool.anchors) == [_id(2), _id(0), _id(1)]  # played tasks went to the back
    assert [r.task.task_id for r in anchors.requests(pool, CFG, 1, reseed=True)] == [_id(2)] * 3 + [_id(0)] * 3
    small = CFG.model_copy(update={"flywheel": CFG.flywheel.model_copy(update={"env_steps_per_round": 2 * 3 * CFG.rollout.max_turns})})
    pool = AnchorPool({_id(i): Anchor(_task(i), _snaps(6), 1, 1) for i in range(3)})
    assert len(anchors.requests(pool, small, 0, reseed=False)) == 3  # one task: its worst case is half the budget
    again = anchors.requests(AnchorPool({_id(0): Anchor(_task(0), _snaps(6), 3, 1)}), CFG, 1, reseed=True)
    assert all(r.reseed == r.env_seed for r in again)  # a fresh future per rollout where the env can reseed


def test_update_moves_graduates_and_drops():
    pool = AnchorPool({_id(0): Anchor(_task(0), _snaps(8), 4, 2), _id(1): Anchor(_task(1), _snaps(8), 0, 2),
                       _id(2): Anchor(_task(2), _snaps(8), 7, 2), _id(3): Anchor(_task(3), _snaps(8), 5, 2)})
    played = ([_traj(_task(0), s) for s in (True, True, False)] + [_traj(_task(1), True)] * 2
              + [_traj(_task(2), False)] * 3 + [_traj(_task(3), True, failure="env crashed")])
    anchors.update(pool, played, CFG)
    assert pool.graduated == 1 and _id(1) not in pool.anchors  # solved from its real start
    assert pool.anchors[_id(0)].k == 2  # 2/3 >= 0.5: back by its step
    assert pool.anchors[_id(2)].misses == 1 and pool.anchors[_id(3)].k == 5  # infra failures do not count
    anchors.update(pool, [_traj(_task(2), False)], CFG)
    assert _id(2) not in pool.anchors and pool.dropped == 1  # anchor_patience=2 rounds stuck


def test_admit_keeps_expert_solutions_within_the_pool_size():
    pool = AnchorPool()
    anchors.wait(pool, [_task(i) for i in range(5)], CFG)
    anchors.wait(pool, [_task(4)], CFG)  # already waiting: not twice
    assert [t.task_id for t in pool.waiting] == [_id(2), _id(3), _id(4)]  # the newest anchor_pool=3 wait
    solved = {_id(2): 6, _id(3): 0, _id(4): 4}  # task 3: the expert did not solve it

    def play_expert(reqs):
        moves = [solved[r.task.task_id] or 5 for r in reqs]  # the failed expert played 5 moves
        return [_traj(r.task, solved[r.task.task_id] > 0, n, _snaps(n)) for r, n in zip(reqs, moves)]

    anchors.admit(pool, CFG, play_expert, 0)
    assert set(pool.anchors) == {_id(2), _id(4)} and pool.waiting == [] and pool.unsolved_by_expert == 1
    assert pool.expert_moves == 6 + 5 + 4  # every move the expert played is an expert query
    assert (pool.anchors[_id(2)].k, pool.anchors[_id(2)].step) == (3, 2)  # ceil(0.5 * 6); round(0.25 * 6)
    assert (pool.anchors[_id(4)].k, pool.anchors[_id(4)].step) == (2, 1)
    assert pool.expert_share() == pytest.approx((3 / 6 + 2 / 4) / 2)


def test_anchor_on_an_env_without_a_solver_is_refused_at_start():
    from turnforge.envs.base import Env
    from turnforge.errors import UserError
    from turnforge.train.checks import check_options

    class NoSolver(Env):
        def reset(self, task, seed):
            return "start"

        def step(self, action):
            raise AssertionError("never played")

    cfg = load_config("sokoban-tiny", ["bc.enabled=false", "flywheel.mechanisms=[replay,anchor]"])
    with pytest.raises(UserError, match=r"^solver-anchored rollouts \(flywheel.mechanisms has anchor\) needs env 'sokoban' "
                                        r"to implement snapshot\(\) and restore\(snapshot\), or drop anchor from flywheel.mechanisms$"):
        check_options(cfg, NoSolver())
