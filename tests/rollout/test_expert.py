"""The demonstrator: exact expert, and the imperfect (noisy) one BC can be given."""

from __future__ import annotations

import random

import pytest

from turnforge.config import RolloutConfig
from turnforge.envs import make_batch
from turnforge.errors import UserError
from turnforge.rollout.runner import EpisodeRequest, ExpertActor, rollout

CFG = RolloutConfig(max_turns=12, max_new_tokens=4, max_context_tokens=256, include_instructions=False)


def _play(policy, actor, n=8, env_id="sokoban"):
    envs = make_batch(env_id, n)
    reqs = [EpisodeRequest(envs[0].task("train", i), i, f"g{i}", f"t{i}") for i in range(n)]
    trajs, _ = rollout(actor, envs, reqs, CFG, policy)
    return trajs


def test_noise_zero_is_the_expert_and_solves(tiny_policy):
    trajs = _play(tiny_policy, ExpertActor(tiny_policy))
    assert all(t.success for t in trajs)


def test_noisy_demonstrator_plays_random_named_actions_at_the_set_rate(tiny_policy):
    actor = ExpertActor(tiny_policy, noise=0.5, rng=random.Random(3))
    trajs = _play(tiny_policy, actor, n=16)
    turns = [turn for t in trajs for turn in t.turns]
    assert all(turn.action_text in ("Up", "Down", "Left", "Right") for turn in turns)
    assert 0.3 < actor.random_actions / len(turns) < 0.7
    assert sum(t.success for t in trajs) < len(trajs)  # noise costs episodes
    again = ExpertActor(tiny_policy, noise=0.5, rng=random.Random(3))
    assert [turn.action_text for t in _play(tiny_policy, again, n=16) for turn in t.turns] == [turn.action_text for turn in turns]


def test_noisy_demonstrator_needs_a_discrete_action_set(tiny_policy):
    with pytest.raises(UserError, match="action_names.*bc.expert_noise=0"):
        _play(tiny_policy, ExpertActor(tiny_policy, noise=1.0), n=1, env_id="test-echo")
    with pytest.raises(ValueError, match="noise must be in"):
        ExpertActor(tiny_policy, noise=1.5)
