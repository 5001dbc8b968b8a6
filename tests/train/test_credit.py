"""Trajectories -> per-turn advantages -> per-token advantages on samples."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from turnforge.algos.estimators import ESTIMATORS, GAESettings, gae_turn_advantages, turn_rewards
from turnforge.config import RLConfig, RolloutConfig
from turnforge.envs import make_batch
from helpers import inline_engine
from turnforge.rollout.actors import ExpertActor
from turnforge.rollout.engine import EpisodeRequest
from turnforge.train.common import collate
from turnforge.train.credit import drop_void, monte_carlo_returns, sample_advantage
from turnforge.types import Task, Trajectory, Turn


def turn_advantages(trajs, rl):
    return ESTIMATORS[rl.advantage].turn_advantages(trajs, rl)


def _traj(tid, group, rewards, anchors):
    turns = tuple(Turn("obs", "a", r, False, k) for r, k in zip(rewards, anchors))
    return Trajectory(tid, Task("test-echo", "train", 0), group, 0, turns, (), float(sum(rewards)), False, True, False, None, 0)


def test_gigpo_turn_advantages_from_anchor_keys():
    # the GiGPO golden case of tests/algos/test_estimators.py, with string anchor keys
    trajs = [_traj("A", "g0", [0, 1], ["s", "t"]), _traj("B", "g0", [0, 0, 0], ["s", "u", "t"]), _traj("C", "g1", [2], ["s"])]
    adv = turn_advantages(trajs, RLConfig(advantage="gigpo", gamma=0.5, std_normalize=False))
    np.testing.assert_allclose(adv["A"], [0.75, 1.0], atol=1e-6)
    np.testing.assert_allclose(adv["B"], [-0.75, -0.5, -1.0], atol=1e-6)
    np.testing.assert_allclose(adv["C"], [0.0])


@pytest.mark.parametrize("method, expected", [("grpo", [0.5, -0.5, 0.0]), ("rloo", [1.0, -1.0, 0.0])])
def test_episode_estimators_repeat_on_every_turn(method, expected):
    trajs = [_traj("A", "g0", [0, 1], "st"), _traj("B", "g0", [0, 0, 0], "sut"), _traj("C", "g1", [2], "s")]
    adv = turn_advantages(trajs, RLConfig(advantage=method, std_normalize=False))
    for (tid, n), a in zip([("A", 2), ("B", 3), ("C", 1)], expected):
        np.testing.assert_allclose(adv[tid], [a] * n, atol=1e-6)


def test_success_estimators_score_the_success_flag_not_the_return():
    # group g0: 4 episodes, one success (its return is the lowest: the flag decides, not the return);
    # pass@2 as in tests/algos: success 1, failures -1/3; w_reinforce: +lambda / -1
    trajs = [_traj(t, "g0", [r], "s") for t, r in zip("ABCD", [0, 5, 5, 5])]
    trajs = [replace(t, success=t.trajectory_id == "A") for t in trajs]
    adv = turn_advantages(trajs, RLConfig(advantage="pass_at_k", pass_at_k={"k": 2}, group_size=4))
    np.testing.assert_allclose([adv[t][0] for t in "ABCD"], [1.0, -1 / 3, -1 / 3, -1 / 3], atol=1e-6)
    adv = turn_advantages(trajs, RLConfig(advantage="w_reinforce", w_reinforce={"success_weight": 0.25}))
    np.testing.assert_allclose([adv[t][0] for t in "ABCD"], [0.25, -1.0, -1.0, -1.0])


@pytest.mark.parametrize("context", ["window", "full_history"])
def test_sample_advantages_put_each_turn_on_its_action_tokens(tiny_policy, context):
    cfg = RolloutConfig(context=context, max_turns=4, max_new_tokens=4, max_context_tokens=512)
    envs = make_batch("test-echo", 1, episode_len=3, max_obs_words=5)
    (traj,), _ = inline_engine(tiny_policy, envs, cfg).play([EpisodeRequest(envs[0].task("train", 0), 0, "g", "t")], ExpertActor())
    per_turn = np.array([1.0, -2.0, 3.0], np.float32)
    advs = [sample_advantage(s, per_turn) for s in traj.samples]
    batch = collate(traj.samples, tiny_policy.pad_id, advs)
    # every action token carries its own turn's advantage, every other token 0
    expected = []
    for s in traj.samples:
        turn = np.cumsum(np.diff(np.concatenate([[0], s.loss_mask])) == 1) - 1
        k = turn if s.turn_index < 0 else np.full(len(s), s.turn_index)
        expected.append(np.where(s.loss_mask == 1, per_turn[np.clip(k, 0, None)], 0.0))
    got = [batch.advantages[i, :len(s)].numpy() for i, s in enumerate(traj.samples)]
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e)
    assert sorted({float(x) for g in got for x in g} - {0.0}) == [-2.0, 1.0, 3.0]


def test_sample_advantage_rejects_turn_count_mismatch(tiny_policy):
    cfg = RolloutConfig(context="full_history", max_turns=4, max_new_tokens=4, max_context_tokens=512)
    envs = make_batch("test-echo", 1, episode_len=3, max_obs_words=5)
    (traj,), _ = inline_engine(tiny_policy, envs, cfg).play([EpisodeRequest(envs[0].task("train", 0), 0, "g", "t")], ExpertActor())
    with pytest.raises(ValueError, match="action runs up to turn 2 but 2 turns"):
        sample_advantage(traj.samples[0], np.zeros(2, np.float32))


def _shaped(tid, group, rewards, potentials, next_potentials):
    turns = tuple(
        Turn("obs", "a", r, False, f"s{k}", potential=p, next_potential=q)
        for k, (r, p, q) in enumerate(zip(rewards, potentials, next_potentials))
    )
    return Trajectory(tid, Task("test-echo", "train", 0), group, 0, turns, (), float(sum(rewards)), False, True, False, None, 0)


def test_potential_shaping_of_turn_rewards():
    t = _shaped("A", "g", [0.0, 1.0], [-3.0, -2.0], [-2.0, 0.0])
    rl = RLConfig(shaping="potential", gamma=0.5)
    # r + gamma * Phi(s') - Phi(s): 0 + 0.5 * -2 + 3 = 2; 1 + 0 + 2 = 3
    np.testing.assert_allclose(turn_rewards(t, rl, 0.5), [2.0, 3.0])
    # episode-level estimators shape with gamma 1: the sum telescopes to R + Phi(s_T) - Phi(s_0) = 1 + 0 + 3
    assert turn_rewards(t, rl, 1.0).sum() == pytest.approx(4.0)
    np.testing.assert_allclose(turn_rewards(t, RLConfig(gamma=0.5), 0.5), [0.0, 1.0])  # shaping off
    np.testing.assert_allclose(turn_rewards(t, RLConfig(shaping="potential", shaping_coef=0.5), 1.0), [0.5, 2.0])


def test_gae_over_turns_hand_computed():
    trajs = [_traj("A", "g0", [0.0, 1.0], "st"), _traj("B", "g0", [2.0], "s")]
    values = {"A": np.array([0.2, 0.4]), "B": np.array([1.0])}
    rl = RLConfig(advantage="gae", gamma=0.5)
    gae = GAESettings(lam_policy=0.5, lam_critic=1.0, whiten=False)
    adv, ret = gae_turn_advantages(trajs, values, rl, gae)
    # A: delta_1 = 1 - 0.4 = 0.6; delta_0 = 0 + 0.5 * 0.4 - 0.2 = 0; A_0 = 0 + 0.5 * 0.5 * 0.6 = 0.15
    np.testing.assert_allclose(adv["A"], [0.15, 0.6], atol=1e-6)
    np.testing.assert_allclose(adv["B"], [1.0], atol=1e-6)
    # critic targets with lambda 1: the discounted returns 0 + 0.5 * 1 and 1
    np.testing.assert_allclose(ret["A"], [0.5, 1.0], atol=1e-6)
    np.testing.assert_allclose(ret["B"], [2.0], atol=1e-6)
    np.testing.assert_allclose(monte_carlo_returns(trajs, rl)["A"], [0.5, 1.0])
    white, _ = gae_turn_advantages(trajs, values, rl, gae.model_copy(update={"whiten": True}))
    flat = np.concatenate([white["A"], white["B"]])
    assert flat.mean() == pytest.approx(0.0, abs=1e-6) and flat.std(ddof=1) == pytest.approx(1.0, abs=1e-5)
    # length-adaptive: lambda = 1 - 1 / (alpha * turns) = 1 - 1 / (1 * 2) = 0.5 for A, 0 for B
    la = gae.model_copy(update={"length_adaptive": True, "alpha": 1.0, "lam_policy": 0.0})
    adv_la, _ = gae_turn_advantages(trajs, values, rl, la)
    np.testing.assert_allclose(adv_la["A"], [0.15, 0.6], atol=1e-6)


def test_kl_reward_penalty_is_summed_per_turn_and_subtracted(tiny_policy):
    import copy

    import torch

    from turnforge.algos import kl_estimate
    from turnforge.policy.generate import token_logprobs
    from turnforge.rollout.actors import PolicyActor
    from turnforge.train.credit import kl_penalties

    cfg = RolloutConfig(context="full_history", max_turns=3, max_new_tokens=3, max_context_tokens=512)
    envs = make_batch("test-echo", 2, episode_len=3, max_obs_words=5)
    actor = PolicyActor(tiny_policy, 3, 1.0, torch.Generator().manual_seed(0))
    requests = [EpisodeRequest(envs[0].task("train", i), i, "g", f"t{i}") for i in range(2)]
    trajs, _ = inline_engine(tiny_policy, envs, cfg).play(requests, actor)
    reference = copy.deepcopy(tiny_policy.model)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    pen = kl_penalties(reference, trajs, tiny_policy.pad_id, 1.0, "k1", coef=0.5)
    for t in trajs:
        (x,) = t.samples
        ids = torch.as_tensor(x.token_ids)[None]
        with torch.no_grad():
            ref, _ = token_logprobs(reference, ids, torch.ones_like(ids))
        k1 = kl_estimate(torch.as_tensor(x.logprobs)[None], ref, "k1")[0].numpy()
        runs = np.cumsum(np.diff(np.concatenate([[0], x.loss_mask])) == 1) - 1
        expected = [0.5 * k1[(x.loss_mask == 1) & (runs == k)].sum() for k in range(t.num_turns)]
        np.testing.assert_allclose(pen[t.trajectory_id], expected, rtol=1e-4, atol=1e-6)
        assert np.all(pen[t.trajectory_id] != 0)
        rewards = np.array([turn.reward for turn in t.turns])
        np.testing.assert_allclose(turn_rewards(t, RLConfig(), 1.0, pen), rewards - pen[t.trajectory_id])


def test_malformed_void_leaves_out_episodes_with_an_invalid_turn():
    clean = _traj("A", "g0", [1.0], "s")
    slipped = replace(_traj("B", "g0", [0.0, 1.0], "st"),
                      turns=(Turn("obs", "?", -0.1, True, "s"), Turn("obs", "a", 1.0, False, "t")))
    assert slipped.num_invalid == 1
    assert drop_void([clean, slipped], RLConfig(malformed="void")) == ([clean], 1)
    assert drop_void([clean, slipped], RLConfig()) == ([clean, slipped], 0)  # penalty: trained with the env's penalty
