"""Token-exactness: the ids the trainer sees are the ids sampled; re-scored logprobs match."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import inline_engine
from turnforge.config import RolloutConfig
from turnforge.policy.generate import pad_right, token_logprobs
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest
from turnforge.types import Sample, TokenAlignmentError


def _play(policy, cfg, n=4, episode_len=3, max_obs_words=40, seed=0, crash_on=None):
    engine = inline_engine(policy, "test-echo", cfg, n, episode_len=episode_len, max_obs_words=max_obs_words, crash_on=crash_on)
    reqs = [EpisodeRequest(engine.env.task("train", i + seed * 100), i, f"g{i // 2}", f"t{i}") for i in range(n)]
    actor = PolicyActor(policy, cfg.max_new_tokens, 1.0, torch.Generator().manual_seed(seed))
    return engine.play(reqs, actor)


def _rescore(policy, samples):
    ids, attn = pad_right([s.token_ids for s in samples], policy.pad_id)
    with torch.no_grad():
        lp, _ = token_logprobs(policy.model, ids, attn)
    return lp


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    context=st.sampled_from(["window", "full_history"]),
    window=st.integers(0, 2),
    episode_len=st.integers(1, 4),
    max_obs_words=st.integers(1, 30),
    max_new_tokens=st.integers(1, 6),
    seed=st.integers(0, 1000),
)
def test_rescored_logprobs_match_sampling(any_policy, context, window, episode_len, max_obs_words, max_new_tokens, seed):
    cfg = RolloutConfig(context=context, history_window=window, max_turns=5, max_new_tokens=max_new_tokens,
                        max_context_tokens=2048)
    trajs, stats = _play(any_policy, cfg, episode_len=episode_len, max_obs_words=max_obs_words, seed=seed)
    samples = [s for t in trajs for s in t.samples]
    assert samples
    lp = _rescore(any_policy, samples)
    for i, s in enumerate(samples):
        assert len(s.token_ids) == len(s.loss_mask) == len(s.logprobs) == len(s.versions)
        sampled = s.versions >= 0
        assert sampled.sum() == s.loss_mask.sum() > 0  # every action token was sampled by the policy
        got = lp[i, : len(s)][torch.from_numpy(sampled)].numpy()
        np.testing.assert_allclose(got, s.logprobs[sampled], atol=2e-4)
    per_episode = {t.trajectory_id: t for t in trajs}
    for t in per_episode.values():
        if context == "window":
            assert len(t.samples) == t.num_turns
        else:
            assert len(t.samples) == 1
    assert stats.generated_tokens == sum(int(s.loss_mask.sum()) for s in samples)


def test_full_history_is_concatenation_of_generated_and_context_pieces(any_policy):
    cfg = RolloutConfig(context="full_history", max_turns=3, max_new_tokens=5, max_context_tokens=2048)
    trajs, _ = _play(any_policy, cfg, n=2, episode_len=3)
    chat = any_policy.chat
    tok = any_policy.tokenizer
    for t in trajs:
        (s,) = t.samples
        ids = s.token_ids.tolist()
        head, tail = chat.start("Say anything.")  # the env's instructions are the system prompt
        assert ids[: len(head)] == list(head)
        # the generated runs (mask 1) decode to the recorded actions, in order
        runs, cur = [], []
        for tid, m in zip(ids, s.loss_mask.tolist()):
            if m:
                cur.append(tid)
            elif cur:
                runs.append(cur)
                cur = []
        if cur:
            runs.append(cur)
        assert [tok.decode(r, skip_special_tokens=True) for r in runs] == [turn.action_text for turn in t.turns]
        # one end-of-message per message: a sampled stop token is not closed a second time
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        assert ids.count(im_end) == 2 * t.num_turns + 1  # system + every user message + every assistant turn
        # the first observation's content follows the head verbatim
        first = list(chat.encode(t.turns[0].observation))
        assert ids[len(head): len(head) + len(first)] == first


def test_misaligned_sample_raises_at_once():
    ok = dict(
        token_ids=np.array([1, 2, 3]), loss_mask=np.array([0, 1, 1], np.int8),
        logprobs=np.array([np.nan, -1.0, -2.0], np.float32), versions=np.array([-1, 0, 0], np.int32),
        trajectory_id="t", turn_index=0,
    )
    Sample(**ok)
    with pytest.raises(TokenAlignmentError, match="differ in shape"):
        Sample(**{**ok, "logprobs": np.array([np.nan, -1.0], np.float32)})
    with pytest.raises(TokenAlignmentError, match="context token"):
        Sample(**{**ok, "versions": np.array([0, 0, 0], np.int32)})
    with pytest.raises(TokenAlignmentError, match="no finite sampling logprob"):
        Sample(**{**ok, "logprobs": np.array([np.nan, np.nan, -2.0], np.float32)})
