"""Sokoban: hand-built rooms (rules, rewards, render), the BFS solver, generated levels."""

from __future__ import annotations

import pytest

from turnforge.envs import make
from turnforge.envs.sokoban import ACTIONS, SokobanEnv, SokobanLevel, SokobanState, live_cells, solve


def room(env: SokobanEnv, text: str) -> None:
    """Start an episode of ``env`` in the hand-built room ``text``."""
    env.reset(seed=0)
    level = SokobanLevel.from_text(text)
    env.state = env.initial_state(level, env.rng)
    assert env.render() == text


@pytest.fixture()
def env() -> SokobanEnv:
    return make("sokoban")  # type: ignore[return-value]


def test_walk_and_walk_into_wall(env):
    room(env, "#####\n#@_.#\n#_$_#\n#___#\n#####")
    r = env.step("Up")  # wall: a valid no-op that still costs the step penalty
    assert (r.reward, r.invalid_action, r.info["moved"]) == (pytest.approx(-0.1), False, False)
    assert r.observation == "#####\n#@_.#\n#_$_#\n#___#\n#####"
    r = env.step("right")
    assert r.observation == "#####\n#_@.#\n#_$_#\n#___#\n#####"
    assert r.reward == pytest.approx(-0.1) and r.info["moved"] and not r.info["pushed"]
    r = env.step("Right")  # the player on a target renders as '+'
    assert r.observation == "#####\n#__+#\n#_$_#\n#___#\n#####"


def test_push_box_into_wall_or_box_is_noop(env):
    room(env, "######\n#@$$.#\n#___.#\n######")
    r = env.step("Right")  # box pushed into another box
    assert r.observation == "######\n#@$$.#\n#___.#\n######" and not r.info["moved"]
    room(env, "#####\n#_.@#\n#__$#\n#####")
    r = env.step("Down")  # box pushed into the wall
    assert r.observation == "#####\n#_.@#\n#__$#\n#####"
    assert r.reward == pytest.approx(-0.1) and not r.terminated


def test_box_on_and_off_target_rewards(env):
    room(env, "#######\n#@$.__#\n#___$.#\n#######")
    r = env.step("Right")  # onto a target, one box still off: +1
    assert r.observation == "#######\n#_@*__#\n#___$.#\n#######"
    assert r.reward == pytest.approx(-0.1 + 1.0) and r.info["boxes_on_target"] == 1 and not r.terminated
    r = env.step("Right")  # off the target again: -1
    assert r.observation == "#######\n#__+$_#\n#___$.#\n#######"
    assert r.reward == pytest.approx(-0.1 - 1.0) and r.info["boxes_on_target"] == 0


def test_solving_gives_solved_reward_and_ends(env):
    room(env, "######\n#@$._#\n######")
    r = env.step("<answer> Right </answer>")
    assert r.observation == "######\n#_@*_#\n######"
    assert r.reward == pytest.approx(-0.1 + 1.0 + 10.0)
    assert r.terminated and r.success and not r.truncated and r.info["boxes_on_target"] == 1
    with pytest.raises(RuntimeError, match="reset"):
        env.step("Left")


def test_invalid_actions_cost_the_penalty_and_change_nothing(env):
    obs = env.reset(seed=3)
    for text in ("go left", "Up Down", "", "<answer>north</answer>", "x" * 500):
        r = env.step(text)
        assert r.invalid_action and r.reward == env.invalid_action_penalty
        assert r.observation.startswith("Invalid action: could not parse")
        assert r.observation.endswith(obs)
        assert len(r.observation.split("\n")[0]) < 150  # long garbage is shortened


def test_step_limit_truncates():
    env = make("sokoban", max_steps=2)
    env.reset(seed=0)
    room(env, "#####\n#@__#\n#_$_#\n#_._#\n#####")
    assert not env.step("Up").truncated
    r = env.step("Up")
    assert r.truncated and not r.terminated and env.done


