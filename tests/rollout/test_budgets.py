"""Explicit budgets: truncation with a visible marker, counted; overflow ends the episode."""

from __future__ import annotations

import pytest
import torch

from helpers import inline_engine
from turnforge.config import RolloutConfig
from turnforge.envpool.host import NO_PROBE
from turnforge.rollout.actors import ExpertActor, PolicyActor
from turnforge.rollout.engine import EpisodeRequest


def _run(policy, cfg, actor=None, n=2, **env_kwargs):
    engine = inline_engine(policy, "test-echo", cfg, n, **env_kwargs)
    reqs = [EpisodeRequest(engine.env.task("train", i), i, "g", f"t{i}") for i in range(n)]
    actor = actor or PolicyActor(policy, cfg.max_new_tokens, 1.0, torch.Generator().manual_seed(0))
    return engine.play(reqs, actor)


def test_long_observation_is_cut_by_tokens_with_marker_and_counted(any_policy):
    cfg = RolloutConfig(context="window", max_turns=2, max_new_tokens=4, max_context_tokens=40)
    trajs, stats = _run(any_policy, cfg, actor=ExpertActor(), max_obs_words=200)
    marker = list(any_policy.chat.encode(cfg.truncation_marker))
    cut_turns = [turn for t in trajs for turn in t.turns if turn.obs_truncated_tokens > 0]
    assert cut_turns and stats.obs_truncations == len(cut_turns)
    for t in trajs:
        for s, turn in zip(t.samples, t.turns):
            prompt = s.token_ids[s.loss_mask == 0].tolist()
            assert len(prompt) + cfg.max_new_tokens <= cfg.max_context_tokens
            if turn.obs_truncated_tokens:
                text = any_policy.tokenizer.decode(prompt)
                assert "[truncated]" in text
                # the marker ids sit right before the template's user tail
                tail = list(any_policy.chat.start("Say anything.")[1])
                assert prompt[-len(tail) - len(marker): -len(tail)] == marker


def test_full_history_overflow_ends_episode_as_context_budget(any_policy):
    cfg = RolloutConfig(context="full_history", max_turns=10, max_new_tokens=4, max_context_tokens=60)
    trajs, stats = _run(any_policy, cfg, actor=ExpertActor(), episode_len=10, max_obs_words=15)
    assert stats.context_overflows >= 1
    ended = [t for t in trajs if t.truncation_reason == "context_budget"]
    assert len(ended) == stats.context_overflows
    for t in trajs:
        (s,) = t.samples
        assert len(s) <= cfg.max_context_tokens


def test_window_drops_oldest_history_first_and_counts_it(any_policy):
    cfg = RolloutConfig(context="window", history_window=3, max_turns=4, max_new_tokens=4, max_context_tokens=70)
    trajs, stats = _run(any_policy, cfg, actor=ExpertActor(), episode_len=4, max_obs_words=12)
    assert stats.history_dropped > 0


def test_max_turns_truncates_and_env_crash_is_infra_failure(tiny_policy):
    cfg = RolloutConfig(max_turns=2, max_new_tokens=3, max_context_tokens=512)
    trajs, stats = _run(tiny_policy, cfg, actor=ExpertActor(), n=5, episode_len=5, crash_on=2)
    crashed = [t for t in trajs if t.infra_failure]
    assert [t.task.index for t in crashed] == [0, 4] and stats.infra_failures == 2
    assert "simulated env crash" in crashed[0].infra_failure
    others = [t for t in trajs if not t.infra_failure]
    assert all(t.truncation_reason == "max_turns" and t.num_turns == 2 for t in others)


def test_invalid_actions_are_observations_not_errors(any_policy):
    class SaysBad:
        version = 0
        needs_tokens = True

        def probe(self, task, trajectory_id, turn):
            return NO_PROBE

        def act(self, inputs):
            from turnforge.policy.generate import Generation

            ids = any_policy.chat.encode("bad") + (any_policy.stop_ids[0],)
            return [Generation(ids, tuple([-1.0] * len(ids)), True) for _ in inputs]

    cfg = RolloutConfig(max_turns=3, max_new_tokens=4, max_context_tokens=512)
    trajs, _ = _run(any_policy, cfg, actor=SaysBad())
    for t in trajs:
        assert t.num_invalid == 3 and not t.success
        assert abs(t.episode_return - 3 * -0.1) < 1e-9
        assert t.turns[1].observation.startswith("Invalid action")


def test_example_turns_need_an_expert_and_come_from_train_task_0():
    from turnforge.envs import make
    from turnforge.errors import UserError
    from turnforge.rollout.context import PromptSpec

    env = make("frozenlake", size=4)
    spec = PromptSpec.of(env, True, 2)
    first = make("frozenlake", size=4).reset(env.task("train", 0), 0)
    assert len(spec.examples) == 2 and spec.examples[0][0] == first and spec.examples[0][1] in ("Up", "Down", "Left", "Right")
    assert spec.system == env.instructions

    class NoExpert:
        env_id = "x"

    with pytest.raises(UserError, match="needs env 'x' to implement expert_action"):
        PromptSpec.of(NoExpert(), True, 1)
