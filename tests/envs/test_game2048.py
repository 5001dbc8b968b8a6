"""2048: merge rules against hand-computed boards, spawns, no-ops, endings, the expert."""

from __future__ import annotations

import pytest

from turnforge.envs import make
from turnforge.envs.game2048 import ACTIONS, Game2048State, can_move, move, render_board, slide_row_left

LEFT, RIGHT, UP, DOWN = (ACTIONS.index(a) for a in ("Left", "Right", "Up", "Down"))


@pytest.mark.parametrize(
    "row, expected, reward",
    [
        ((2, 2, 2, 2), (4, 4, 0, 0), 8),
        ((2, 2, 4, 0), (4, 4, 0, 0), 4),  # the new 4 does not merge again in the same move
        ((4, 0, 4, 8), (8, 8, 0, 0), 8),
        ((0, 0, 0, 2), (2, 0, 0, 0), 0),
        ((2, 4, 8, 16), (2, 4, 8, 16), 0),
        ((4, 4, 4, 0), (8, 4, 0, 0), 8),  # merges start from the side the tiles move to
    ],
)
def test_slide_row(row, expected, reward):
    assert slide_row_left(row) == (expected, reward)


def test_move_all_directions():
    board = ((2, 2, 0, 4), (0, 2, 0, 4), (2, 0, 0, 8), (0, 0, 0, 8))
    assert move(board, LEFT) == (((4, 4, 0, 0), (2, 4, 0, 0), (2, 8, 0, 0), (8, 0, 0, 0)), 4)
    assert move(board, RIGHT) == (((0, 0, 4, 4), (0, 0, 2, 4), (0, 0, 2, 8), (0, 0, 0, 8)), 4)
    assert move(board, UP) == (((4, 4, 0, 8), (0, 0, 0, 16), (0, 0, 0, 0), (0, 0, 0, 0)), 4 + 4 + 8 + 16)
    assert move(board, DOWN) == (((0, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 8), (4, 4, 0, 16)), 4 + 4 + 8 + 16)


def start(env, board) -> None:
    env.reset(seed=0)
    env.state = Game2048State(board)


def test_step_merges_and_spawns_one_tile():
    env = make("2048")
    start(env, ((2, 2, 2, 2), (0,) * 4, (0,) * 4, (0,) * 4))
    r = env.step("Left")
    assert r.reward == 8.0 and r.info["moved"] and not r.terminated
    tiles = sorted(v for row in env.state.board for v in row if v)
    assert tiles in ([2, 4, 4], [4, 4, 4])  # the merged pair plus one spawned 2 or 4
    assert env.state.board[0][:2] == (4, 4)


def test_noop_move_is_valid_and_spawns_nothing():
    env = make("2048")
    board = ((2, 4, 8, 16), (0,) * 4, (0,) * 4, (0,) * 4)
    start(env, board)
    rng_state = env.rng.getstate()
    r = env.step("Up")
    assert (r.reward, r.invalid_action, r.info["moved"]) == (0.0, False, False)
    assert env.state.board == board and env.rng.getstate() == rng_state


def test_render_format():
    assert render_board(((2, 0), (1024, 4))) == "2 .\n1024 4"
    env = make("2048")
    obs = env.reset(seed=0)
    assert len(obs.split("\n")) == 4 and all(len(row.split(" ")) == 4 for row in obs.split("\n"))
    assert sum(c != "." for c in obs.split()) == 2  # start_tiles


def test_reaching_the_target_succeeds():
    env = make("2048", target_tile=256)
    start(env, ((128, 128, 0, 0), (0,) * 4, (0,) * 4, (0,) * 4))
    r = env.step("Right")
    assert r.terminated and r.success and r.reward == 256.0 and r.info["max_tile"] == 256


def test_stuck_board_ends_without_success():
    env = make("2048", size=2)
    start(env, ((0, 8), (16, 32)))
    r = env.step("Left")  # the spawn (2 or 4) fills the last cell next to 8 and 32: no move left
    assert r.terminated and not r.success and not can_move(env.state.board)


def test_spawns_are_deterministic_in_the_seed():
    def play(seed):
        env = make("2048")
        env.reset(seed=seed, task=env.task("train", 0))
        return [env.step(a).observation for a in ["Left", "Up", "Right", "Down"] * 5]

    assert play(1) == play(1)
    assert play(1) != play(2)  # same level, different dynamics seed


def test_snapshot_restores_the_rng():
    env = make("2048")
    env.reset(seed=4)
    env.step("Left")
    snap = env.snapshot()
    first = [env.step(a) for a in ["Up", "Left", "Down", "Right"] * 3]
    env.restore(snap)
    assert [env.step(a) for a in ["Up", "Left", "Down", "Right"] * 3] == first


def test_expert_usually_wins():
    env = make("2048", target_tile=128)
    wins = 0
    for i in range(10):
        env.reset(seed=i, task=env.task("heldout", i))
        while not env.done:
            r = env.step(env.expert_action())
        wins += r.success
    assert wins >= 9


def test_bad_config_is_a_user_error():
    from turnforge.errors import UserError

    with pytest.raises(UserError, match="target_tile"):
        make("2048", target_tile=100)
