"""to_gymnasium / from_gymnasium on turnforge's FrozenLake and Gymnasium's FrozenLake-v1."""

from __future__ import annotations

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env

from turnforge.envs import check_env, from_gymnasium, make, to_gymnasium

NAMES = ["Left", "Down", "Right", "Up"]  # FrozenLake-v1's Discrete(4) order
# FrozenLake-v1's default map is SFFF / FHFH / FFFH / HFFG; this route avoids the holes.
ROUTE = ["Down", "Down", "Right", "Right", "Down", "Right"]


def test_to_gymnasium_api():
    env = to_gymnasium(make("frozenlake"), render_mode="ansi")
    task = env.env.task("heldout", 3)
    obs, info = env.reset(seed=1, options={"task": task})
    assert obs == env.env.level_key(env.env.level_for(task)) and info["task_id"] == "frozenlake:heldout:3"
    assert env.observation_space.contains(obs) and env.render() == obs
    obs2, reward, terminated, truncated, info = env.step("jump")
    assert (reward, terminated, truncated, info["invalid_action"], info["success"]) == (-0.1, False, False, True, False)
    assert obs2.startswith("Invalid action")
    obs3, reward, *_, info = env.step("Right")
    assert isinstance(reward, float) and not info["invalid_action"] and "moved" in info


def test_to_gymnasium_passes_gymnasiums_checker():
    gym_check_env(to_gymnasium(make("sokoban")), skip_render_check=True)


def test_to_gymnasium_unseeded_resets_vary():
    env = to_gymnasium(make("sokoban"))
    env.reset(seed=7)
    assert len({env.reset()[0] for _ in range(10)}) > 5


def test_from_gymnasium_plays_frozenlake_v1():
    env = from_gymnasium("FrozenLake-v1", NAMES, is_slippery=False)
    env.env_id = "gym-frozenlake"
    first = env.reset(seed=0)
    assert first == "0"  # str(obs) of state 0
    results = [env.step(f"<answer>{a.lower()}</answer>") for a in ROUTE]
    assert [r.observation for r in results] == ["4", "8", "9", "10", "14", "15"]
    assert results[-1].terminated and results[-1].success and results[-1].reward == 1.0
    assert not any(r.terminated for r in results[:-1])
    assert env.done
    with pytest.raises(RuntimeError):
        env.step("Left")


def test_from_gymnasium_passes_check_env():
    for slippery in (False, True):
        env = from_gymnasium("FrozenLake-v1", NAMES, render=lambda s: f"cell {s}", is_slippery=slippery)
        env.env_id = "gym-frozenlake"
        report = check_env(env)
        # one fixed map: every task is the same game (the seed drives only the ice), said as a warning
        assert any("play alike" in w for w in report.warnings)


def test_from_gymnasium_splits_and_invalid_actions():
    env = from_gymnasium(gymnasium.make("FrozenLake-v1"), NAMES)
    train = {env.level_for(env.task("train", i)) for i in range(50)}
    heldout = {env.level_for(env.task("heldout", i)) for i in range(50)}
    assert not train & heldout and len(train) == len(heldout) == 50
    env.reset(seed=0)
    r = env.step("north")
    assert r.invalid_action and r.observation.startswith("Invalid action: could not parse 'north'")


def test_from_gymnasium_time_limit_is_truncation():
    env = from_gymnasium("FrozenLake-v1", NAMES, is_slippery=False, max_episode_steps=3)
    assert env.max_steps == 3
    env = from_gymnasium("FrozenLake-v1", NAMES, is_slippery=False, max_episode_steps=3, max_steps=50)
    env.reset(seed=0)
    results = [env.step("Left") for _ in range(3)]  # bumping into the edge: stays on the start cell
    assert [r.truncated for r in results] == [False, False, True] and not results[-1].terminated and env.done


def test_round_trip_matches_the_raw_gymnasium_env():
    raw = gymnasium.make("FrozenLake-v1", is_slippery=False)
    wrapped = to_gymnasium(from_gymnasium("FrozenLake-v1", NAMES, is_slippery=False))
    raw.reset(seed=0)
    wrapped.reset(seed=0)
    for action in ROUTE:
        obs, reward, terminated, truncated, _ = raw.step(NAMES.index(action))
        w_obs, w_reward, w_terminated, w_truncated, info = wrapped.step(action)
        assert (w_obs, w_reward, w_terminated, w_truncated) == (str(obs), reward, terminated, truncated)
    assert info["success"]


def test_from_gymnasium_rejects_mismatched_actions():
    with pytest.raises(ValueError, match="3 action names for 4 actions"):
        from_gymnasium("FrozenLake-v1", NAMES[:3])
    with pytest.raises(TypeError, match="Discrete"):
        from_gymnasium(gymnasium.make("Pendulum-v1"), ["a"])
