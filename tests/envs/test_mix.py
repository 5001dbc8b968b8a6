"""``mix``: task i is one member's task i (fixed by a hash, weights [1, 0] give the first member's
tasks exactly); capabilities delegate to the member playing; check_env passes; bad options."""

from __future__ import annotations

import random

import pytest

from turnforge.envs import check_env, make
from turnforge.errors import UserError

MEMBERS = [{"id": "sokoban", "kwargs": {"dim": 6, "num_boxes": 1}}, {"id": "frozenlake"}]


def test_weights_1_0_are_the_first_members_tasks_exactly():
    mix, sokoban = make("mix", envs=MEMBERS, weights=[1, 0]), make("sokoban", dim=6, num_boxes=1)
    for i in range(5):
        task = mix.task("heldout", i)
        assert task.env_id == "mix" and task.data["env"] == "sokoban"
        assert mix.reset(task, i) == sokoban.reset(sokoban.task("heldout", i), i)
        assert mix.step("Up") == sokoban.step("Up")


def test_an_even_mix_draws_both_members_the_same_way_every_time():
    a, b = make("mix", envs=MEMBERS), make("mix", envs=MEMBERS)
    drawn = [a.task("train", i).data["env"] for i in range(200)]
    assert drawn == [b.task("train", i).data["env"] for i in range(200)]
    assert 70 < drawn.count("sokoban") < 130  # about half of each
    frozenlake = make("frozenlake")
    i = drawn.index("frozenlake")
    assert a.reset(a.task("train", i), 3) == frozenlake.reset(frozenlake.task("train", i), 3)


def test_capabilities_delegate_to_the_member_playing():
    mix = make("mix", envs=MEMBERS)
    i = [mix.task("train", k).data["env"] for k in range(20)].index("frozenlake")
    mix.reset(mix.task("train", i), 0)
    snap = mix.snapshot()
    assert snap.payload[0] == "frozenlake" and mix.anchor_key().startswith("frozenlake:")
    first = mix.step(mix.expert_action())
    j = [mix.task("train", k).data["env"] for k in range(20)].index("sokoban")
    mix.reset(mix.task("train", j), 0)  # another member plays now
    mix.restore(snap)
    assert mix.step(mix.expert_action()) == first
    assert mix.random_action(random.Random(0)) in mix.action_names  # both games move Up/Down/Left/Right


def test_check_env_passes():
    check_env("mix", env_kwargs={"envs": MEMBERS})


@pytest.mark.parametrize("kwargs, message", [
    ({"envs": [{"id": "sokoban"}]}, "env mix needs at least 2 envs in env.kwargs.envs, got 1"),
    ({"envs": [{"id": "sokoban"}, {"id": "nope"}]}, "unknown env 'nope'"),
    ({"envs": [{"id": "sokoban"}, {"id": "sokoban"}]}, "must be distinct env ids other than 'mix'"),
    ({"envs": MEMBERS, "weights": [1]}, "env mix: weights [1] must be 2 non-negative numbers"),
    ({"envs": MEMBERS, "weights": [0, 0]}, "not all 0"),
    ({"envs": [{"id": "sokoban"}, {"id": "calculator"}]}, "env mix: envs ['sokoban', 'calculator'] have different tools"),
    ({"envs": [{"id": "sokoban", "options": {}}, {"id": "frozenlake"}]}, "env mix: envs[0] is"),
])
def test_bad_mix_options(kwargs, message):
    with pytest.raises(UserError, match=None) as err:
        make("mix", **kwargs)
    assert message in str(err.value)
