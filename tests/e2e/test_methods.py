"""One tiny end-to-end run per credit-assignment family: critic-free (GiGPO with shaping),
PPO with a learned critic (decoupled, length-adaptive GAE, value pretraining), MC-critic
values blended with the critic, MC-GRPO; combinations that one rollout engine made possible
(Monte-Carlo rollouts on env worker processes, MC-GRPO with BC-policy tails, PPO with a critic
on asynchronous rollouts); plus exact resume with a critic."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_train_tiny import FAST

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.app.setup import load_run_config
from turnforge.train.metrics import read_metrics

pytestmark = pytest.mark.slow

METHODS = {
    "gigpo-shaped": ["rl.advantage=gigpo", "rl.shaping=potential", "rl.shaping_coef=0.5"],
    "grpo-kl-reward": ["rl.kl_coef=0.05", "rl.kl_mode=reward", "rl.kl_estimator=k1", "rl.lr_schedule=cosine", "bc.lr_schedule=cosine"],
    "ppo-vapo": [
        "rl.advantage=gae", "critic.enabled=true", "rl.gae.length_adaptive=true", "critic.pretrain_episodes=6",
        "critic.pretrain_max_steps=4", "critic.minibatch_size=8",
    ],
    "mc-blend": ["rl.advantage=gae", "critic.enabled=true", "critic.mc_weight=0.5", "critic.mc_rollouts=2"],
    "mc-critic-env-workers": ["rl.advantage=gae", "critic.mc_weight=1.0", "critic.mc_rollouts=2", "engine.env_workers=2"],
    "mc-critic-bc": ["rl.advantage=gae", "critic.mc_weight=1.0", "critic.mc_rollouts=2", "critic.mc_policy=bc"],
    # a BC start that plays some valid moves: MC-GRPO's state groups need Q values that differ
    "w-reinforce": ["rl.advantage=w_reinforce"],  # failures alone move the weights: a weak BC start still trains
    "mc-grpo": ["rl.advantage=mc_grpo", "rl.mc_grpo.states=4", "critic.mc_rollouts=2", "bc.num_demos=24", "bc.epochs=6", "bc.lr=0.003"],
    "mc-grpo-bc-tails": ["rl.advantage=mc_grpo", "rl.mc_grpo.states=4", "critic.mc_rollouts=2", "critic.mc_policy=bc",
                         "bc.num_demos=24", "bc.epochs=6", "bc.lr=0.003"],
    "async-ppo-critic": ["engine.mode=async", "engine.eta=1", "rl.advantage=gae", "critic.enabled=true"],
    "async-mc-grpo": ["engine.mode=async", "engine.eta=1", "rl.advantage=mc_grpo", "rl.mc_grpo.states=4",
                      "critic.mc_rollouts=2", "bc.num_demos=24", "bc.epochs=6", "bc.lr=0.003"],
}


@pytest.mark.parametrize("method", list(METHODS))
def test_method_trains_end_to_end(tmp_path, method):
    run = tmp_path / method
    summary = train(load_config("sokoban-tiny", FAST + METHODS[method]), run, live=False)
    assert summary.rl_iterations == 3 and summary.eval_after_rl.episodes == 6
    bc = load_file(str(run / "checkpoints" / "bc" / "model.safetensors"))
    final = load_file(str(run / "checkpoints" / "final" / "model.safetensors"))
    assert any(not torch.equal(bc[k], final[k]) for k in bc), "RL changed no weight"
    metrics = read_metrics(run)
    iters = metrics.iterations
    assert len(iters) == 3 and all(m.samples >= 0 for m in iters)
    if "critic.enabled=true" in METHODS[method]:
        assert all(m.critic.value_loss is not None and m.critic.explained_variance is not None for m in iters)
    if "critic.mc_weight" in " ".join(METHODS[method]) or method.startswith("mc-grpo"):
        assert all(m.mc.states > 0 for m in iters) and summary.mc_env_steps > 0
    if method == "mc-critic-env-workers":
        assert summary.env_pool is not None and summary.env_pool.steps > 0
    if method == "grpo-kl-reward":
        assert all(m.kl_penalty_per_turn is not None and m.update.kl_ref == 0 for m in iters)
        lr = load_config("sokoban-tiny", FAST).rl.lr  # cosine over 3 iterations: 1, 0.75, 0.25 of it
        assert [m.lr for m in iters] == pytest.approx([lr, 0.75 * lr, 0.25 * lr])
    if method == "ppo-vapo":
        pre = metrics.value_pretrain
        assert pre.steps <= 4 and pre.episodes == 6 and summary.value_pretrain == pre


def test_resume_with_a_critic_matches_an_uninterrupted_run(tmp_path):
    overrides = FAST + METHODS["mc-blend"]
    train(load_config("sokoban-tiny", overrides), tmp_path / "a", live=False)
    train(load_config("sokoban-tiny", overrides), tmp_path / "b", live=False, stop_after=2)
    train(load_run_config(tmp_path / "b"), tmp_path / "b", resume=True, live=False)
    a = load_file(str(tmp_path / "a" / "checkpoints" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "checkpoints" / "final" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_malformed_void_counts_the_episodes_it_leaves_out(tmp_path):
    """rl.malformed=void: episodes with an invalid action are left out of the update and counted;
    a batch of nothing but malformed episodes trains on nothing and the run goes on."""
    summary = train(load_config("sokoban-tiny", FAST + ["rl.malformed=void"]), tmp_path / "run", live=False)
    assert summary.rl_iterations == 3
    for m in read_metrics(tmp_path / "run").iterations:
        assert 0 <= m.void_episodes <= m.rollout.episodes - m.rollout.infra_failures
        if m.invalid_action_rate == 0:
            assert m.void_episodes == 0
        if m.void_episodes == m.rollout.episodes - m.rollout.infra_failures:
            assert m.samples == 0
    assert any(m.void_episodes > 0 for m in read_metrics(tmp_path / "run").iterations)  # the tiny BC start slips
