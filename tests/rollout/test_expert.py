"""The demonstrator: exact expert, and the imperfect (noisy) one BC can be given."""

from __future__ import annotations

import pytest

from helpers import inline_engine
from turnforge.config import RolloutConfig
from turnforge.errors import UserError
from turnforge.rollout.actors import ExpertActor
from turnforge.rollout.engine import EpisodeRequest

CFG = RolloutConfig(max_turns=12, max_new_tokens=4, max_context_tokens=256, include_instructions=False)
MOVES = ("Up", "Down", "Left", "Right")


def _play(policy, actor, n=8, env_id="sokoban", envs=None):
    engine = inline_engine(policy, env_id, CFG, envs or n)
    reqs = [EpisodeRequest(engine.env.task("train", i), i, f"g{i}", f"t{i}") for i in range(n)]
    trajs, _ = engine.play(reqs, actor)
    return trajs


def test_noise_zero_is_the_expert_and_solves(tiny_policy):
    trajs = _play(tiny_policy, ExpertActor())
    assert all(t.success for t in trajs)


def test_noisy_demonstrator_plays_random_named_actions_at_the_set_rate(tiny_policy):
    actor = ExpertActor(noise=0.5, seed=3, action_names=MOVES)
    trajs = _play(tiny_policy, actor, n=16)
    turns = [turn for t in trajs for turn in t.turns]
    assert all(turn.action_text in MOVES for turn in turns)
    assert 0.3 < actor.random_actions / len(turns) < 0.7
    assert sum(t.success for t in trajs) < len(trajs)  # noise costs episodes
    again = ExpertActor(noise=0.5, seed=3, action_names=MOVES)
    assert [turn.action_text for t in _play(tiny_policy, again, n=16) for turn in t.turns] == [turn.action_text for turn in turns]


def test_noisy_demonstrations_do_not_depend_on_batching(tiny_policy):
    """The same demonstrations whether 12 episodes play at once or 5 at a time."""
    together = _play(tiny_policy, ExpertActor(noise=0.5, seed=7, action_names=MOVES), n=12)
    chunked = _play(tiny_policy, ExpertActor(noise=0.5, seed=7, action_names=MOVES), n=12, envs=5)
    actions = lambda trajs: [[turn.action_text for turn in t.turns] for t in trajs]  # noqa: E731
    assert actions(together) == actions(chunked)
    other = _play(tiny_policy, ExpertActor(noise=0.5, seed=8, action_names=MOVES), n=12)
    assert actions(other) != actions(together)


def test_noisy_demonstrator_on_open_text_actions_uses_the_envs_random_action(tiny_policy):
    """code-repair has no action names; its random_action(rng) is drawn inside the env host."""
    actor = ExpertActor(noise=1.0, seed=0)
    engine = inline_engine(tiny_policy, "code-repair", RolloutConfig(context="full_history", max_turns=3,
                                                                      max_new_tokens=64, max_context_tokens=4096), 2)
    trajs, _ = engine.play([EpisodeRequest(engine.env.task("train", i), i, "g", f"t{i}") for i in range(2)], actor)
    assert actor.random_actions == sum(t.num_turns for t in trajs) > 0
    assert all(t.infra_failure is None for t in trajs)


def test_noisy_demonstrator_needs_random_actions(tiny_policy):
    with pytest.raises(UserError, match="needs env 'test-echo' to implement action_names or random_action"):
        _play(tiny_policy, ExpertActor(noise=1.0), n=1, env_id="test-echo")
    with pytest.raises(ValueError, match="noise must be in"):
        ExpertActor(noise=1.5)
