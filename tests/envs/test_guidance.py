"""Guidance (hints of graded strength) for Sokoban and FrozenLake: exact hint texts on
hand-built rooms, the guards, strip_guidance, expert-query counts, option errors."""

from __future__ import annotations

import hashlib
import random

import pytest

from turnforge.envs import capabilities, make
from turnforge.envs import sokoban as sokoban_module
from turnforge.envs.base import HINT_PREFIX, strip_guidance
from turnforge.envs.frozenlake import FrozenLakeLevel
from turnforge.envs.registry import build_env
from turnforge.envs.sokoban import SokobanLevel
from turnforge.errors import UserError
from turnforge.types import Task

# Player top-left; the box must go Right twice (row 2) to the target. Optimal: Down, Right,
# Right, Right. A box pushed Up or Down from (2, 3) lands against a wall row: a dead cell.
ROOM = "#######\n#@____#\n#__$_.#\n#_____#\n#######"
# Holes Up, Down and Right of the player; the only safe way: Left, Down, Down, Right x3.
LAKE = "_O__\n_PO_\n_O__\n___G"


def start(env, text: str, level_cls) -> str:
    """Reset ``env`` into a hand-built level (a task carrying it, in the level's own split)."""
    split = env.split_of(level_cls.from_text(text))
    return env.reset(Task(env.env_id, split, 7, {"level": text}), seed=0)


def hint_lines(observation: str) -> list[str]:
    return [line[len(HINT_PREFIX):] for line in observation.split("\n") if line.startswith(HINT_PREFIX)]


# ---------------------------------------------------------------------- off = unchanged
def _digest(env_id: str, **kwargs) -> str:
    """Observations, rewards and infos of fixed random/expert/invalid action sequences."""
    h = hashlib.blake2b(digest_size=12)
    env = make(env_id, **kwargs)
    for split in ("train", "heldout"):
        for index in range(6):
            rng = random.Random(index)
            h.update(env.reset(env.task(split, index), seed=index).encode())
            for _ in range(30):
                a = rng.choice(["Up", "Down", "Left", "Right", "<answer>Up</answer>", "jump"])
                if rng.random() < 0.3:
                    a = env.expert_action()
                r = env.step(a)
                h.update(repr((r.observation, r.reward, r.terminated, r.truncated, r.invalid_action, r.success,
                               sorted(r.info.items()))).encode())
                if r.terminated or r.truncated:
                    break
    return h.hexdigest()


@pytest.mark.parametrize("env_id, kwargs, digest", [
    ("sokoban", {}, "532f17ee45994337cc4d1373"),
    ("sokoban", {"num_boxes": 2, "dim": 7, "end_on_deadlock": True}, "90ddb06bf9e9410a501315a7"),
    ("frozenlake", {}, "97f6d89d2118e2c2c3e03bb0"),
    ("frozenlake-slippery", {"size": 5}, "14fd6b74c0eb8099c2af4c44"),
])
def test_guidance_off_plays_byte_identically_to_before(env_id, kwargs, digest):
    # digests recorded from the envs before guidance existed
    assert _digest(env_id, **kwargs) == digest
    assert _digest(env_id, guidance=0, **kwargs) == digest


# ---------------------------------------------------------------------- sokoban
def test_sokoban_hint_texts_per_level():
    plain = make("sokoban", guidance=0)
    assert start(plain, ROOM, SokobanLevel) == ROOM and plain.reset_expert_queries == 0
    expected = {
        1: [],
        2: ["the next push moves a box Right"],
        3: ["the next push moves a box Right", "box pushes to solve: Right, Right"],
    }
    for level, hints in expected.items():
        env = make("sokoban", guidance=level)
        obs = start(env, ROOM, SokobanLevel)
        assert obs == "\n".join([ROOM, *(HINT_PREFIX + h for h in hints)])
        assert env.reset_expert_queries == len(hints)
        assert env.render() == ROOM  # render and anchor key stay unguided
        assert env.anchor_key() == plain.anchor_key()
    env = make("sokoban", guidance=3)
    start(env, ROOM, SokobanLevel)
    for action in ("Down", "Right", "Right"):  # walk, then the first push
        r = env.step(action)
    assert env.state.boxes == frozenset({(2, 4)})
    assert hint_lines(r.observation) == ["the next push moves a box Right", "box pushes to solve: Right"]
    r = env.step("Right")  # solved: the final observation carries no hints and no query
    assert r.success and r.observation == "#######\n#_____#\n#___@*#\n#_____#\n#######"
    assert r.info["n_expert_queries"] == 0


