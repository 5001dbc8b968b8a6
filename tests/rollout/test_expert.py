"""The demonstrator: exact expert, and the imperfect (noisy) one BC can be given."""

from __future__ import annotations

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
    actor = ExpertActor(tiny_policy, noise=0.5, seed=3)
    trajs = _play(tiny_policy, actor, n=16)
    turns = [turn for t in trajs for turn in t.turns]
    assert all(turn.action_text in ("Up", "Down", "Left", "Right") for turn in turns)
    assert 0.3 < actor.random_actions / len(turns) < 0.7
    assert sum(t.success for t in trajs) < len(trajs)  # noise costs episodes
    again = ExpertActor(tiny_policy, noise=0.5, seed=3)
    assert [turn.action_text for t in _play(tiny_policy, again, n=16) for turn in t.turns] == [turn.action_text for turn in turns]


def test_noisy_demonstrations_do_not_depend_on_batching(tiny_policy):
    """The same demonstrations whether 12 episodes play at once or 5 at a time."""
    envs = make_batch("sokoban", 12)
    reqs = [EpisodeRequest(envs[0].task("train", i), i, f"g{i}", f"t{i}") for i in range(12)]
    together, _ = rollout(ExpertActor(tiny_policy, noise=0.5, seed=7), envs, reqs, CFG, tiny_policy)
    chunked = []
    for b in range(0, 12, 5):
        chunked += rollout(ExpertActor(tiny_policy, noise=0.5, seed=7), envs[:5], reqs[b:b + 5], CFG, tiny_policy)[0]
    actions = lambda trajs: [[turn.action_text for turn in t.turns] for t in trajs]  # noqa: E731
    assert actions(together) == actions(chunked)
    other, _ = rollout(ExpertActor(tiny_policy, noise=0.5, seed=8), envs, reqs, CFG, tiny_policy)
    assert actions(other) != actions(together)


def test_noisy_demonstrator_needs_a_discrete_action_set(tiny_policy):
    with pytest.raises(UserError, match="action_names.*bc.expert_noise=0"):
        _play(tiny_policy, ExpertActor(tiny_policy, noise=1.0), n=1, env_id="test-echo")
    with pytest.raises(ValueError, match="noise must be in"):
        ExpertActor(tiny_policy, noise=1.5)
