"""Task sources (datasets with their own split, generators), the light contract's task access,
and capability discovery."""

from __future__ import annotations

import json
import random

import pytest

from turnforge import Env, StepResult, TaskDataset, TaskGenerator
from turnforge.envs import capabilities, make, register
from turnforge.envs.registry import build_env
from turnforge.errors import UserError


class Light(Env):
    """The smallest env: one step ends it."""

    def reset(self, task, seed):
        return str(task.data)

    def step(self, action):
        return StepResult("done", 1.0, True, False, success=True)


def rows(n=30, heldout_every=3):
    return [{"q": i, "split": "heldout" if i % heldout_every == 0 else "train"} for i in range(n)]


def test_dataset_splits_by_field_and_indexes_modulo_its_size():
    ds = TaskDataset(rows())
    assert ds.size("train") == 20 and ds.size("heldout") == 10
    t = ds.task("heldout", 13)  # 13 % 10: the fourth held-out row
    assert (t.split, t.index, t.data["q"]) == ("heldout", 3, 9)
    assert ds.key(t) == json.dumps({"q": 9})
    assert ds.task("train", 2**31 - 5).split == "train"


def test_dataset_errors_name_the_row_and_the_fix(tmp_path):
    with pytest.raises(UserError, match="task 1 has no 'split'"):
        TaskDataset([{"q": 0, "split": "train"}, {"q": 1}])
    with pytest.raises(UserError, match="task 0 has split 'test'; valid splits"):
        TaskDataset([{"q": 0, "split": "test"}])
    with pytest.raises(UserError, match="task 1 appears in both splits"):
        TaskDataset([{"q": 0, "split": "train"}, {"q": 0, "split": "heldout"}])
    with pytest.raises(UserError, match="task 0 is a list"):
        TaskDataset([[1, 2]])
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"q": 1, "split": "train"}\n\n{"q": 2, "split"\n')
    with pytest.raises(UserError, match=r"t.jsonl', line 3: not JSON"):
        TaskDataset.from_jsonl(bad)
    with pytest.raises(UserError, match="does not exist"):
        TaskDataset.from_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(UserError, match="has no heldout tasks"):
        TaskDataset([{"q": 0, "split": "train"}]).task("heldout", 0)


def test_rows_without_a_split_are_split_by_content():
    ds = TaskDataset([{"q": i} for i in range(400)], heldout_fraction=0.25)
    assert 70 < ds.size("heldout") < 130 and ds.size("train") + ds.size("heldout") == 400
    again = TaskDataset([{"q": i} for i in reversed(range(400))], heldout_fraction=0.25)  # order does not matter
    assert {r["q"] for r in again.rows["heldout"]} == {r["q"] for r in ds.rows["heldout"]}


def test_generator_is_deterministic_and_disjoint():
    gen = TaskGenerator(lambda rng: {"a": rng.randint(0, 10**6)}, heldout_fraction=0.2)
    assert gen.size("train") is None
    a, b = gen.task("train", 5), TaskGenerator(lambda rng: {"a": rng.randint(0, 10**6)}).task("train", 5)
    assert a.data == b.data and a.index == 5
    keys = {s: {gen.key(gen.task(s, i)) for i in range(200)} for s in ("train", "heldout")}
    assert not keys["train"] & keys["heldout"] and len(keys["heldout"]) > 150


def test_env_task_fills_the_env_id_and_a_missing_source_names_the_fix():
    register("test-light-tasks", Light, overwrite=True)
    env = make("test-light-tasks")
    with pytest.raises(UserError, match=r"env 'test-light-tasks' has no tasks: set env.tasks=PATH.jsonl"):
        env.task("train", 0)
    env.tasks = TaskDataset(rows())
    t = env.task("train", 1)
    assert t.task_id == "test-light-tasks:train:1" and t.data["q"] == 2


def test_build_env_reads_the_recipes_task_file(tmp_path):
    register("test-light-tasks", Light, overwrite=True)
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    env = build_env("test-light-tasks", {}, str(path))
    assert env.task_source().size("heldout") == 10
    with pytest.raises(UserError, match="generates its own levels"):
        build_env("sokoban", {}, str(path))


def test_capabilities_are_discovered():
    light = capabilities(Light())
    assert light.names() == ()
    sokoban = capabilities(make("sokoban"))
    assert set(sokoban.names()) == {"snapshot", "anchor_key", "potential", "expert", "random_action", "reseed", "guidance", "derive"}
    frozen = capabilities(make("frozenlake"))
    assert frozen.potential and frozen.expert and not capabilities(make("2048")).potential
    with pytest.raises(UserError, match=r"GiGPO needs env 'x' to implement anchor_key\(\), or use grpo"):
        light.require("anchor_key", "x", "GiGPO", "use grpo")

    class Named(Light):
        action_names = ("a", "b")

        def random_action(self, rng: random.Random) -> str:
            return rng.choice(self.action_names)

    assert capabilities(Named()).random_action