def test_sokoban_guard_undoes_a_deadlocking_push_only():
    env, plain = make("sokoban", guidance=1), make("sokoban", end_on_deadlock=True)
    start(env, ROOM, SokobanLevel)
    start(plain, ROOM, SokobanLevel)
    for action in ("Down", "Down", "Right", "Right"):  # to (3, 3), under the box
        r, p = env.step(action), plain.step(action)
        assert r.observation == p.observation and r.info["guarded"] is False
    before = env.render()
    r = env.step("Up")  # would push the box to (2, 3) -> (1, 3): against the top wall, dead
    assert (r.info["guarded"], r.info["moved"], r.info["pushed"], r.terminated) == (True, False, False, False)
    assert r.reward == pytest.approx(env.step_penalty)
    assert env.render() == before
    assert r.observation == before + "\nHint: pushing the box Up there would make the room unsolvable, so it was undone"
    assert r.info["n_expert_queries"] == 1  # the guard's note counts as a query
    p = plain.step("Up")  # the same test as end_on_deadlock: without the guard the episode ends
    assert p.info["deadlock"] and p.terminated and not p.success
    r = env.step("Left")  # the note is shown once
    assert r.observation == env.render() and not r.info["guarded"] and r.info["n_expert_queries"] == 0
    for action in ("Up", "Right", "Right"):  # a live push and the solving push are left alone
        r = env.step(action)
        assert not r.info["guarded"]
    assert r.success and r.info["pushed"]


def test_sokoban_guard_allows_a_push_onto_a_target_in_a_corner():
    env = make("sokoban", guidance=1)
    start(env, "######\n#@$.##\n#____#\n######", SokobanLevel)
    r = env.step("Right")
    assert r.success and not r.info["guarded"]


def test_sokoban_expert_queries_are_counted_and_solves_cached(monkeypatch):
    calls = []
    real_solve = sokoban_module.solve
    monkeypatch.setattr(sokoban_module, "solve", lambda *a, **k: calls.append(1) or real_solve(*a, **k))
    env = make("sokoban", guidance=2)
    start(env, ROOM, SokobanLevel)
    assert env.reset_expert_queries == 1
    counts = []
    for action in ("Down", "xyzzy", "Right", "Right"):
        counts.append(env.step(action).info["n_expert_queries"])
    assert counts == [2, 1, 1, 1]  # the first step also reports the reset observation's query; the invalid
    # action's observation shows the hint too
    assert len(calls) == 1  # one solve from the start covers every state on its path
    assert env.expert_action() == "Right" and len(calls) == 1  # shared with the expert


def test_sokoban_unsolvable_room_says_so():
    env = make("sokoban", guidance=2, num_boxes=2, dim=7)
    # two boxes side by side against the top wall: neither can leave it, both cells live
    obs = start(env, "#######\n#_$$__#\n#____.#\n#@___.#\n#######", SokobanLevel)
    assert hint_lines(obs) == ["the solver found no solution from here; the room may be unsolvable"]
    assert env.reset_expert_queries == 1


# ---------------------------------------------------------------------- frozenlake
def test_frozenlake_hint_texts_per_level():
    expected = {1: [], 2: ["holes: Up, Down, Right"], 3: ["holes: Up, Down, Right", "the goal is 6 safe moves away"]}
    for level, hints in expected.items():
        env = make("frozenlake", guidance=level)
        assert start(env, LAKE, FrozenLakeLevel) == "\n".join([LAKE, *(HINT_PREFIX + h for h in hints)])
        assert env.reset_expert_queries == (1 if level == 3 else 0)
    env = make("frozenlake", guidance=3)
    start(env, LAKE, FrozenLakeLevel)
    seen = []
    for i, action in enumerate(("Left", "Down", "Down", "Right", "Right")):
        r = env.step(action)
        seen.append(hint_lines(r.observation))
        assert r.info["n_expert_queries"] == (2 if i == 0 else 1)  # the first step adds the reset observation's
    assert seen == [
        ["holes: none", "the goal is 5 safe moves away"],  # (1, 0)
        ["holes: Right", "the goal is 4 safe moves away"],  # (2, 0)
        ["holes: none", "the goal is 3 safe moves away"],  # (3, 0)
        ["holes: Up", "the goal is 2 safe moves away"],  # (3, 1)
        ["holes: none", "the goal is 1 safe move away"],  # (3, 2)
    ]
    r = env.step("Right")
    assert r.success and hint_lines(r.observation) == [] and r.info["n_expert_queries"] == 0