def test_solver_optimal_lengths():
    assert len(solve(SokobanLevel.from_text("#######\n#@_$_.#\n#######"))) == 3
    assert len(solve(SokobanLevel.from_text("#####\n#_._#\n#_$_#\n#@__#\n#####"))) == 2
    # 3 pushes plus one approach move and two moves to get behind the box again
    detour = SokobanLevel.from_text("#######\n#.____#\n#__$__#\n#___@_#\n#######")
    path = solve(detour)
    assert path is not None and len(path) == 6
    env = make("sokoban")
    env.reset(seed=0)
    env.state = SokobanState(detour, detour.player, detour.boxes)
    results = [env.step(ACTIONS[a]) for a in path]
    assert results[-1].success and not any(r.terminated for r in results[:-1])


def test_solver_unsolvable_and_budget():
    corner = SokobanLevel.from_text("#####\n#$__#\n#_@.#\n#####")  # box stuck in a corner
    assert (1, 1) not in live_cells(corner)
    assert solve(corner) is None
    assert solve(SokobanLevel.from_text("#######\n#.____#\n#__$__#\n#___@_#\n#######"), budget=5) is None


def test_generated_levels_solvable_and_deterministic(env):
    lengths = []
    for i in range(100):
        level = env.level_for(env.task("train", i))
        assert level.boxes != level.targets and len(level.boxes) == 1
        path = solve(level)
        assert path is not None and len(path) >= 1
        lengths.append(len(path))
    assert len(set(lengths)) > 3  # a mix of easy and harder rooms
    assert env.level_key(env.generate_level(7)) == env.level_key(SokobanEnv().generate_level(7))
    assert len({env.level_key(env.generate_level(s)) for s in range(30)}) > 25


@pytest.mark.parametrize("kwargs", [{}, {"num_boxes": 2}])
def test_expert_solves_train_and_heldout(kwargs):
    env = make("sokoban", **kwargs)
    for split in ("train", "heldout"):
        for i in range(50):
            env.reset(seed=i, task=env.task(split, i))
            r = None
            while not env.done:
                r = env.step(env.expert_action())
            assert r is not None and r.success, f"expert failed {split}:{i}"


def test_solution_length_bounds():
    env = make("sokoban", min_solution_length=6, max_solution_length=8)
    for i in range(20):
        assert 6 <= len(solve(env.level_for(env.task("train", i)))) <= 8


def test_expert_in_deadlock_still_returns_a_move(env):
    room(env, "######\n#$_@.#\n######")  # the box is stuck in a corner
    assert env.expert_action() in ACTIONS


def test_bad_config_is_a_user_error():
    from turnforge.errors import UserError

    with pytest.raises(UserError, match="dim"):
        make("sokoban", dim=3)
    with pytest.raises(UserError, match="num_boxes"):
        make("sokoban", num_boxes=9)


def test_potential_counts_box_distances_and_deadlocks(env):
    room(env, "#######\n#@_$_.#\n#######")
    assert env.potential() == -2.0  # box 2 cells from the target
    env.step("Right")  # walk up to the box
    assert env.potential() == -2.0
    env.step("Right")  # push: one cell closer
    assert env.potential() == -1.0
    room(env, "#####\n#$__#\n#_@.#\n#####")  # box in a corner: dead, counts 2 * dim
    assert env.potential() == -2.0 * env.dim


def test_end_on_deadlock_stops_at_the_dead_push_only():
    env = make("sokoban", end_on_deadlock=True, deadlock_penalty=-0.5, max_steps=10)
    room(env, "######\n#_$@.#\n#____#\n######")
    env.step("Down")
    r = env.step("Up")
    assert not r.terminated
    r = env.step("Left")  # box pushed into the top-left corner: no target can be reached
    assert r.terminated and not r.success and not r.truncated and r.info["deadlock"]
    # this step's penalty, the 7 skipped steps' penalties (max_steps 10, 3 steps taken), the deadlock penalty
    assert r.reward == pytest.approx(-0.1 - 0.7 - 0.5)
    room(env, "######\n#____#\n#_$@_#\n#.___#\n######")
    r = env.step("Left")  # box pushed against the wall, but it can still be pushed down onto the target
    assert not r.terminated and "deadlock" not in r.info
    room(env, "######\n#.$@_#\n######")
    r = env.step("Left")  # onto the target in a corner: solved, not dead
    assert r.terminated and r.success and "deadlock" not in r.info
    plain = make("sokoban")  # off by default: the episode runs on in the dead room
    room(plain, "######\n#_$@.#\n#____#\n######")
    r = plain.step("Left")
    assert not r.terminated and r.reward == pytest.approx(-0.1)
