"""FrozenLake: guaranteed paths, hand-built maps, the 1/3 slip rule, the experts."""

from __future__ import annotations

from collections import Counter

import pytest

from turnforge.envs import make
from turnforge.envs.frozenlake import FrozenLakeEnv, FrozenLakeLevel, FrozenLakeState, shortest_path


def lake(env: FrozenLakeEnv, holes: set[tuple[int, int]], player=(0, 0), size: int = 4) -> None:
    env.reset(seed=0)
    env.state = FrozenLakeState(FrozenLakeLevel(size, frozenset(holes)), player)


def test_every_generated_map_has_a_path():
    env = make("frozenlake", hole_prob=0.5)  # many maps need redrawing at this density
    holes = 0
    for split in ("train", "heldout"):
        for i in range(50):
            level = env.level_for(env.task(split, i))
            assert (0, 0) not in level.holes and level.goal not in level.holes
            assert shortest_path(level, (0, 0)) is not None
            holes += len(level.holes)
    assert holes > 100 * 14 * 0.3  # the maps are not trivially empty


def test_render_and_moves():
    env = make("frozenlake")
    lake(env, {(0, 1), (1, 3)})
    assert env.render() == "PO__\n___O\n____\n___G"
    r = env.step("Up")  # off the map: stay
    assert r.observation == env.render() == "PO__\n___O\n____\n___G"
    assert (r.reward, r.terminated, r.invalid_action, r.info["moved"]) == (0.0, False, False, False)
    r = env.step("down")
    assert r.observation == "_O__\nP__O\n____\n___G" and r.info["moved"]


def test_hole_ends_without_reward_and_goal_succeeds():
    env = make("frozenlake")
    lake(env, {(0, 1)})
    r = env.step("Right")
    assert r.terminated and not r.success and r.reward == 0.0
    lake(env, set(), player=(3, 2))
    r = env.step("Right")
    assert r.terminated and r.success and r.reward == 1.0


def test_slippery_follows_the_one_third_rule():
    env = make("frozenlake-slippery", max_steps=10**6)
    env.reset(seed=123)
    counts: Counter[tuple[int, int]] = Counter()
    n = 3000
    for _ in range(n):
        env.state = FrozenLakeState(FrozenLakeLevel(4, frozenset()), (1, 1))
        counts[env.step("Up").info["direction"]] += 1
    assert set(counts) == {"Up", "Left", "Right"}  # never the opposite direction
    for direction in ("Up", "Left", "Right"):
        assert abs(counts[direction] / n - 1 / 3) < 0.035, counts


def test_not_slippery_is_deterministic():
    env = make("frozenlake", max_steps=10**6)
    env.reset(seed=5)
    for _ in range(200):
        env.state = FrozenLakeState(FrozenLakeLevel(4, frozenset()), (1, 1))
        r = env.step("Left")
        assert r.info["direction"] == "Left" and not r.info["slipped"] and env.state.player == (1, 0)


def test_expert_takes_a_shortest_path():
    env = make("frozenlake")
    for split in ("train", "heldout"):
        for i in range(50):
            env.reset(seed=i, task=env.task(split, i))
            optimal = len(shortest_path(env.state.level, (0, 0)))
            steps = 0
            while not env.done:
                r = env.step(env.expert_action())
                steps += 1
            assert r.success and steps == optimal


def test_slippery_expert_beats_a_fixed_policy():
    env = make("frozenlake-slippery")
    expert_wins = fixed_wins = 0
    for i in range(200):
        env.reset(seed=i, task=env.task("train", i))
        while not env.done:
            r = env.step(env.expert_action())
        expert_wins += r.success
        env.reset(seed=i, task=env.task("train", i))
        k = 0
        while not env.done:  # alternate Down/Right: the shortest route if ice were not slippery
            r = env.step("Down" if k % 2 == 0 else "Right")
            k += 1
        fixed_wins += r.success
    assert expert_wins >= 0.8 * 200 and expert_wins > fixed_wins + 20


def test_bad_config_is_a_user_error():
    from turnforge.errors import UserError

    with pytest.raises(UserError, match="hole_prob"):
        make("frozenlake", hole_prob=1.0)


def test_first_word_parsing_takes_the_answers_first_word_only_when_asked():
    from turnforge.envs.base import InvalidAction, parse_choice

    names = ("Up", "Down", "Left", "Right")
    assert parse_choice("Down, because the hole is left", names, first_word=True) == 1
    assert parse_choice("  right.\nThen up", names, first_word=True) == 3
    assert parse_choice("<answer>Up</answer> then Down", names, first_word=True) == 0  # tags win
    for text in ("Down, because the hole is left", "Go down"):
        with pytest.raises(InvalidAction):
            parse_choice(text, names)  # the default: the whole answer must be the move
    with pytest.raises(InvalidAction):
        parse_choice("Go down", names, first_word=True)


def test_potential_rises_by_one_cell_per_expert_move_and_is_positive_before_the_goal():
    env = make("frozenlake", size=4)
    for i in range(20):
        env.reset(seed=i, task=env.task("train", i))
        optimal = len(shortest_path(env.state.level, (0, 0)))
        assert env.potential() == pytest.approx(1 - optimal / 16)
        while True:
            before = env.potential()
            r = env.step(env.expert_action())
            if env.done:
                break
            assert env.potential() == pytest.approx(before + 1 / 16) and env.potential() > 0
        assert r.success and before == pytest.approx(1 - 1 / 16)  # one move from the goal