def test_frozenlake_guard_undoes_a_fall():
    env, plain = make("frozenlake", guidance=1), make("frozenlake")
    start(env, LAKE, FrozenLakeLevel)
    start(plain, LAKE, FrozenLakeLevel)
    r = env.step("Right")
    assert (r.info["guarded"], r.info["moved"], r.terminated, r.reward) == (True, False, False, 0.0)
    assert r.observation == LAKE + "\nHint: moving Right from there fell into a hole; the move was undone"
    assert r.info["n_expert_queries"] == 1  # the guard's note
    assert plain.step("Right").terminated  # without the guard the fall ends the episode
    r = env.step("Left")
    assert r.observation == "_O__\nP_O_\n_O__\n___G" and not r.info["guarded"]


def test_frozenlake_slippery_guard_checks_the_move_the_ice_made():
    slips = set()
    for seed in range(30):
        env = make("frozenlake-slippery", guidance=1)
        split = env.split_of(FrozenLakeLevel.from_text(LAKE))
        env.reset(Task(env.env_id, split, 7, {"level": LAKE}), seed=seed)
        r = env.step("Left")  # Left is safe; the ice may send the player Up or Down, into a hole
        if r.info["slipped"]:
            slips.add(r.info["direction"])
            assert r.info["guarded"] and env.render() == LAKE
            assert hint_lines(r.observation) == [
                f"the ice slid you {r.info['direction']} instead of Left: moving {r.info['direction']} from there "
                "fell into a hole; the move was undone"
            ]
        else:
            assert not r.info["guarded"] and env.render() == "_O__\nP_O_\n_O__\n___G"
    assert slips == {"Up", "Down"}


# ---------------------------------------------------------------------- strip_guidance
@pytest.mark.parametrize("env_id, kwargs", [
    ("sokoban", {}), ("sokoban", {"num_boxes": 2, "dim": 7}), ("frozenlake", {}), ("frozenlake-slippery", {"size": 5}),
])
@pytest.mark.parametrize("level", [1, 2, 3])
def test_strip_guidance_recovers_the_unguided_observation(env_id, kwargs, level):
    """Each guided step, replayed from the same state in an unguided env: the stripped
    observation is byte-identical (guarded steps: the state is unchanged instead)."""
    guided, plain = make(env_id, guidance=level, **kwargs), make(env_id, **kwargs)
    rng = random.Random(level)
    hinted = 0
    for index in range(4):
        task = guided.task("train", index)
        assert strip_guidance(guided.reset(task, seed=index)) == plain.reset(task, seed=index)
        for _ in range(25):
            action = rng.choice(["Up", "Down", "Left", "Right", "Hint: Up", "up\nHint: x", guided.expert_action()])
            snap = guided.snapshot()
            plain.restore(snap)
            before = guided.render()
            r, p = guided.step(action), plain.step(action)
            hinted += r.observation != strip_guidance(r.observation)
            if r.info.get("guarded"):
                assert strip_guidance(r.observation) == before == guided.render()
            else:
                assert strip_guidance(r.observation) == p.observation
                assert guided.anchor_key() == plain.anchor_key()
                assert guided.snapshot().payload[0] == plain.snapshot().payload[0]
            if r.terminated or r.truncated:
                break
    assert hinted > 0 or level == 1


def test_strip_guidance_keeps_text_without_hints():
    assert strip_guidance("a\nb") == "a\nb"
    assert strip_guidance("a\nHint: x\nHint: y") == "a"
    assert strip_guidance("Hint: only line") == "Hint: only line"
    assert strip_guidance("a\nHint: x\nb") == "a\nHint: x\nb"  # only trailing hint lines are hints


# ---------------------------------------------------------------------- options and capability
def test_guidance_option_from_a_recipe_and_bad_levels():
    env = build_env("sokoban", {"guidance": 2})
    assert env.guidance == 2
    assert build_env("frozenlake", {"guidance": 3}).guidance == 3
    for bad in (4, -1, "2", True):
        with pytest.raises(UserError, match=r"guidance=.* valid levels: 0 = off; 1 = deadlock guard.*3 = level 2 \+"):
            make("sokoban", guidance=bad)
    with pytest.raises(UserError, match=r"guidance=4 .*valid levels: 0 = off; 1 = hole guard.*3 = level 2 \+ the number"):
        make("frozenlake", guidance=4)
    with pytest.raises(UserError, match="has no option 'guidance'"):
        make("2048", guidance=1)


def test_guidance_capability():
    assert capabilities(make("sokoban")).guidance and capabilities(make("frozenlake-slippery")).guidance
    game = make("2048")
    assert not capabilities(game).guidance
    with pytest.raises(UserError, match=r"^rl\.guidance needs env '2048' to implement guidance_levels .*hints\(level\)"):
        capabilities(game).require("guidance", "2048", "rl.guidance")
