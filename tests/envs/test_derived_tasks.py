"""Derived tasks (a self-evolving curriculum): easier variants of a task's level, checked
with independent solver calls; held-out levels never come back; tasks travel by pickle."""

from __future__ import annotations

import multiprocessing
import pickle

import pytest

from turnforge.envs import capabilities, make
from turnforge.envs.frozenlake import FrozenLakeLevel, shortest_path
from turnforge.envs.sokoban import SokobanLevel, solve, walkable
from turnforge.errors import UserError
from turnforge.types import Task

# Two boxes, each pushed Right twice along its row; optimal (8 moves): Up, Right, Right,
# Left, Left, Up, Right, Right. A train level under the default split.
TWO_BOXES = "#######\n#_____#\n#_$_._#\n#_$_._#\n#@____#\n#######"

CONFIGS = [
    ("sokoban", {}, SokobanLevel),
    ("sokoban", {"num_boxes": 2, "dim": 7}, SokobanLevel),
    ("frozenlake", {"size": 5}, FrozenLakeLevel),
    ("frozenlake-slippery", {"size": 6}, FrozenLakeLevel),
]


def optimal_length(level) -> int | None:
    """Moves of an optimal solution, from the module solvers (not the env's caches)."""
    path = solve(level) if isinstance(level, SokobanLevel) else shortest_path(level, level.start)
    return None if path is None else len(path)


def carried(env, text: str) -> Task:
    return Task(env.env_id, "train", 5, {"level": text})


@pytest.mark.parametrize("env_id, kwargs, level_cls", CONFIGS)
def test_derived_tasks_are_new_easier_train_tasks(env_id, kwargs, level_cls):
    env = make(env_id, **kwargs)
    total = 0
    for index in range(8):
        parent = env.task("train", index)
        parent_level = env.level_for(parent)
        derived = env.derive_tasks(parent, 6, seed=index)
        assert len(derived) <= 6
        total += len(derived)
        assert len({t.task_id for t in derived}) == len(derived)
        assert len({t.data["level"] for t in derived}) == len(derived)
        for t in derived:
            assert t.env_id == env_id and t.split == "train" and 2**40 <= t.index < 2**41
            assert set(t.data) == {"level", "parent", "how"} and t.data["parent"] == parent.task_id and t.data["how"]
            level = level_cls.from_text(t.data["level"])
            assert env.split_of(level) == "train"
            assert t.data["level"] != env.level_key(parent_level)
            n = optimal_length(level)
            assert n is not None and 0 < n < optimal_length(parent_level), t.data["how"]
        again = env.derive_tasks(parent, 6, seed=index)  # deterministic
        assert [(t.index, t.data) for t in again] == [(t.index, t.data) for t in derived]
    assert total >= 8  # deterministic: short one-box rooms give 0 to 2 each, the rest up to 6


def test_sokoban_derived_rooms_on_a_hand_built_room():
    env = make("sokoban", num_boxes=2, dim=7)
    parent = carried(env, TWO_BOXES)
    derived = {t.data["how"]: SokobanLevel.from_text(t.data["level"]) for t in env.derive_tasks(parent, 20, seed=1)}
    base = SokobanLevel.from_text(TWO_BOXES)
    beside = derived.pop("player placed next to the box, on the side to push it Right (first push of an optimal solution)")
    assert beside == SokobanLevel(base.height, base.width, base.walls, base.targets, base.boxes, (3, 1))
    fewer = {how: lv for how, lv in derived.items() if how.startswith("fewer boxes")}
    assert fewer == {
        "fewer boxes: the box at row 2, column 2 and its target at row 2, column 4 removed":
            SokobanLevel.from_text("#######\n#_____#\n#_____#\n#_$_._#\n#@____#\n#######"),
        "fewer boxes: the box at row 3, column 2 and its target at row 3, column 4 removed":
            SokobanLevel.from_text("#######\n#_____#\n#_$_._#\n#_____#\n#@____#\n#######"),
    }
    nearer = {how: lv for how, lv in derived.items() if how.startswith("box nearer")}
    after = {1: {(2, 2), (3, 3)}, 2: {(2, 2), (3, 4)}, 3: {(2, 3), (3, 4)}}  # boxes after push j of 4
    assert len(nearer) == 3
    for how, lv in nearer.items():
        j = int(how.split("after push ")[1].split(" ")[0])
        assert f"after push {j} of 4 of an optimal solution, player at row {lv.player[0]}, column {lv.player[1]}" in how
        assert lv.boxes == after[j] and lv.walls == base.walls and lv.targets == base.targets
        pushing_side = {1: (3, 2), 2: (3, 3), 3: (2, 2)}[j]  # where the player stood after that push
        assert lv.player in walkable(lv, pushing_side, lv.boxes)


