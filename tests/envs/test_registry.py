"""Every built-in env passes check_env; make() errors; third-party envs via entry points."""

from __future__ import annotations

import sys
import textwrap

import pytest

from turnforge.envs import check_env, list_envs, make, registry
from turnforge.errors import UserError

# mcp-tools needs its server and task file (tests/envs/test_mcp_tools.py checks it); mix and miniwob (a browser) are
# tested in test_mix.py and test_miniwob.py
BUILTIN = [name for name, spec in list_envs().items() if str(spec.factory).startswith("turnforge.envs.") and name not in ("mcp-tools", "mix", "miniwob")]
GRID_GAMES = [name for name in BUILTIN if make(name).action_names]  # the games with Up/Down/Left/Right moves
MOVES_ONLY = [name for name in GRID_GAMES if make(name).action_names == ("Up", "Down", "Left", "Right")]


def test_builtins_are_registered():
    assert {"sokoban", "frozenlake", "frozenlake-slippery", "2048"} <= set(BUILTIN)


#: check_env's options per env: sokoban-slow's simulated latency (20 ms median a step) only
#: stretches the check; 1 ms keeps its code path
CHECK_KWARGS = {"sokoban-slow": {"median_ms": 1.0}}


@pytest.mark.parametrize("env_id", BUILTIN)
def test_check_env(env_id):
    check_env(env_id, env_kwargs=CHECK_KWARGS.get(env_id))


@pytest.mark.parametrize("env_id", [name for name in BUILTIN if hasattr(make(name), "level_key")])  # gui-click: test_gui_click.py
def test_splits_are_disjoint_by_content(env_id):
    env = make(env_id)
    keys = {s: {env.level_key(env.level_for(env.task(s, i))) for i in range(100)} for s in ("train", "heldout")}
    assert not keys["train"] & keys["heldout"]
    assert len(keys["heldout"]) > 10  # the held-out split is not one repeated level


def test_tool_envs_are_registered():
    assert {"calculator", "python-tasks"} <= set(BUILTIN) - set(GRID_GAMES)


@pytest.mark.parametrize("env_id", GRID_GAMES)
def test_invalid_action_observation(env_id):
    env = make(env_id, invalid_action_penalty=-0.5)
    obs = env.reset(seed=1)
    r = env.step("I think I will go north-east")
    assert r.invalid_action and r.reward == -0.5 and not r.terminated
    assert r.observation.startswith("Invalid action: could not parse 'I think I will go north-east' as an action.")
    assert "Up, Down, Left, Right" in r.observation and r.observation.endswith(obs)


@pytest.mark.parametrize("env_id", GRID_GAMES)
def test_instructions_are_short(env_id):
    text, actions = make(env_id).instructions, make(env_id).action_names
    assert "Answer with one of Up, Down, Left, Right" in text and len(text) < 300
    if env_id in MOVES_ONLY:
        assert "Answer with one of Up, Down, Left, Right." in text
    else:  # keydoor: the moves, and colours at a lock
        assert all(a in text for a in actions)


def test_unknown_env_lists_valid_ids():
    with pytest.raises(UserError, match="unknown env 'nope'.*'2048'.*'frozenlake'.*'sokoban'"):
        make("nope")


def test_unknown_option_names_it_and_the_valid_ones():
    with pytest.raises(UserError) as err:
        make("sokoban", bogus=1)
    assert "'bogus'" in str(err.value) and "'num_boxes'" in str(err.value) and "'dim'" in str(err.value)


def test_registered_defaults_can_be_overridden():
    assert make("frozenlake-slippery").is_slippery and not make("frozenlake").is_slippery
    env = make("frozenlake-slippery", size=6)
    assert env.is_slippery and env.reset(seed=0).count("\n") == 5 and env.env_id == "frozenlake-slippery"


FAKE_MODULE = '''
"""A third-party env: walk right along a corridor of length 2..6."""
import random
from turnforge.envs import LevelEnv, Outcome, parse_choice

class CorridorEnv(LevelEnv):
    def __init__(self, *, invalid_action_penalty=-0.1, max_steps=20):
        super().__init__(invalid_action_penalty=invalid_action_penalty, max_steps=max_steps)
    instructions = "Walk to the end of the corridor. Answer with Left or Right."
    valid_actions_text = "Left, Right"
    def generate_level(self, level_seed):
        return random.Random(level_seed).randint(2, 6) * 1000 + level_seed % 1000
    def level_key(self, level):
        return str(level)
    def initial_state(self, level, rng):
        return {"length": level // 1000, "pos": 0}
    def render(self):
        return "".join("@" if i == self.state["pos"] else "_" for i in range(self.state["length"] + 1))
    def parse_action(self, text):
        return parse_choice(text, ("Left", "Right"))
    def apply(self, action):
        self.state["pos"] = max(0, self.state["pos"] + (1 if action else -1))
        won = self.state["pos"] == self.state["length"]
        return Outcome(1.0 if won else 0.0, terminated=won, success=won)
    def expert_action(self):
        return "Right"
'''


def test_third_party_env_via_entry_point(tmp_path, monkeypatch):
    dist = tmp_path / "fakepkg-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[turnforge.envs]\ncorridor-v0 = fakepkg_envs:CorridorEnv\n")
    (tmp_path / "fakepkg_envs.py").write_text(textwrap.dedent(FAKE_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    monkeypatch.delitem(sys.modules, "fakepkg_envs", raising=False)

    spec = list_envs()["corridor-v0"]
    assert spec.source.startswith("entry point")
    env = make("corridor-v0", max_steps=30)
    assert type(env).__name__ == "CorridorEnv" and env.env_id == "corridor-v0" and env.max_steps == 30
    check_env(env)
    check_env("corridor-v0", env_kwargs={"max_steps": 30})
    with pytest.raises(UserError, match="'bogus'.*'max_steps'"):
        make("corridor-v0", bogus=1)


def test_a_plugin_that_does_not_import_names_the_env_and_entry_point(tmp_path, monkeypatch):
    dist = tmp_path / "brokenpkg-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenpkg\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[turnforge.envs]\nbroken-v0 = brokenpkg_missing.envs:Broken\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    with pytest.raises(UserError) as err:
        make("broken-v0")
    msg = str(err.value)
    assert "env 'broken-v0'" in msg and "brokenpkg_missing.envs:Broken" in msg and "ModuleNotFoundError" in msg
    assert "\n" not in msg
