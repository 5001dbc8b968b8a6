"""The estimator registry: every ``rl.advantage`` is one object that declares what it needs;
the config, the start checks and the RL loop ask it (turnforge.algos.estimators)."""

from __future__ import annotations

import numpy as np
import pytest

from turnforge.algos.estimators import ESTIMATORS, Requirement
from turnforge.app.config import load_config
from turnforge.config import RLConfig
from turnforge.errors import UserError
from turnforge.types import Task, Trajectory, Turn


def turn_advantages(trajs, rl):
    return ESTIMATORS[rl.advantage].turn_advantages(trajs, rl)


def _episode(tid: str, reward: float, success: bool) -> Trajectory:
    return Trajectory(tid, Task("test-echo", "train", 0), "g0", 0, (Turn("obs", "a", reward, False, "s"),), (),
                      reward, success, True, False, None, 0)


def test_the_config_takes_exactly_the_registered_names():
    from turnforge.app.reference import config_keys

    (key,) = [k for k in config_keys() if k.key == "rl.advantage"]
    assert key.type == " or ".join(repr(n) for n in ESTIMATORS)
    assert all(f"{name} (" in key.description for name in ESTIMATORS)
    with pytest.raises(UserError, match="bad value for 'rl.advantage'.*psr"):
        load_config("sokoban-tiny", ["rl.advantage=reinforce_plus"])


def test_each_estimators_settings_are_its_own_section_of_rl():
    from turnforge.app.reference import config_keys

    owned = {n: e.Settings for n, e in ESTIMATORS.items() if e.Settings is not None}
    assert set(owned) == {"gigpo", "gae", "mc_grpo", "pass_at_k", "w_reinforce"}
    keys = {k.key for k in config_keys()}
    for name, settings in owned.items():
        assert RLConfig.model_fields[name].annotation is settings
        assert {f"rl.{name}.{field}" for field in settings.model_fields} <= keys
    cfg = load_config("sokoban-tiny", ["rl.advantage=gigpo", "rl.gigpo.omega=2", "flywheel.rounds=0"])
    assert ESTIMATORS["gigpo"].settings(cfg.rl).omega == 2.0
    with pytest.raises(UserError, match=r"unknown config key 'rl.gigpo.omga'; valid keys here: 'omega'"):
        load_config("sokoban-tiny", ["rl.gigpo.omga=2"])


def test_psr_reinforces_successes_only():
    # one group, one success with the lowest return: the flag decides; failures weigh 0
    trajs = [_episode(t, r, t == "A") for t, r in zip("ABC", [0.0, 5.0, 5.0])]
    adv = turn_advantages(trajs, RLConfig(advantage="psr"))
    np.testing.assert_array_equal([adv[t][0] for t in "ABC"], [1.0, 0.0, 0.0])


def test_psr_trains_end_to_end_config():
    cfg = load_config("sokoban-tiny", ["rl.advantage=psr", "flywheel.rounds=0"])
    assert cfg.rl.advantage == "psr"
    # what reads the env's success flag refuses a reward that shaping changes, naming the estimator
    with pytest.raises(UserError, match="rl.shaping=potential changes rewards; rl.advantage=psr"):
        load_config("sokoban-tiny", ["rl.advantage=psr", "rl.shaping=potential"])


@pytest.mark.parametrize("overrides, want", [
    (["rl.advantage=grpo"], []),
    (["rl.advantage=gigpo"], [Requirement("anchor_key", "GiGPO's step-level groups (rl.advantage=gigpo)")]),
    (["rl.advantage=gae", "critic.enabled=true"], []),
    (["rl.advantage=gae", "critic.mc_weight=1", "critic.mc_policy=bc"],
     [Requirement("snapshot", "Monte-Carlo values (critic.mc_weight=1.0)")]),
    (["rl.advantage=mc_grpo", "critic.mc_policy=random"], [
        Requirement("snapshot", "MC-GRPO (rl.advantage=mc_grpo)"),
        Requirement("random_action", "MC-GRPO (rl.advantage=mc_grpo) with random rollouts", "set critic.mc_policy=bc")]),
])
def test_each_estimator_declares_the_env_capabilities_it_needs(overrides, want):
    cfg = load_config("sokoban-tiny", [*overrides, "flywheel.rounds=0"])
    assert ESTIMATORS[cfg.rl.advantage].requirements(cfg) == want


def test_what_each_estimator_declares():
    baseline = [n for n, e in ESTIMATORS.items() if e.returns_baseline]
    assert baseline == ["grpo", "rloo", "reinforce_pp", "gigpo"]  # agent runs and the flywheel's rl stage take these
    assert [n for n, e in ESTIMATORS.items() if e.reads_values] == ["gae"]
    assert [n for n, e in ESTIMATORS.items() if not e.with_images] == ["mc_grpo"]
    gae = load_config("sokoban-tiny", ["rl.advantage=gae", "critic.mc_weight=1", "flywheel.rounds=0"])
    assert ESTIMATORS["gae"].monte_carlo(gae) and ESTIMATORS["mc_grpo"].monte_carlo(gae)
    assert not ESTIMATORS["grpo"].monte_carlo(gae)


def test_an_estimator_that_needs_more_than_rewards_says_so():
    with pytest.raises(NotImplementedError, match="rl.advantage=gae"):
        ESTIMATORS["gae"].turn_advantages([], RLConfig())
