"""Code repair: seeds pass their tests, injected bugs are caught, splits are by function, the
oracle solves every task and a random agent almost none, tools refuse bad requests."""

from __future__ import annotations

import json
import random

import pytest

from turnforge.envs import make
from turnforge.envs.code.mutations import KINDS, count_sites, mutate, normalize
from turnforge.envs.code.repair import HELDOUT, _fix, catalogue
from turnforge.envs.code.seeds import RUNNER, SEEDS
from turnforge.sandbox import Sandbox


def call(name, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def env():
    return make("code-repair")


def test_every_seed_passes_its_tests_with_the_shipped_runner():
    files = {"run_tests.py": RUNNER}
    for seed in SEEDS:
        files[f"pkg/{seed.name}.py"] = normalize(seed.source)
        files[f"tests/test_{seed.name}.py"] = f"from {seed.name} import {seed.name}\n{seed.tests}"
    result = Sandbox().run(["python3", "run_tests.py"], files=files)
    assert result.exit_code == 0 and "FAIL" not in result.stdout and "ERROR" not in result.stdout
    assert result.stdout.strip().endswith(f"{3 * len(SEEDS)} passed, 0 failed")


def test_mutations_change_one_line_of_each_kind():
    source = normalize("def f(xs, k):\n    if k < 1:\n        return xs\n    return xs[k:] + [k + 1]\n")
    assert mutate(source, "off_by_one", 0) == source.replace("k < 1", "k < 2")
    assert mutate(source, "wrong_operator", 0) == source.replace("k < 1", "k <= 1")
    assert mutate(source, "inverted_condition", 0) == source.replace("if k < 1", "if not k < 1")
    # returns are visited breadth first: the function's last return, then the one inside the if
    assert mutate(source, "wrong_return", 0) == source.replace("return xs[k:] + [k + 1]", "return xs")
    assert mutate(source, "wrong_return", 2) == source.replace("return xs\n", "return k\n")
    assert count_sites(source, "off_by_one") == 4  # two int literals, +1 and -1 each
    with pytest.raises(ValueError, match="unknown bug kind 'typo'"):
        mutate(source, "typo", 0)


def test_catalogue_holds_only_caught_bugs_of_every_kind_and_seed(env):
    cat = catalogue(env.sandbox)
    assert {kind for _, kind, _ in cat} == set(KINDS) and {name for name, _, _ in cat} == {s.name for s in SEEDS}
    rng = random.Random(0)
    for name, kind, site in rng.sample(cat, 5):  # re-check a few with the real runner
        seed = next(s for s in SEEDS if s.name == name)
        files = {"run_tests.py": RUNNER, f"pkg/{name}.py": mutate(normalize(seed.source), kind, site),
                 f"tests/test_{name}.py": f"from {name} import {name}\n{seed.tests}"}
        result = env.sandbox.run(["python3", "run_tests.py"], files=files)
        assert "FAIL" in result.stdout and result.killed_reason is None


def test_splits_are_by_seed_function(env):
    train = {env.level_for(env.task("train", i)).seed for i in range(60)}
    heldout = {env.level_for(env.task("heldout", i)).seed for i in range(30)}
    assert heldout <= HELDOUT and not train & HELDOUT and len(heldout) >= 3


def _play(env, policy, episodes, split="train"):
    wins = 0
    for i in range(episodes):
        env.reset(seed=i, task=env.task(split, i))
        while not env.done:
            r = env.step(policy())
        wins += r.success
    return wins


def test_oracle_solves_every_task_and_random_almost_none(env):
    assert _play(env, env.expert_action, 25) == 25
    assert _play(env, env.expert_action, 10, "heldout") == 10
    rng = random.Random(0)
    assert _play(env, lambda: env.random_action(rng), 40) <= 2


def test_episode_tools_and_scoring(env):
    env.reset(seed=3)
    level = env.state["level"]
    path, test_path = f"pkg/{level.seed}.py", f"tests/test_{level.seed}.py"
    assert env.step(call("list_files")).observation == "\n".join(sorted([path, test_path, "run_tests.py"]))
    assert env.step(call("view_file", path=path)).observation == dict(level.files)[path]
    r = env.step(call("run_tests"))
    assert "FAIL" in r.observation and r.info["n_tool_errors"] == 0 and not r.invalid_action  # failing tests: a result
    r = env.step(call("edit_file", path=test_path, search="assert", replace="pass or"))
    assert r.observation == f"error: {test_path} is read-only; only files under pkg/ can be edited"
    r = env.step(call("edit_file", path=path, search="no such text", replace="x"))
    assert r.observation.startswith("error: search text found 0 times") and r.info["n_tool_errors"] == 1
    r = env.step(call("view_file", path="/etc/passwd"))
    assert r.observation.startswith("error: no file '/etc/passwd'")
    r = env.step(call("submit") + call("run_tests"))
    assert r.invalid_action and "call submit alone" in r.observation
    r = env.step(call("submit"))
    assert r.terminated and not r.success and r.reward == 0.0


def test_scoring_uses_pristine_tests_and_partial_credit(env):
    partial = make("code-repair", partial_credit=True)
    partial.reset(seed=3)
    level = partial.state["level"]
    # the agent's copies of the tests do not count: emptying them in its files changes nothing
    partial.state["files"][f"tests/test_{level.seed}.py"] = ""
    r = partial.step(call("submit"))
    assert not r.success and 0.0 <= r.reward < 1.0
    search, replace = _fix(dict(level.files)[f"pkg/{level.seed}.py"], level.fixed)
    assert dict(level.files)[f"pkg/{level.seed}.py"].replace(search, replace) == level.fixed
