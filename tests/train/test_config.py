"""Bad input gets one clear line naming the bad key/value and the valid choices."""

from __future__ import annotations

import pytest

from turnforge.app.config import list_recipes, load_config, parse_overrides
from turnforge.errors import UserError


def test_default_recipe_loads_and_overrides_apply():
    cfg = load_config("sokoban-tiny", ["rl.iterations=3", "env.kwargs.num_boxes=2", "rollout.context=full_history"])
    assert cfg.recipe == "sokoban-tiny" and cfg.rl.iterations == 3
    assert cfg.env.kwargs == {"dim": 6, "num_boxes": 2, "invalid_action_penalty": -1.0}
    assert cfg.rollout.context == "full_history"
    # another env id drops the recipe env kwargs (they belonged to the old env)
    assert load_config("sokoban-tiny", ["env.id=frozenlake"]).env.kwargs == {}
    assert "sokoban-tiny" in list_recipes()


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["rl.itertions=3"], r"unknown config key 'rl.itertions'; valid keys here: .*'iterations'"),
        (["nope=1"], r"unknown config key 'nope'; valid keys here: .*'rollout'"),
        (["rl.iterations=many"], r"bad value for 'rl.iterations' \('many'\)"),
        (["rollout.context=everything"], r"bad value for 'rollout.context' \('everything'\): unknown name 'everything'; valid: window, full_history, summarize, fold"),
        (["rollout.max_new_tokens=600", "rollout.max_context_tokens=512"], r"max_new_tokens \(600\) must be below"),
        (["rl.iterations"], r"not key=value"),
        # incompatible options: one line naming both
        (["rl.advantage=gae"], r"rl.advantage=gae needs state values: set critic.enabled=true .* or critic.mc_weight=1"),
        (["critic.enabled=true"], r"critic.enabled=true is only used by rl.advantage=gae \(got rl.advantage=grpo\)"),
        (["critic.mc_weight=0.5"], r"critic.mc_weight=0.5 is only used by rl.advantage=gae"),
        (["rl.advantage=gae", "critic.mc_weight=0.5"], r"critic.mc_weight=0.5 blends with a learned critic but critic.enabled=false"),
        (["rl.advantage=gae", "critic.mc_weight=1", "critic.pretrain_episodes=8"], r"critic.pretrain_episodes > 0 .* critic.enabled=false"),
        (["rl.advantage=mc_grpo", "rollout.context=full_history"], r"rl.advantage=mc_grpo .* rollout.context=window"),
        (["rl.advantage=mc_grpo", "rl.kl_mode=reward"], r"rl.kl_mode=reward penalises episode turns"),
        (["rl.advantage=mc_grpo", "rl.shaping=potential"], r"rl.shaping=potential does not apply to rl.advantage=mc_grpo"),
        (["rl.advantage=ppo"], r"bad value for 'rl.advantage' \('ppo'\): unknown name 'ppo'; valid: grpo, rloo, reinforce_pp, gigpo, gae, mc_grpo, pass_at_k, w_reinforce, psr"),
        # flywheel.weighting=mc_awr: the round's own per-turn samples, in the rft stage
        (["flywheel.rounds=1", "flywheel.weighting=mc_awr", "flywheel.mechanisms=[curriculum]"],
         r"flywheel.weighting=mc_awr trains on the round's own episodes; flywheel.mechanisms=\['curriculum'\] .* set flywheel.mechanisms=\[\]"),
        (["flywheel.rounds=1", "flywheel.weighting=mc_awr", "flywheel.mechanisms=[]", "flywheel.stages=[rl]"],
         r"flywheel.weighting=mc_awr weighs the samples of the rft stage: add rft to flywheel.stages"),
        (["flywheel.rounds=1", "flywheel.weighting=mc_awr", "flywheel.mechanisms=[]", "rollout.context=full_history"],
         r"flywheel.weighting=mc_awr weighs each turn's sample and needs rollout.context=window"),
        (["flywheel.weighting=awr"], r"bad value for 'flywheel.weighting': .*'success', 'mc_awr' or 'group_awr'"),
        (["flywheel.awr_beta=0"], r"bad value for 'flywheel.awr_beta' \(0\)"),
        (["flywheel.rounds=1", "flywheel.weighting=group_awr", "flywheel.mechanisms=[]", "flywheel.group_size=1"],
         r"flywheel.weighting=group_awr compares the turns of a task's group taken in one state: set flywheel.group_size >= 2"),
        # asynchronous engine: invalid eta / batch / cluster combinations name both options
        (["engine.eta=3"], r"engine.eta=3 needs engine.mode=async"),
        (["engine.mode=async", "engine.partial_rollouts=true"], r"partial_rollouts=true needs engine.eta >= 1"),
        (["engine.env_slots=4"], r"engine.env_slots=4 cannot hold one group of rl.group_size=8"),
        (["engine.ray_address=auto"], r"engine.ray_address=auto is only used with cluster=ray"),
        (["engine.eta=-1"], r"engine.eta"),
    ],
)
def test_bad_overrides(overrides, pattern):
    with pytest.raises(UserError, match=pattern):
        load_config("sokoban-tiny", overrides)


