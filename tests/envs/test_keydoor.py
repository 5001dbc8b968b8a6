"""The key-and-door corridor: levels, the window, the key shown once, doors, the expert."""

from __future__ import annotations

import pytest

from turnforge.envs import check_env, make
from turnforge.envs.keydoor import DELTAS, KeyDoorEnv
from turnforge.errors import UserError


def _env(**kwargs) -> KeyDoorEnv:
    return make("keydoor", **{"min_length": 20, "max_length": 40, **kwargs})  # type: ignore[return-value]


def test_corridor_never_touches_itself_and_leaves_room_for_the_doors():
    env = _env(min_length=100, max_length=300)
    for seed in range(30):
        level = env.generate_level(seed)
        assert 100 <= level.length <= 300
        index = {p: i for i, p in enumerate(level.cells)}
        assert len(index) == len(level.cells)
        for i, (r, c) in enumerate(level.cells):
            near = [index[(r + dr, c + dc)] for dr in (-1, 0, 1) for dc in (-1, 0, 1)
                    if (dr, dc) != (0, 0) and (r + dr, c + dc) in index]
            assert all(abs(j - i) <= 2 for j in near)  # only its neighbours along the corridor
        end = level.cells[-1]
        assert sorted(c for _, c in level.doors) == ["blue", "green", "red"]
        assert all(spot not in index and abs(spot[0] - end[0]) + abs(spot[1] - end[1]) == 1 for spot, _ in level.doors)


def test_the_key_colour_is_shown_once_and_lamps_show_every_colour():
    env = _env()
    obs = [env.reset(env.task("train", 3), 0)]
    while True:
        result = env.step(env.expert_action())
        obs.append(result.observation)
        if result.terminated:
            break
    colour = env.state.level.key_colour
    assert result.success and result.reward == 1.0
    pickups = [o for o in obs if "key." in o and "pick up" in o]
    assert pickups == [next(o for o in obs if f"You pick up a {colour} key." in o)]
    assert sum(f"{colour} key" in o for o in obs) == 1


def test_walls_are_invalid_and_the_wrong_door_loses():
    env = _env()
    env.reset(env.task("train", 0), 0)
    s = env.state
    wall = next(a for a, (dr, dc) in zip(env.action_names, DELTAS)
                if (s.pos[0] + dr, s.pos[1] + dc) not in set(s.level.cells))
    result = env.step(wall)
    assert result.invalid_action and result.reward == -0.1 and "wall" in result.observation
    assert env.state.pos == s.level.cells[0]
    while env._cells()[env.state.pos] != len(env.state.level.cells) - 1:
        env.step(env.expert_action())
    right = env.expert_action()
    wrong = next(a for a, (dr, dc) in zip(env.action_names, DELTAS)
                 if a != right and (env.state.pos[0] + dr, env.state.pos[1] + dc) in dict(env.state.level.doors))
    result = env.step(wrong)
    assert result.terminated and not result.success and result.reward == 0.0


def test_expert_summary_says_the_key_once_it_is_held():
    env = _env()
    env.reset(env.task("train", 1), 0)
    assert env.expert_summary() == "I have no key yet."
    while not env.state.has_key:
        env.step(env.expert_action())
    assert env.expert_summary() == f"I carry a {env.state.level.key_colour} key."


def test_check_env_passes():
    check_env(_env())


@pytest.mark.parametrize("kwargs, message", [
    ({"key_distance": (3, 1)}, "key_distance must be a range"),
    ({"min_length": 5, "max_length": 4}, "min_length <= max_length"),
    ({"lamp_every": 0}, "lamp_every must be >= 1"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(UserError, match=message):
        make("keydoor", **kwargs)
