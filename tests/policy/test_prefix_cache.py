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


# ---------------------------------------------------------------------- the memory budget
def _budget_run(policy, budget_gib, temperature, monkeypatch):
    """Six full-history episodes with the prefix cache under ``budget_gib``: their sampled ids,
    trajectories, the cache, and the KV bytes it held after each generation call."""
    held = []
    real = PrefixCache.sample

    def sample(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        held.append(self.held_bytes())
        return out

    monkeypatch.setattr(PrefixCache, "sample", sample)
    cfg = RolloutConfig(context="full_history", max_turns=4, max_new_tokens=5, max_context_tokens=2048)
    trajs, actor = _play(dataclasses.replace(policy, prefix_cache=True, kv_cache_gib=budget_gib), cfg, temperature, seed=7)
    return [[tuple(s.token_ids) for s in t.samples] for t in trajs], trajs, actor.cache, held


def test_a_budget_that_forces_evictions_and_chunks_samples_the_same_tokens(tiny_policy, monkeypatch):
    temperature = 1.0  # sampled, so that chunks must replay the whole batch's draws
    ids, trajs, free, free_held = _budget_run(tiny_policy, None, temperature, monkeypatch)
    assert free.evictions == 0 and free.chunks == len(free_held)  # one chunk per call
    # a third of what the free run held at most: some rows kept, calls split in chunks
    third = max(free_held) / 3
    mid_ids, mid_trajs, mid, mid_held = _budget_run(tiny_policy, third / 2**30, temperature, monkeypatch)
    # one byte: every entry evicted, every call sampled one row at a time
    one_ids, one_trajs, one, one_held = _budget_run(tiny_policy, 2**-30, temperature, monkeypatch)
    assert mid.evictions > 0 and mid.chunks > len(mid_held) and max(mid_held) <= third and mid.reused_tokens > 0
    assert one.evictions > 0 and one.chunks == sum(t.num_turns for t in trajs) and max(one_held) == 0
    assert one.prefilled_tokens > mid.prefilled_tokens > free.prefilled_tokens  # evicted episodes prefill again
    assert mid_ids == ids and one_ids == ids  # the same tokens: the same noise, drawn per chunk
    for other in (mid_trajs, one_trajs):
        for a, b in zip(trajs, other):
            for sa, sb in zip(a.samples, b.samples):
                m = sa.loss_mask.astype(bool)
                np.testing.assert_allclose(sa.logprobs[m], sb.logprobs[m], atol=1e-4)


def test_chunked_draws_are_those_of_multinomial_on_the_whole_batch():
    """What sampling in chunks relies on: torch.multinomial(p, 1) is argmax(p / Exp(1) noise),
    and a chunk of rows replays the whole batch's noise, leaving the generator where the whole
    batch leaves it."""
    from turnforge.policy.generate import _Noise

    probs = [torch.softmax(torch.randn(7, 50, generator=torch.Generator().manual_seed(t)) * 3, -1) for t in range(4)]
    whole_gen = torch.Generator().manual_seed(11)
    whole = [torch.multinomial(p, 1, generator=whole_gen).squeeze(-1) for p in probs]
    gen = torch.Generator().manual_seed(11)
    noise = _Noise(gen, 7)
    parts = [[(p[lo:hi] / noise.draw(t, lo, hi, 50)).argmax(-1) for t, p in enumerate(probs)] for lo, hi in [(3, 5), (0, 3), (5, 7)]]
    noise.finish(len(probs))
    for t in range(len(probs)):
        assert torch.equal(torch.cat([parts[1][t], parts[0][t], parts[2][t]]), whole[t])
    assert torch.equal(gen.get_state(), whole_gen.get_state())


def test_the_shared_prefix_is_held_once_and_counted(tiny_policy):
    """Prompts sharing a long prefix: every entry's KV starts with one shared base, prefilled
    once; held bytes are the base once plus each row's own part, at kv_bytes_per_token each."""
    from turnforge.policy.kvcache import kv_bytes_per_token

    system = list(range(5, 45))
    prompts = [system + [50 + i, 60 + i] for i in range(4)]
    cache = PrefixCache()
    cache.sample(tiny_policy.model, [f"t{i}" for i in range(4)], prompts, 0, max_new_tokens=3,
                 stop_ids=tiny_policy.stop_ids, pad_id=tiny_policy.pad_id, temperature=0.0)
    bases = {id(e.base) for e in cache.entries.values()}
    assert len(bases) == 1 and cache.base is not None and len(cache.base.ids) == len(system)
    assert cache.prefilled_tokens == len(system) + 4 * 2  # the prefix once, then each row's own tokens
    per_token = kv_bytes_per_token(tiny_policy.model)
    own = sum(len(e.ids) - len(system) for e in cache.entries.values())
    assert cache.held_bytes() == per_token * (len(system) + own)
