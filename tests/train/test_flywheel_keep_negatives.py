"""The flywheel's ``keep`` and ``negatives`` mechanisms and the ``boundary`` allocation: their pure
pieces against hand-computed values, and rounds on the fake engine of ``test_flywheel_mechanisms``
(who is re-tested, what is rehearsed, which failed turns are pushed down, who gets more rollouts)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from tests.train.test_flywheel_mechanisms import (
    FAST,
    FakeEngine,
    play_round,
    sources_in_order,
)
from turnforge.app.config import load_config
from turnforge.errors import UserError
from turnforge.train.mechanisms import MECHANISMS, enabled
from turnforge.train.mechanisms.keep import pick_retests
from turnforge.train.mechanisms.negatives import contradicted_turns, negative_samples
from turnforge.types import Sample, Task, Trajectory, Turn


def test_contradicted_turns_hand_computed():
    episodes = [
        (True, [("s0", "Up"), ("s1", "Left")]),  # a success: Up at s0, Left at s1
        (False, [("s0", "Down"), ("s2", "Up"), ("s0", "Down")]),  # Down at s0: contradicted (once); s2: no success there
        (False, [("s0", "Up"), ("s1", "Right")]),  # Up at s0 is what the success did; Right at s1 is contradicted
        (True, [("s0", "Down"), ("s3", "Up")]),  # a second success: Down at s0 is no longer contradicted
    ]
    assert contradicted_turns(episodes, "state") == [(2, 1)]
    assert contradicted_turns(episodes[:3], "state") == [(1, 0), (2, 1)]
    assert contradicted_turns([(False, [("s0", "Up")])], "state") == []  # no success: no evidence


def _traj(i: int, success: bool, steps: list[tuple[str, str]]) -> Trajectory:
    turns = tuple(Turn("o", a, 0.0, False, key) for key, a in steps)
    samples = tuple(Sample(np.array([1, 2]), np.array([0, 1], np.int8), np.array([np.nan, -0.5], np.float32),
                           np.array([-1, 0], np.int32), f"t{i}", k) for k in range(len(steps)))
    return Trajectory(f"t{i}", Task("fake", "train", 1), "g", 0, turns, samples, float(success), success, True, False, None, 0)


def test_negative_samples_are_the_contradicted_turns_samples_and_weigh_minus_negative_weight():
    won, lost = _traj(0, True, [("s0", "Up"), ("s1", "Left")]), _traj(1, False, [("s0", "Down"), ("s1", "Left")])
    samples, tasks = negative_samples([[won, lost], [lost]], "state")  # the second task has no success
    assert [(x.trajectory_id, x.turn_index) for x in samples] == [("t1", 0)] and tasks == 1

    cfg = load_config("sokoban-tiny", ["flywheel.mechanisms=[negatives]", "flywheel.negative_weight=0.25"])  # task scope
    m = MECHANISMS["negatives"](cfg)
    col = SimpleNamespace(played=[(won, "plain"), (lost, "retry"), (_traj(2, False, [("s0", "Right")]), "guided")])
    m.begin(col)
    xs, ws = m.rft_extra(col)
    assert [(x.trajectory_id, x.turn_index) for x in xs] == [("t1", 0)] and ws == [-0.25]  # guided: not as played
    assert m.record(None) == MECHANISMS["negatives"].Record(None, samples=1, tasks=1)


def test_pick_retests_lost_first_then_round_robin():
    pool = ["a", "b", "c", "d"]
    assert pick_retests(pool, [], 0, 3) == ["a", "b", "c"]
    assert pick_retests(pool, ["c", "x"], 3, 3) == ["c", "d", "a"]  # x left the pool
    assert pick_retests(pool, [], 2, 9) == ["c", "d", "a", "b"]  # no more than the pool


def test_keep_retests_the_starts_levels_and_rehearses_the_lost_ones():
    cfg = load_config("sokoban-tiny", [*FAST, "flywheel.mechanisms=[retry,keep]", "flywheel.keep_tasks=3",
                                       "rollout.max_turns=3"])  # the fake's episodes: 2-3 turns
    engine = FakeEngine()
    mechs = [cls(cfg) for cls in enabled(cfg.flywheel.mechanisms)]
    keep = mechs[1]
    # round 1 (the starting policy): its kept successes on hard tasks fill the pool: 2 (plain, 1 of 2), 3 (retried),
    # 6, 7; nothing re-tested yet
    col, _, _, _, _, replayed = play_round(cfg, engine, mechs, 0)
    assert [int(k.rsplit(":", 1)[1]) for k in keep.state.pool] == [2, 3, 6, 7] and replayed == []
    assert keep.record(col.count("kept")) == MECHANISMS["keep"].Record((0, 0), pool=4, held=0, lost=0)
    # round 2: 2, 3 and 6 re-tested first (2 plain rollouts each); 3 is lost (only retries solve it): the start's
    # success on it is rehearsed
    col, _, _, _, _, replayed = play_round(cfg, engine, mechs, 1)
    assert sources_in_order(col)[:2] == ["kept", "retry"]
    assert keep.record(col.count("kept")) == MECHANISMS["keep"].Record((6, 2), pool=4, held=2, lost=1)
    assert [(c.trajectory.task.index, c.source) for c in replayed] == [(3, "retry")]
    # round 3: the lost one first, then the round robin goes on (7, then 2)
    assert [t.index for t in keep.first_wave(col)] == [3, 7, 2]


def test_boundary_allocation_deals_the_waves_budget_by_closeness_to_the_boundary():
    cfg = load_config("sokoban-tiny", [*FAST, "flywheel.mechanisms=[]", "flywheel.allocation=boundary",
                                       "flywheel.probe_rollouts=1", "flywheel.group_size=2",
                                       "flywheel.boundary_max_rollouts=4", "flywheel.env_steps_per_round=12",
                                       "rollout.max_turns=3"])  # one wave: 4 tasks x 3 turns at most
    col, plain, *_ = play_round(cfg, FakeEngine(), [], 0)
    # one wave of tasks 1-4, one probe each: 1 and 2 solved (weight 1/4), 3 and 4 not (3/4); 4 more rollouts
    # dealt 3/4, 3/4, 3/8, 3/8 -> 2 each to tasks 3 and 4
    assert {int(k.rsplit(":", 1)[1]): len(v) for k, v in plain.items()} == {1: 1, 2: 1, 3: 3, 4: 3}
    assert len(col.played) == 8  # the uniform wave's 4 x 2


@pytest.mark.parametrize("overrides, pattern", [
    (["flywheel.negative_weight=0"], r"bad value for 'flywheel.negative_weight' \(0\)"),
    (["flywheel.negative_weight=11"], r"bad value for 'flywheel.negative_weight' \(11\)"),
    (["flywheel.rounds=1", "flywheel.mechanisms=[negatives]", "flywheel.stages=[rl]"],
     r"negatives, which trains in the rft stage: add rft to flywheel.stages"),
    (["flywheel.rounds=1", "flywheel.allocation=boundary", "flywheel.group_size=2", "flywheel.probe_rollouts=2"],
     r"with flywheel.group_size=flywheel.probe_rollouts=2 there are none"),
    (["flywheel.rounds=1", "flywheel.allocation=boundary", "flywheel.group_size=4", "flywheel.probe_rollouts=1",
      "flywheel.boundary_max_rollouts=3"], r"flywheel.boundary_max_rollouts=3 is below flywheel.group_size=4"),
    (["flywheel.rounds=1", "flywheel.allocation=adaptive", "flywheel.group_size=2", "flywheel.probe_rollouts=3"],
     r"flywheel.probe_rollouts=3 is above flywheel.group_size=2"),
])
def test_bad_values_are_one_line_naming_the_key(overrides, pattern):
    with pytest.raises(UserError, match=pattern) as e:
        load_config("sokoban-tiny", overrides)
    assert "\n" not in str(e.value)


def test_negatives_need_state_keys_of_the_env():
    cfg = load_config("sokoban-tiny", ["flywheel.mechanisms=[negatives]"])
    req = MECHANISMS["negatives"].requirements(cfg)
    assert [r.capability for r in req] == ["anchor_key"] and req[0].fix == "drop negatives from flywheel.mechanisms"


def test_task_scope_pushes_down_every_failed_turn_no_success_took():
    episodes = [
        (True, [("s0", "Up"), ("s1", "Left")]),
        (False, [("s0", "Down"), ("s2", "Up"), ("s0", "Down"), ("s1", "Left")]),  # s2: no success there, still pushed
    ]
    assert contradicted_turns(episodes, "task") == [(1, 0), (1, 1)]  # (s1, Left) is the success's own move
    assert contradicted_turns(episodes, "state") == [(1, 0)]
    assert contradicted_turns([(False, [("s0", "Up")])], "task") == []  # no success: no evidence


def _task_traj(i: int, task: int, success: bool, infra: str | None = None) -> Trajectory:
    return replace(_traj(i, success, [("s0", "Up")]), task=Task("fake", "train", task), infra_failure=infra)


def test_pass_k_shares_weigh_a_plain_success_by_what_it_adds_to_its_tasks_pass_at_k():
    from turnforge.data.filters import Candidate
    from turnforge.train.flywheel import pass_k_shares, rft_data

    lone, pair_a, pair_b = _task_traj(0, 1, True), _task_traj(2, 2, True), _task_traj(3, 2, True)
    plain = {lone.task.task_id: [lone, _task_traj(1, 1, False)],  # 1 of 2: a lone success
             pair_a.task.task_id: [pair_a, pair_b, _task_traj(4, 2, False, infra="sandbox")]}  # 2 of 2 (infra out)
    kept = [Candidate.of(lone), Candidate.of(pair_a), Candidate.of(_task_traj(5, 2, True), "retry")]
    assert pass_k_shares(kept, plain, 1) == [1.0, 1.0, 1.0]  # pass@1: plain rejection sampling
    assert pass_k_shares(kept, plain, 2) == [1.0, 0.0, 1.0]  # 2/2 solved: 0; other sources: 1
    plain[pair_a.task.task_id] += [_task_traj(6, 2, False), _task_traj(7, 2, False)]  # now 2 of 4
    assert pass_k_shares(kept, plain, 2) == pytest.approx([1.0, 2 / 3, 1.0])  # C(2, 1) / C(3, 1)
    # the shares scale each candidate's samples' weights
    samples, weights = rft_data(None, kept, [], [1.0, 0.5, 2.0])
    assert len(samples) == 3 and weights == [1.0, 0.5, 2.0]
