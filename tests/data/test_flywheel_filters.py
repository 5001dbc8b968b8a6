"""The flywheel filters on hand-built episodes: what each keeps, counted."""

from __future__ import annotations

import numpy as np
import pytest

from turnforge.data.filters import Candidate, FilterParams, apply_filters, cut_loops, kept_samples
from turnforge.types import Sample, Task, Trajectory, Turn


def traj(tid: str, task: int, keys: list[str], *, success=True, ret=1.0, failure=None, gen_cut=(), reason=None,
         actions=None) -> Trajectory:
    actions = actions or [f"a{i}" for i in range(len(keys))]
    turns = tuple(Turn(f"obs {k}", a, 0.0, False, k, generation_truncated=i in gen_cut) for i, (k, a) in enumerate(zip(keys, actions)))
    samples = tuple(Sample(np.array([1, 2, 3 + i]), np.array([0, 0, 1], np.int8), np.array([np.nan, np.nan, -0.5], np.float32),
                           np.array([-1, -1, 0], np.int32), tid, i) for i in range(len(keys)))
    return Trajectory(tid, Task("e", "train", task), f"g{task}", 0, turns, samples, ret, success, success, not success,
                      reason, 0, failure)


def test_cut_loops_keeps_the_path_without_detours():
    assert cut_loops(["a", "b", "a", "c"], range(4)) == (2, 3)
    assert cut_loops(["a", "b", "c", "b", "d"], range(5)) == (0, 3, 4)
    assert cut_loops(["a", "b", "c"], range(3)) == (0, 1, 2)
    assert cut_loops(["a", "a", "a"], range(3)) == (2,)  # two moves into a wall, then the one that counted


def test_each_filter_and_the_counts():
    cands = [
        Candidate.of(traj("t1", 1, ["a", "b", "a", "c"])),                     # success with a detour
        Candidate.of(traj("t2", 1, ["a", "c"], actions=["a2", "a3"])),        # the same path, shorter: same actions as t1 after cut
        Candidate.of(traj("t3", 2, ["x"], success=False, ret=-1.0)),          # failure
        Candidate.of(traj("t4", 3, ["y", "z"], failure="env step() raised")),  # infra failure
        Candidate.of(traj("t5", 4, ["p", "q"], gen_cut=(1,))),                 # an action cut at max_new_tokens
    ]
    kept, counts = apply_filters(cands, ["infra", "success", "truncation", "loops", "dedup", "task_cap"], FilterParams())
    assert [(c.name, c.episodes_in, c.episodes_out, c.turns_in, c.turns_out) for c in counts] == [
        ("infra", 5, 4, 11, 9), ("success", 4, 3, 9, 8), ("truncation", 3, 2, 8, 6), ("loops", 2, 2, 6, 4),
        ("dedup", 2, 1, 4, 2), ("task_cap", 1, 1, 2, 2),
    ]
    assert [c.trajectory.trajectory_id for c in kept] == ["t1"] and kept[0].turns == (2, 3)
    assert [x.turn_index for x in kept_samples(kept)] == [2, 3]


def test_reward_length_and_cap_parameters():
    cands = [Candidate.of(traj(f"t{i}", 7, ["s"] * 0 + [f"k{j}" for j in range(n)], ret=r)) for i, (n, r) in enumerate([(3, 0.5), (1, 2.0), (2, 1.0)])]
    kept, _ = apply_filters(cands, ["reward"], FilterParams(min_reward=1.0))
    assert [c.trajectory.trajectory_id for c in kept] == ["t1", "t2"]
    kept, _ = apply_filters(cands, ["length"], FilterParams(max_length=2))
    assert [c.trajectory.trajectory_id for c in kept] == ["t1", "t2"]
    kept, _ = apply_filters(cands, ["task_cap"], FilterParams(per_task_cap=2))
    assert [c.trajectory.trajectory_id for c in kept] == ["t1", "t2"]  # the two shortest of task 7, in their order


def test_whole_episode_samples_pass_the_loop_filter_unchanged():
    t = traj("w", 1, ["a", "b", "a"])
    whole = Sample(np.array([1, 2, 3, 4]), np.array([0, 1, 0, 1], np.int8), np.array([np.nan, -1, np.nan, -1], np.float32),
                   np.array([-1, 0, -1, 0], np.int32), "w", -1)
    from dataclasses import replace

    t = replace(t, samples=(whole,))
    kept, _ = apply_filters([Candidate.of(t)], ["loops"], FilterParams())
    assert kept[0].turns == (0, 1, 2) and kept_samples(kept) == [whole]


@pytest.mark.parametrize("name", ["infra", "success", "reward", "truncation", "loops", "length", "dedup", "task_cap"])
def test_every_filter_accepts_an_empty_list(name):
    assert apply_filters([], [name], FilterParams())[0] == []


def test_every_segment_of_a_kept_episode_is_trained():
    """A summarize episode's segments all span several turns: none may be lost."""
    from dataclasses import replace

    t = traj("s", 1, ["a", "b", "c"])
    segments = tuple(Sample(np.array([1, 2, 3]), np.array([0, 1, 1], np.int8), np.array([np.nan, -1, -1], np.float32),
                            np.array([-1, 0, 0], np.int32), "s", -1, segment_index=k, parent_segment=k - 1, first_turn=k)
                     for k in range(3))
    kept, _ = apply_filters([Candidate.of(replace(t, samples=segments))], ["success", "loops"], FilterParams())
    assert kept_samples(kept) == list(segments)
