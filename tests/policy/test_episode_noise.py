"""Per-row sampling noise (``row_seeds``, ``PolicyActor(episode_seed=...)``): a row's tokens
depend on its seed and the weights only, not on the rows sampled with it, their number, order
or lengths, nor on blocks, chunks, the prefill or the prefix cache."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import inline_engine

from turnforge.config import RolloutConfig
from turnforge.envpool.host import AfterState
from turnforge.policy.generate import PrefillCache, PrefixCache, sample
from turnforge.rollout.actors import ActorInput, PolicyActor
from turnforge.rollout.engine import EpisodeRequest
from turnforge.seeding import stable_hash
from turnforge.types import Task

STOPS = list(range(20, 60))  # many stop ids: rows stop early, at different steps


def _prompts(policy, n, seed, lo=2, hi=14):
    """``n`` prompts sharing the chat prefix, with random tails of different lengths."""
    head = list(policy.chat.start("Say anything.")[0])
    rng = np.random.default_rng(seed)
    return [tuple(head + [int(t) for t in rng.integers(60, 200, size=int(rng.integers(lo, hi)))]) for _ in range(n)]


def _plain(policy, prompts, seeds, **kw):
    kw = {"max_new_tokens": 12, "stop_ids": STOPS, "pad_id": policy.pad_id, "temperature": 1.0, **kw}
    return sample(policy.model, prompts, row_seeds=seeds, **kw)


def _cached(policy, prompts, seeds, budget=None, keys=None, **kw):
    kw = {"max_new_tokens": 12, "stop_ids": STOPS, "pad_id": policy.pad_id, "temperature": 1.0, **kw}
    cache = PrefixCache(budget)
    keys = [f"k{s}" for s in seeds] if keys is None else keys
    return cache.sample(policy.model, keys, prompts, policy.version, row_seeds=seeds, **kw), cache


def _same(ref, got):
    assert [g.ids for g in got] == [g.ids for g in ref]
    assert [g.stopped for g in got] == [g.stopped for g in ref]
    for a, b in zip(ref, got):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=1e-5)


def test_a_rows_tokens_do_not_depend_on_its_batch(tiny_policy):
    p = tiny_policy
    prompts, seeds = _prompts(p, 6, 0), [stable_hash("row", i) for i in range(6)]
    ref = _plain(p, prompts, seeds)
    assert len({len(g.ids) for g in ref}) > 1 and any(g.stopped for g in ref)  # rows stop at different steps
    _same(ref, [_plain(p, [x], [s])[0] for x, s in zip(prompts, seeds)])  # one at a time
    _same(ref, _plain(p, prompts[::-1], seeds[::-1])[::-1])  # reversed
    _same(ref, _plain(p, prompts, seeds, max_batch=4))  # blocks of rows
    _same(ref, _plain(p, prompts, seeds, prefills=PrefillCache(1 << 30, p.version)))
    # mixed with unrelated rows, longer and shorter ones, and a longer generation budget elsewhere
    others = _prompts(p, 5, 1, lo=1, hi=30)
    mixed = [x for pair in zip(others, prompts) for x in pair] + prompts[len(others):]
    mixed_seeds = [x for pair in zip(range(5), seeds) for x in pair] + seeds[len(others):]
    got = _plain(p, mixed, mixed_seeds)
    _same(ref, got[1:2 * len(others):2] + got[2 * len(others):])
    longer = _plain(p, prompts, seeds, max_new_tokens=20)
    assert [g.ids[:12] for g in longer] == [g.ids for g in ref]


def test_the_prefix_cache_and_its_chunks_sample_the_same_rows(tiny_policy):
    p = tiny_policy
    prompts, seeds = _prompts(p, 6, 2), [stable_hash("cached", i) for i in range(6)]
    ref = _plain(p, prompts, seeds)
    whole, cache = _cached(p, prompts, seeds)
    assert cache.chunks == 1
    _same(ref, whole)
    chunked, cache = _cached(p, prompts, seeds, budget=1)  # every row alone
    assert cache.chunks == len(prompts)
    _same(ref, chunked)
    _same(ref[::-1], _cached(p, prompts[::-1], seeds[::-1])[0])
    # identical prompts, prefilled once, still draw their own noise
    dup, cache = _cached(p, [prompts[0]] * 3 + [prompts[1]], [seeds[0], 7, 8, seeds[1]])
    _same([ref[0], ref[1]], [dup[0], dup[3]])


def test_a_single_row_draws_what_its_own_generator_draws(tiny_policy):
    """Row noise is the k-th [vocab] Exp(1) draw of Generator().manual_seed(seed): for one row,
    exactly what the batch path draws from that generator."""
    p = tiny_policy
    prompt = _prompts(p, 1, 3)[0]
    for seed in (0, 12345, stable_hash("x")):
        kw = {"max_new_tokens": 15, "stop_ids": [], "pad_id": p.pad_id, "temperature": 0.7}
        assert sample(p.model, [prompt], row_seeds=[seed], **kw) == \
            sample(p.model, [prompt], generator=torch.Generator().manual_seed(seed), **kw)


def test_different_seeds_sample_different_tokens_and_greedy_ignores_them(tiny_policy):
    p = tiny_policy
    prompt = _prompts(p, 1, 4)[0]
    gens = _plain(p, [prompt] * 8, list(range(8)), stop_ids=[], max_new_tokens=16)
    assert len({g.ids for g in gens}) == 8
    greedy = _plain(p, [prompt] * 2, [0, 1], temperature=0.0)
    assert greedy == sample(p.model, [prompt] * 2, max_new_tokens=12, stop_ids=STOPS, pad_id=p.pad_id, temperature=0.0)


def test_row_seeds_are_checked(tiny_policy):
    p = tiny_policy
    prompts = _prompts(p, 2, 5)
    with pytest.raises(ValueError, match="not both"):
        _plain(p, prompts, [1, 2], generator=torch.Generator())
    with pytest.raises(ValueError, match="1 seeds for 2 prompts"):
        _plain(p, prompts, [1])
    with pytest.raises(ValueError, match="1 seeds for 2 prompts"):
        _cached(p, prompts, [1], keys=["a", "b"])


def _inputs(prompts, tids, turns, summary=False):
    return [ActorInput(x, Task("test-echo", "train", i), tid, turn, AfterState(), summary=summary)
            for i, (x, tid, turn) in enumerate(zip(prompts, tids, turns))]


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_the_actor_seeds_each_input_from_its_episode_and_turn(tiny_policy, prefix_cache):
    p = dataclasses.replace(tiny_policy, prefix_cache=prefix_cache)
    prompts = _prompts(p, 4, 6)
    actor = PolicyActor(p, 10, 1.0, torch.Generator().manual_seed(0), episode_seed=11)
    assert actor.row_seeds(["a", "b"], [0, 3]) == [stable_hash(11, "a", 0), stable_hash(11, "b", 3)]
    both = actor.act(_inputs(prompts, ["a", "b", "c", "d"], [0, 3, 1, 1]))
    alone = PolicyActor(p, 10, 1.0, None, episode_seed=11).act(_inputs(prompts[1:2], ["b"], [3]))
    assert both[1].ids == alone[0].ids
    ref = sample(p.model, prompts, max_new_tokens=10, stop_ids=p.stop_ids, pad_id=p.pad_id, temperature=1.0,
                 row_seeds=[stable_hash(11, t, k) for t, k in zip("abcd", [0, 3, 1, 1])])
    assert [g.ids for g in both] == [g.ids for g in ref]
    # a summary at the same turn draws other noise
    summary = PolicyActor(p, 10, 1.0, None, episode_seed=11).act(_inputs(prompts, "abcd", [0, 3, 1, 1], summary=True))
    assert [g.ids for g in summary] != [g.ids for g in both]
    # generate() without turns (the gateway): a key's turn is its count of calls
    gw = PolicyActor(p, 10, 1.0, None, episode_seed=11)
    first, second = gw.generate(prompts[:2], ["a", "b"]), gw.generate(prompts[:1], ["a"])
    assert first[0].ids == ref[0].ids and gw.calls == {"a": 2, "b": 1}
    assert second[0].ids == sample(p.model, prompts[:1], max_new_tokens=10, stop_ids=p.stop_ids, pad_id=p.pad_id,
                                   temperature=1.0, row_seeds=[stable_hash(11, "a", 1)])[0].ids


def test_the_actor_hands_its_row_seeds_to_another_backend_and_refuses_them_with_images(tiny_policy):
    class Recording:  # a backend (vLLM refuses row seeds; inference replicas sample with them)
        def sample(self, model, version, prompts, **kw):
            self.kw = kw
            return []

    backend = Recording()
    actor = PolicyActor(dataclasses.replace(tiny_policy, sampler=backend), 4, 1.0, None, episode_seed=1)
    actor.generate([[5, 6], [7]], ["a", "b"], turns=[0, 3])
    assert backend.kw["keys"] == ["a", "b"] and backend.kw["row_seeds"] == actor.row_seeds(["a", "b"], [0, 3])
    actor = PolicyActor(tiny_policy, 4, 1.0, None, episode_seed=1)
    with pytest.raises(ValueError, match="images"):
        actor.generate([[5, 6]], ["a"], images=[[b"png"]])


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_an_episode_plays_the_same_with_or_without_other_episodes(tiny_policy, prefix_cache):
    p = dataclasses.replace(tiny_policy, prefix_cache=prefix_cache)
    cfg = RolloutConfig(context="full_history", max_turns=4, max_new_tokens=6, max_context_tokens=2048)

    def play(indices):
        engine = inline_engine(p, "test-echo", cfg, len(indices), episode_len=4, max_obs_words=12)
        reqs = [EpisodeRequest(engine.env.task("train", i), i, f"g{i}", f"t{i}") for i in indices]
        trajs, _ = engine.play(reqs, PolicyActor(p, cfg.max_new_tokens, 1.0, None, episode_seed=5))
        return trajs

    together, alone = play([0, 1, 2]), play([1])
    a, b = together[1], alone[0]
    assert [t.action_text for t in a.turns] == [t.action_text for t in b.turns]
    assert len(a.samples) == len(b.samples) > 0
    for sa, sb in zip(a.samples, b.samples):
        assert np.array_equal(sa.token_ids, sb.token_ids) and np.array_equal(sa.loss_mask, sb.loss_mask)
        m = sa.loss_mask.astype(bool)
        np.testing.assert_allclose(sa.logprobs[m], sb.logprobs[m], atol=1e-5)
    assert [t.action_text for t in together[0].turns] != [t.action_text for t in a.turns]
