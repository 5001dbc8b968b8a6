"""The learned critic: value positions, construction, prediction, clipped updates, pretraining."""

from __future__ import annotations

import numpy as np
import torch

from turnforge.config import RolloutConfig
from turnforge.critic.value import (
    build_value_model,
    predict,
    pretrain_critic,
    sample_targets,
    turn_values,
    update_critic,
    value_positions,
)
from turnforge.envs import make_batch
from helpers import inline_engine
from turnforge.rollout.actors import ExpertActor
from turnforge.rollout.engine import EpisodeRequest


def _episodes(policy, context, n=4, turns=3):
    cfg = RolloutConfig(context=context, max_turns=turns, max_new_tokens=4, max_context_tokens=512)
    envs = make_batch("test-echo", n, episode_len=turns, max_obs_words=6)
    requests = [EpisodeRequest(envs[0].task("train", i), i, f"g{i}", f"t{i}") for i in range(n)]
    trajs, _ = inline_engine(policy, envs, cfg).play(requests, ExpertActor())
    return trajs


def test_value_positions_are_the_tokens_before_each_action(tiny_policy):
    for context in ("window", "full_history"):
        (traj,) = _episodes(tiny_policy, context, n=1)
        positions = [value_positions(x) for x in traj.samples]
        assert sum(len(p) for p in positions) == traj.num_turns
        for x, pos in zip(traj.samples, positions):
            assert (x.loss_mask[pos] == 0).all() and (x.loss_mask[pos + 1] == 1).all()


def test_policy_init_copies_the_trunk_and_starts_at_zero(tiny_policy):
    critic = build_value_model(tiny_policy.model, "policy", seed=0)
    for (name, p), (_, q) in zip(critic.trunk.named_parameters(), tiny_policy.model.base_model.named_parameters()):
        assert torch.equal(p, q), name
    p.data.add_(1.0)  # a copy, not shared
    assert not torch.equal(p, q)
    fresh = build_value_model(tiny_policy.model, "random", seed=0)
    again = build_value_model(tiny_policy.model, "random", seed=0)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), again.parameters()))
    trajs = _episodes(tiny_policy, "window")
    values = turn_values(critic, trajs, tiny_policy.pad_id)
    assert {k: v.shape for k, v in values.items()} == {t.trajectory_id: (t.num_turns,) for t in trajs}
    assert all(np.all(v == 0) for v in values.values())  # zero-initialised head


def test_window_and_full_history_values_agree_on_the_first_turn(tiny_policy):
    critic = build_value_model(tiny_policy.model, "random", seed=1)
    torch.nn.init.normal_(critic.head.weight)
    (w,) = _episodes(tiny_policy, "window", n=1)
    (f,) = _episodes(tiny_policy, "full_history", n=1)
    # the first turn's prompt is the same token prefix in both context modes
    assert np.allclose(turn_values(critic, [w], tiny_policy.pad_id)["t0"][0], turn_values(critic, [f], tiny_policy.pad_id)["t0"][0], atol=1e-5)


def test_clipped_updates_move_values_towards_targets(tiny_policy):
    torch.manual_seed(0)
    critic = build_value_model(tiny_policy.model, "policy", seed=0)
    trajs = _episodes(tiny_policy, "window", n=6)
    targets = {t.trajectory_id: np.full(t.num_turns, 2.0, np.float32) for t in trajs}
    old = {t.trajectory_id: np.zeros(t.num_turns, np.float32) for t in trajs}
    data = [(x, tgt, o) for (x, tgt), (_, o) in zip(sample_targets(trajs, targets), sample_targets(trajs, old))]
    opt = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    kwargs = dict(epochs=20, minibatch_size=8, max_grad_norm=1.0, order_rng=np.random.default_rng(0))
    update_critic(critic, opt, data, tiny_policy.pad_id, clip=0.5, **kwargs)
    v = np.concatenate(predict(critic, [x for x, _, _ in data], tiny_policy.pad_id))
    # the clip bounds how far the loss pulls past old + 0.5; unclipped fits reach the target
    assert np.all(v > 0.3)
    critic2 = build_value_model(tiny_policy.model, "policy", seed=0)
    opt2 = torch.optim.AdamW(critic2.parameters(), lr=1e-2)
    update_critic(critic2, opt2, data, tiny_policy.pad_id, clip=None, **kwargs)
    v2 = np.concatenate(predict(critic2, [x for x, _, _ in data], tiny_policy.pad_id))
    assert np.abs(v2 - 2.0).max() < 0.3


def test_pretraining_stops_at_the_explained_variance_target(tiny_policy):
    torch.manual_seed(0)
    critic = build_value_model(tiny_policy.model, "policy", seed=0)
    trajs = _episodes(tiny_policy, "window", n=30)
    # a learnable target: whether the turn's observation holds the word "box"
    data = sample_targets(
        trajs, {t.trajectory_id: np.array([2.0 * ("box" in turn.observation.split()) for turn in t.turns], np.float32) for t in trajs}
    )
    opt = torch.optim.AdamW(critic.parameters(), lr=3e-3)
    stats = pretrain_critic(critic, opt, data, tiny_policy.pad_id, max_steps=400, target_ev=0.5, minibatch_size=8, max_grad_norm=1.0, seed=0)
    assert stats["explained_variance"] >= 0.5 and stats["steps"] < 400
    capped = pretrain_critic(
        build_value_model(tiny_policy.model, "policy", seed=0), torch.optim.AdamW(critic.parameters(), lr=1e-6), data,
        tiny_policy.pad_id, max_steps=3, target_ev=0.99, minibatch_size=8, max_grad_norm=1.0, seed=0,
    )
    assert capped["steps"] == 3
