"""``rollout.context=summarize``: segments as samples, token-exact, summaries trained where
written and copied as context where re-used, the summary limit and overlong masking."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_rescores, inline_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnforge.config import RolloutConfig, TrainConfig
from turnforge.rollout.actors import ExpertActor, PolicyActor
from turnforge.rollout.engine import EpisodeRequest
from turnforge.train.credit import action_turns, overlong_episodes, sample_advantage
from turnforge.types import Sample


def _play(policy, cfg, n=4, episode_len=8, max_obs_words=12, seed=0, actor=None):
    engine = inline_engine(policy, "test-echo", cfg, n, episode_len=episode_len, max_obs_words=max_obs_words)
    reqs = [EpisodeRequest(engine.env.task("train", i + seed * 100), i, f"g{i // 2}", f"t{i}") for i in range(n)]
    actor = actor or PolicyActor(policy, cfg.max_new_tokens, 1.0, torch.Generator().manual_seed(seed))
    return engine.play(reqs, actor)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    threshold=st.integers(60, 200),
    max_new_tokens=st.integers(1, 5),
    summary_max_tokens=st.integers(1, 12),
    episode_len=st.integers(2, 9),
    max_obs_words=st.integers(1, 20),
    seed=st.integers(0, 1000),
)
def test_every_segment_rescores_to_its_sampling_logprobs(any_policy, threshold, max_new_tokens, summary_max_tokens,
                                                         episode_len, max_obs_words, seed):
    cfg = RolloutConfig(context="summarize", max_turns=10, max_new_tokens=max_new_tokens, max_context_tokens=512,
                        summary_threshold=threshold, summary_max_tokens=summary_max_tokens, max_summaries=20)
    trajs, stats = _play(any_policy, cfg, episode_len=episode_len, max_obs_words=max_obs_words, seed=seed)
    samples = [s for t in trajs for s in t.samples]
    assert all((s.versions >= 0).sum() == s.loss_mask.sum() > 0 for s in samples)
    assert_rescores(any_policy, samples)
    for t in trajs:
        assert [x.segment_index for x in t.samples] == list(range(len(t.samples)))
        assert [x.parent_segment for x in t.samples] == list(range(-1, len(t.samples) - 1))
        assert all(x.summary_tokens > 0 for x in t.samples[:-1])
        # runs of action tokens: one per turn, plus the summary at the end of every segment but the last
        runs = sum(len(_runs(x.loss_mask)) for x in t.samples)
        assert runs == t.num_turns + sum(x.summary_tokens > 0 for x in t.samples)
        assert all(len(x) <= cfg.max_context_tokens for x in t.samples)
    assert stats.summaries == sum(x.summary_tokens > 0 for s in trajs for x in s.samples)
    assert stats.generated_tokens + stats.summary_tokens == sum(int(s.loss_mask.sum()) for s in samples)


def test_summary_is_trained_where_written_and_context_where_reused(tiny_policy):
    cfg = RolloutConfig(context="summarize", max_turns=8, max_new_tokens=3, max_context_tokens=512,
                        summary_threshold=90, summary_max_tokens=6)
    trajs, stats = _play(tiny_policy, cfg, n=2, episode_len=8, max_obs_words=10)
    assert stats.summaries > 0
    chat = tiny_policy.chat
    special = set(tiny_policy.tokenizer.all_special_ids)
    for t in trajs:
        turn = 0
        for prev, seg in zip(t.samples, t.samples[1:]):
            summary = prev.token_ids[len(prev) - prev.summary_tokens:]
            assert prev.loss_mask[len(prev) - prev.summary_tokens:].all()  # trained in the segment that wrote it
            body = [i for i in summary.tolist()]
            while body and body[-1] in special:
                body.pop()
            # the next segment: system, the first observation, the summary's ids copied as context, the held observation
            head, _ = chat.start("Say anything.")
            first = list(chat.encode(t.turns[0].observation))
            sep = list(chat.encode("\n\n") + chat.encode("Your summary so far:\n"))
            ids = seg.token_ids.tolist()
            at = len(head) + len(first) + len(sep)
            assert ids[: len(head)] == list(head)
            assert ids[len(head): len(head) + len(first)] == first
            assert ids[at: at + len(body)] == body
            assert not seg.loss_mask[: at + len(body)].any()  # context where re-used
            assert np.isnan(seg.logprobs[: at + len(body)]).all()
            turn += len(_runs(prev.loss_mask)) - 1
            assert seg.first_turn == turn  # the turn the segment's first action is


def test_summary_loss_mask_stores_summaries_as_context(tiny_policy):
    cfg = RolloutConfig(context="summarize", max_turns=8, max_new_tokens=3, max_context_tokens=512,
                        summary_threshold=90, summary_max_tokens=6, summary_loss="mask")
    trajs, stats = _play(tiny_policy, cfg, n=2, episode_len=8, max_obs_words=10)
    assert stats.summaries > 0
    for t in trajs:
        assert sum(len(_runs(x.loss_mask)) for x in t.samples) == t.num_turns  # the actions only
        for x in t.samples:
            if x.summary_tokens:
                tail = slice(len(x) - x.summary_tokens, len(x))
                assert not x.loss_mask[tail].any() and (x.versions[tail] == -1).all()


def test_summary_limit_ends_the_episode_and_overlong_episodes_get_no_gradient(tiny_policy):
    cfg = RolloutConfig(context="summarize", max_turns=20, max_new_tokens=3, max_context_tokens=512,
                        summary_threshold=70, summary_max_tokens=4, max_summaries=1)
    trajs, stats = _play(tiny_policy, cfg, n=2, episode_len=20, max_obs_words=12)
    assert all(t.truncation_reason == "summary_limit" for t in trajs)
    assert stats.summary_limits == 2 and all(len(t.samples) == 2 for t in trajs)
    train = TrainConfig(rollout=cfg)
    assert overlong_episodes(trajs, train) == {t.trajectory_id for t in trajs}
    off = TrainConfig(rollout=cfg.model_copy(update={"overlong_mask": False}))
    assert overlong_episodes(trajs, off) == set()


def test_expert_writes_the_envs_summary(tiny_policy):
    cfg = RolloutConfig(context="summarize", max_turns=300, max_new_tokens=4, max_context_tokens=512,
                        summary_threshold=300, summary_max_tokens=12, max_summaries=100)
    engine = inline_engine(tiny_policy, "keydoor", cfg, 1, min_length=40, max_length=60)
    (t,), stats = engine.play([EpisodeRequest(engine.env.task("train", 0), 0, "g", "t")], ExpertActor())
    assert t.success and stats.summaries >= 1
    tok = tiny_policy.tokenizer
    for x in t.samples[:-1]:
        text = tok.decode(x.token_ids[len(x) - x.summary_tokens:], skip_special_tokens=True)
        assert text in ("Key: none yet.", f"Key: {engine.env.level_for(t.task).key_colour}.")
        assert (x.versions == -1).all() and x.loss_mask[len(x) - x.summary_tokens:].all()  # written, trained on


def _sample(mask, first_turn=0, summary_tokens=0):
    mask = np.asarray(mask, np.int8)
    n = len(mask)
    return Sample(np.arange(n), mask, np.full(n, np.nan, np.float32), np.full(n, -1, np.int32), "t", -1,
                  first_turn=first_turn, summary_tokens=summary_tokens)


def test_segment_advantages_by_hand():
    per_turn = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    # segment 0: turns 0 and 1, then a summary (turn 2's state); segment 1: turns 2 and 3
    first = _sample([0, 1, 0, 1, 0, 1, 1], summary_tokens=2)
    second = _sample([0, 0, 1, 0, 1], first_turn=2)
    assert action_turns(first).tolist() == [-1, 0, -1, 1, -1, 2, 2]
    np.testing.assert_array_equal(sample_advantage(first, per_turn), [0, 1, 0, 2, 0, 3, 3])
    np.testing.assert_array_equal(sample_advantage(second, per_turn), [0, 0, 3, 0, 4])
    # a summary whose turn never came (the episode ended at the restart): the last turn's value
    np.testing.assert_array_equal(sample_advantage(_sample([1, 0, 1], first_turn=3, summary_tokens=1), per_turn),
                                  [4, 0, 4])
    with pytest.raises(ValueError, match="action runs up to turn"):
        sample_advantage(_sample([1, 0, 1], first_turn=1), per_turn)  # a last segment that stops short


def test_segments_rescore_with_the_prefix_cache_on(tiny_policy):
    """A restarted segment is no extension of the cached prompt: the cache must prefill it afresh."""
    tiny_policy.prefix_cache = True
    try:
        cfg = RolloutConfig(context="summarize", max_turns=8, max_new_tokens=3, max_context_tokens=512,
                            summary_threshold=90, summary_max_tokens=6)
        trajs, stats = _play(tiny_policy, cfg, n=3, episode_len=8, max_obs_words=10, seed=3)
    finally:
        tiny_policy.prefix_cache = False
    assert stats.summaries > 0
    assert_rescores(tiny_policy, [s for t in trajs for s in t.samples])


def test_without_the_first_observation_a_segment_restarts_from_the_summary(tiny_policy):
    cfg = RolloutConfig(context="summarize", max_turns=8, max_new_tokens=3, max_context_tokens=512,
                        summary_threshold=90, summary_max_tokens=6, summary_keep_first=False)
    trajs, stats = _play(tiny_policy, cfg, n=2, episode_len=8, max_obs_words=10)
    assert stats.summaries > 0
    head, _ = tiny_policy.chat.start("Say anything.")
    sep = list(tiny_policy.chat.encode("Your summary so far:\n"))
    for t in trajs:
        for seg in t.samples[1:]:
            assert seg.token_ids[len(head): len(head) + len(sep)].tolist() == sep
