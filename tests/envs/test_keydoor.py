"""The key-and-door corridor: levels, the window, the key shown once, doors, the expert."""

from __future__ import annotations

import pytest

from turnforge.envs import check_env, make
from turnforge.envs.keydoor import COLOURS, DELTAS, KeyDoorEnv
from turnforge.errors import UserError


def _env(**kwargs) -> KeyDoorEnv:
    return make("keydoor", **{"min_length": 20, "max_length": 40, **kwargs})  # type: ignore[return-value]


def test_corridor_never_touches_itself_and_gates_follow_the_key():
    env = _env(min_length=100, max_length=300, gate_every=40)
    for seed in range(30):
        level = env.generate_level(seed)
        assert 100 <= level.length <= 300
        index = {p: i for i, p in enumerate(level.cells)}
        assert len(index) == len(level.cells)
        for i, (r, c) in enumerate(level.cells):
            near = [index[(r + dr, c + dc)] for dr in (-1, 0, 1) for dc in (-1, 0, 1)
                    if (dr, dc) != (0, 0) and (r + dr, c + dc) in index]
            assert all(abs(j - i) <= 2 for j in near)  # only its neighbours along the corridor
        *gates, door = level.locks
        assert door == level.length
        assert gates == list(range(level.key_index + 40, level.length - 39, 40))


def test_the_key_colour_is_shown_once_and_every_lock_takes_it():
    env = _env(gate_every=8)
    obs = [env.reset(env.task("train", 3), 0)]
    actions = []
    while True:
        actions.append(env.expert_action())
        result = env.step(actions[-1])
        obs.append(result.observation)
        if result.terminated:
            break
    colour = env.state.level.key_colour
    assert result.success and result.reward == 1.0
    assert sum(f"Key: {colour}" in o for o in obs) == 1 and f"You pick up a key. Key: {colour}." in "".join(obs)
    assert actions.count(colour) == len(env.state.level.locks) >= 2


def test_walls_locked_gates_and_stray_colours_are_invalid_and_a_wrong_colour_loses():
    env = _env(gate_every=8, min_length=30)  # at least one gate: key <= 5, gate at key + 8 <= 30 - 8
    env.reset(env.task("train", 0), 0)
    s = env.state
    wall = next(a for a, (dr, dc) in zip(env.action_names, DELTAS)
                if (s.pos[0] + dr, s.pos[1] + dc) not in set(s.level.cells))
    result = env.step(wall)
    assert result.invalid_action and result.reward == -0.1 and "wall" in result.observation
    result = env.step("red")
    assert result.invalid_action and "no lock here" in result.observation
    assert env.state.pos == s.level.cells[0]
    while env._cells()[env.state.pos] != s.level.locks[0]:
        env.step(env.expert_action())
    ahead = s.level.cells[s.level.locks[0] + 1]
    move = next(a for a, (dr, dc) in zip(env.action_names, DELTAS) if (s.pos[0] + dr, s.pos[1] + dc) == ahead)
    result = env.step(move)
    assert result.invalid_action and "locked" in result.observation
    wrong = next(c for c in COLOURS if c != s.level.key_colour)
    result = env.step(wrong)
    assert result.terminated and not result.success and result.reward == 0.0


def test_expert_summary_says_the_key_once_it_is_held():
    env = _env()
    env.reset(env.task("train", 1), 0)
    assert env.expert_summary() == "Key: none yet."
    while not env.state.has_key:
        env.step(env.expert_action())
    assert env.expert_summary() == f"Key: {env.state.level.key_colour}."


def test_check_env_passes():
    check_env(_env())


@pytest.mark.parametrize("kwargs, message", [
    ({"key_distance": (3, 1)}, "key_distance must be a range"),
    ({"key_distance": (-1, 1)}, "key_distance must be a range"),
    ({"min_length": 5, "max_length": 4}, "min_length <= max_length"),
    ({"lamp_every": 0}, "lamp_every must be >= 1"),
    ({"gate_every": -1}, "gate_every must be >= 0"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(UserError, match=message):
        make("keydoor", **kwargs)


def test_a_key_at_the_start_is_held_from_the_first_observation():
    env = _env(key_distance=(0, 0), gate_every=8)
    first = env.reset(env.task("train", 2), 0)
    colour = env.state.level.key_colour
    assert env.state.has_key and f"Key: {colour}." in first and env.expert_summary() == f"Key: {colour}."
    assert env.state.level.locks[0] == 8