@pytest.mark.parametrize(
    "overrides",
    [  # combinations that were refused while two rollout implementations existed; one engine plays them all
        ["rl.advantage=mc_grpo", "critic.mc_policy=bc"],
        ["engine.mode=async", "rl.advantage=gae", "critic.enabled=true"],
        ["engine.mode=async", "rl.advantage=mc_grpo"],
        ["engine.mode=async", "rl.kl_coef=0.1", "rl.kl_mode=reward"],
        ["cluster=ray"],
        ["rl.advantage=gae", "critic.mc_weight=1", "engine.env_workers=2"],
    ],
)
def test_combinations_one_engine_allows(overrides):
    load_config("sokoban-tiny", overrides)


def test_unknown_recipe_lists_choices():
    with pytest.raises(UserError, match=r"unknown recipe 'sokobann'; valid recipes: .*'sokoban-tiny'"):
        load_config("sokobann")


def test_malformed_yaml_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rl:\n  iterations: [1, 2\n")
    with pytest.raises(UserError, match=r"malformed YAML in .*bad.yaml.* at line"):
        load_config(str(bad))
    missing = tmp_path / "missing.yaml"
    with pytest.raises(UserError, match="does not exist"):
        load_config(str(missing))


def test_override_values_are_yaml_typed():
    assert parse_overrides(["a.b=3", "a.c=0.5", "d=true", "e=[1, 2]", "f=text"]) == {
        "a": {"b": 3, "c": 0.5}, "d": True, "e": [1, 2], "f": "text"
    }


def test_the_smollm2_flywheel_recipe_is_the_arithmetic_recipe_plus_the_measured_overrides():
    """smollm2-arithmetic-flywheel's figure (docs/log.md) was measured with these overrides of
    smollm2-arithmetic: the recipe file must hold the same run."""
    overrides = [
        "eval.temperature=0.1", "eval.bc_temperatures=[0.0,0.1]", "eval.episodes=100", "eval.pass_at_k_samples=4",
        "eval.pass_at_k_tasks=16", "eval.pass_at_k_temperature=0.3", "flywheel.rounds=2", "flywheel.temperature=0.3",
        "flywheel.env_steps_per_round=150", "flywheel.tasks_per_wave=24", "flywheel.group_size=4",
        "flywheel.allocation=uniform", "flywheel.mechanisms=[]", "flywheel.per_task_cap=2", "flywheel.rft_lr=1e-4",
        "flywheel.rft_epochs=2", "flywheel.rft_batch_size=8", "flywheel.eval_episodes=50", "flywheel.entropy_samples=64",
        "rl.iterations=0",
    ]
    measured = load_config("smollm2-arithmetic", overrides).model_dump()
    recipe = load_config("smollm2-arithmetic-flywheel", []).model_dump()
    measured.pop("recipe", None), recipe.pop("recipe", None)
    assert measured == recipe
