"""A ``PrefillCache`` shared by evaluations of one policy changes no token and no logprob, bit
for bit, and saves prefills: the evaluations of the BC policy at several temperatures
(``turnforge.app.run.evaluate_start``) rely on it."""

from __future__ import annotations

from contextlib import closing

import numpy as np
import pytest
import torch
from helpers import TINY_TEST_SHAPE

from turnforge.app.config import load_config
from turnforge.policy.generate import PrefillCache, sample
from turnforge.rollout.engine import make_engine
from turnforge.train.evaluate import evaluate, prefill_cache

#: FrozenLake with a memoryless (window 0) policy: episodes revisit states, so prompts repeat
#: within one evaluation and across temperatures; invalid actions make some prompts longer.
FROZENLAKE = ["eval.bc_temperatures=[]", "rollout.max_turns=6", *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()]]


def _record(trajs) -> list:
    """Everything an evaluation produced, exactly: actions, token ids, sampling logprobs (bytes), outcomes."""
    return [(t.trajectory_id, [turn.action_text for turn in t.turns], t.episode_return, t.success,
             [(x.token_ids.tobytes(), x.logprobs.tobytes(), x.loss_mask.tobytes()) for x in t.samples]) for t in trajs]


def test_evaluations_sharing_a_cache_are_bit_identical_and_prefill_less(tiny_policy):
    cfg = load_config("frozenlake-tiny", FROZENLAKE)
    cache = PrefillCache(1 << 30, tiny_policy.version)
    with closing(make_engine(cfg, tiny_policy, 16)) as engine:
        for k, temperature in enumerate((1.0, 0.0)):  # the same tasks at two temperatures, as evaluate_start plays them
            plain, a = evaluate(engine, tiny_policy, episodes=16, temperature=temperature, seed=3)
            hits = cache.hits
            cached, b = evaluate(engine, tiny_policy, episodes=16, temperature=temperature, seed=3, prefills=cache)
            assert _record(a) == _record(b) and plain == cached
            if k == 1:  # at least every task's first prompt was prefilled by the evaluation before
                assert cache.hits - hits >= 16
    assert cache.misses > 0 and 0 < cache.bytes <= 1 << 30


def test_sample_with_a_cache_equals_sample_without_it_for_any_batch(tiny_policy):
    """Rows of different lengths (so different padded widths), duplicates inside a batch, and
    prompts met before in other batches: the same ids and logprobs, bit for bit, and a budget
    too small for any entry changes nothing but what is kept."""
    rng = np.random.default_rng(0)
    base = [tuple(int(t) for t in rng.integers(10, 200, size=n)) for n in (5, 9, 9, 14, 5, 20)]
    batches = [[base[0], base[1], base[2]], [base[1], base[3], base[0]], [base[4], base[5], base[2], base[2]],
               [base[2], base[4], base[1]]]  # widths 9, 14, 20, 9: the last batch meets its prompts again
    p = tiny_policy
    for budget in (1 << 30, 1):
        cache = PrefillCache(budget, p.version)
        for i, prompts in enumerate(batches):
            kw = dict(max_new_tokens=3, stop_ids=p.stop_ids, pad_id=p.pad_id, temperature=0.8)
            plain = sample(p.model, prompts, generator=torch.Generator().manual_seed(i), **kw)
            cached = sample(p.model, prompts, generator=torch.Generator().manual_seed(i), prefills=cache, **kw)
            assert plain == cached
        assert cache.bytes <= budget
        # the duplicate in batch 3 is prefilled once; batch 4's rows come from the cache unless nothing fits
        assert cache.hits == (1 + 2 if budget > 1 else 1)  # (its third row, of length 5, was met at width 20 only)


def test_a_cache_refuses_other_weights_and_applies_only_to_the_plain_sampler(tiny_policy):
    cache = PrefillCache(1 << 20, tiny_policy.version)
    cache.check(tiny_policy.version)
    with pytest.raises(RuntimeError, match="version"):
        cache.check(tiny_policy.version + 1)
    assert prefill_cache(tiny_policy, 0) is None
    assert isinstance(prefill_cache(tiny_policy, 1), PrefillCache)
    tiny_policy.prefix_cache = True  # per-episode KV caches: another way to reuse prefills, other numerics
    assert prefill_cache(tiny_policy, 64) is None