def test_frozenlake_derived_starts_lie_on_a_shortest_path():
    env = make("frozenlake")
    lake = "P_O_\n_O__\n____\nO__G"
    parent = carried(env, lake)
    derived = env.derive_tasks(parent, 10, seed=0)
    starts = {FrozenLakeLevel.from_text(t.data["level"]).start for t in derived}
    # the BFS shortest safe path from (0, 0) (it tries Up, Down, Left, Right): Down, Down, Right, Down, Right, Right
    assert starts == {(1, 0), (2, 0), (2, 1), (3, 1), (3, 2)} and len(derived) == 5
    for t in derived:
        level = FrozenLakeLevel.from_text(t.data["level"])
        assert level.holes == frozenset({(0, 2), (1, 1), (3, 0)})
        j = int(t.data["how"].split("moved ")[1].split(" ")[0])
        assert optimal_length(level) == 6 - j


def test_held_out_levels_are_never_derived(monkeypatch):
    env = make("sokoban", num_boxes=2, dim=7)
    parent = carried(env, TWO_BOXES)
    first = env.derive_tasks(parent, 20, seed=1)
    hidden = first[0].data["level"]
    real_split = env.split_of
    monkeypatch.setattr(env, "split_of", lambda lv: "heldout" if env.level_key(lv) == hidden else real_split(lv))
    second = env.derive_tasks(parent, 20, seed=1)
    assert [t.data["level"] for t in second] == [t.data["level"] for t in first[1:]]
    # with half of all levels held out, none of them comes back
    env = make("sokoban")
    env.heldout_fraction = 0.5
    derived = [t for i in range(8) for t in env.derive_tasks(env.task("train", i), 6, seed=0)]
    assert derived and all(env.split_of(SokobanLevel.from_text(t.data["level"])) == "train" for t in derived)


def test_held_out_parents_and_levels_are_refused():
    env = make("sokoban")
    with pytest.raises(ValueError, match="train tasks only"):
        env.derive_tasks(env.task("heldout", 0), 4, seed=0)
    held = env.level_key(env.level_for(env.task("heldout", 0)))
    with pytest.raises(UserError, match="carries a held-out level"):
        env.reset(carried(env, held), seed=0)
    assert env.reset(Task("sokoban", "heldout", 5, {"level": held}), seed=0) == held
    with pytest.raises(UserError, match="does not parse"):
        env.reset(carried(env, "#####\n#@__#\n#####"), seed=0)


def test_pickled_tasks_reset_in_a_fresh_env():
    env = make("sokoban")
    parent = env.task("train", 3)
    derived = env.derive_tasks(parent, 4, seed=0)
    assert derived
    copies = pickle.loads(pickle.dumps(derived))
    assert copies == derived and [c.data for c in copies] == [t.data for t in derived]
    fresh = make("sokoban")  # its own level cache: nothing shared with `env`
    for t in copies:
        assert fresh.reset(t, seed=0) == t.data["level"]
        steps = 0
        while True:  # the expert solves it, in fewer moves than the parent's optimum
            r = fresh.step(fresh.expert_action())
            steps += 1
            if r.terminated:
                break
        assert r.success and steps < optimal_length(env.level_for(parent))
    grandchildren = fresh.derive_tasks(copies[0], 2, seed=0)  # derived tasks derive further
    assert all(g.data["parent"] == copies[0].task_id for g in grandchildren)


def _reset_in_worker(task: Task) -> str:
    from turnforge.envs import make

    return make("frozenlake").reset(task, seed=0)


def test_derived_task_resets_in_another_process():
    env = make("frozenlake")
    task = env.derive_tasks(env.task("train", 0), 1, seed=0)[0]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_reset_in_worker, (task,)) == task.data["level"]


def test_level_for_caches_carried_levels_by_content():
    env = make("sokoban", num_boxes=2, dim=7)
    a, b = carried(env, TWO_BOXES), Task("sokoban", "train", 99, {"level": TWO_BOXES})
    assert env.level_for(a) is env.level_for(b)
    assert ("level", TWO_BOXES) in env.level_cache


def test_derive_capability():
    assert capabilities(make("sokoban")).derive and capabilities(make("frozenlake")).derive
    game = make("2048")
    assert not capabilities(game).derive
    with pytest.raises(UserError, match=r"curriculum needs env '2048' to implement derive_tasks\(task, n, seed\)"):
        capabilities(game).require("derive", "2048", "curriculum")
