"""Prefix (KV) cache reuse across turns and identical prompts: the same actions as a full
prefill, logprobs equal up to float rounding, and fewer tokens prefilled."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from helpers import inline_engine
from turnforge.config import RolloutConfig
from turnforge.policy.generate import PrefixCache, common_prefix, pad_right, sample, token_logprobs
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest


def _play(policy, cfg, temperature, n=6, seed=0):
    engine = inline_engine(policy, "test-echo", cfg, n, episode_len=4, max_obs_words=12)
    reqs = [EpisodeRequest(engine.env.task("train", i), i, f"g{i // 3}", f"t{i}") for i in range(n)]
    actor = PolicyActor(policy, cfg.max_new_tokens, temperature, torch.Generator().manual_seed(seed))
    trajs, _ = engine.play(reqs, actor)
    return trajs, actor


@pytest.mark.parametrize("context", ["full_history", "window"])
def test_greedy_episodes_are_the_same_with_and_without_the_cache(any_policy, context):
    cfg = RolloutConfig(context=context, history_window=1, max_turns=4, max_new_tokens=5, max_context_tokens=2048)
    plain, _ = _play(any_policy, cfg, 0.0)
    cached, actor = _play(dataclasses.replace(any_policy, prefix_cache=True), cfg, 0.0)
    assert actor.cache is not None and actor.cache.reused_tokens > 0
    for a, b in zip(plain, cached):
        assert [t.action_text for t in a.turns] == [t.action_text for t in b.turns]
        for sa, sb in zip(a.samples, b.samples):
            assert np.array_equal(sa.token_ids, sb.token_ids) and np.array_equal(sa.loss_mask, sb.loss_mask)
            m = sa.loss_mask.astype(bool)
            np.testing.assert_allclose(sa.logprobs[m], sb.logprobs[m], atol=1e-4)
    if context == "full_history":  # every later turn prefills only the closing text and the new observation
        assert actor.cache.reused_tokens > actor.cache.prefilled_tokens


def test_sampled_tokens_with_the_cache_rescore_to_their_logprobs(any_policy):
    cfg = RolloutConfig(context="full_history", max_turns=4, max_new_tokens=5, max_context_tokens=2048)
    trajs, _ = _play(dataclasses.replace(any_policy, prefix_cache=True), cfg, 1.0, seed=3)
    samples = [s for t in trajs for s in t.samples]
    ids, attn = pad_right([s.token_ids for s in samples], any_policy.pad_id)
    with torch.no_grad():
        lp, _ = token_logprobs(any_policy.model, ids, attn)
    for i, s in enumerate(samples):
        m = s.loss_mask.astype(bool)
        np.testing.assert_allclose(lp[i, : len(s)].numpy()[m], s.logprobs[m], atol=2e-4)


def test_identical_prompts_are_prefilled_once_and_sampled_independently(tiny_policy):
    prompt = list(tiny_policy.chat.start("Say anything.")[0]) + [5, 6, 7, 8]
    cache = PrefixCache()
    gens = cache.sample(tiny_policy.model, [f"t{i}" for i in range(8)], [prompt] * 8, 0, max_new_tokens=6,
                        stop_ids=tiny_policy.stop_ids, pad_id=tiny_policy.pad_id, temperature=1.0,
                        generator=torch.Generator().manual_seed(0))
    assert cache.prefilled_tokens == len(prompt) and cache.reused_tokens == 7 * len(prompt)
    assert len({g.ids for g in gens}) > 1  # one prefill, eight independent draws
    # the same draws as eight separate prefills (logprobs up to rounding)
    plain = sample(tiny_policy.model, [prompt] * 8, max_new_tokens=6, stop_ids=tiny_policy.stop_ids,
                   pad_id=tiny_policy.pad_id, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert [g.ids for g in gens] == [g.ids for g in plain]
    np.testing.assert_allclose(np.concatenate([g.logprobs for g in gens]), np.concatenate([g.logprobs for g in plain]), atol=1e-4)


def test_a_weight_update_makes_the_cache_stale(tiny_policy):
    prompt = [5, 6, 7, 8, 9, 10]
    cache = PrefixCache()
    kw = dict(max_new_tokens=3, stop_ids=tiny_policy.stop_ids, pad_id=tiny_policy.pad_id, temperature=0.0)
    cache.sample(tiny_policy.model, ["a"], [prompt], 0, **kw)
    longer = prompt + list(cache.entries["a"].ids[len(prompt):]) + [11, 12]
    before = cache.prefilled_tokens
    cache.sample(tiny_policy.model, ["a"], [longer], 0, **kw)
    assert cache.prefilled_tokens - before < len(longer)  # same version: the old prefix is reused
    before = cache.prefilled_tokens
    cache.sample(tiny_policy.model, ["a"], [longer + [13]], 1, **kw)
    assert cache.prefilled_tokens - before == len(longer) + 1  # new version: all prefilled again


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix([], [1]) == 0
