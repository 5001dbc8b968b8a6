"""A minibatch in several passes (``model.micro_batch_tokens``): the packing by padded tokens
(hand-computed), the factors that make the passes' gradients the minibatch's, equal pass counts
on every rank, and one PPO step in passes against the same step in one pass."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import inline_engine

from turnforge import dist
from turnforge.config import RLConfig, RolloutConfig
from turnforge.dist import Pass, World, micro_batches
from turnforge.optim import GuardedStep
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest
from turnforge.train.update import ppo_update

# rows are (name, length, weight)
ROWS = [("a", 3, 1.0), ("b", 9, 2.0), ("c", 4, 1.0), ("d", 8, 4.0), ("e", 2, 2.0)]


def _passes(rows, budget):
    return micro_batches(rows, lambda r: r[2], lambda r: r[1], budget)


def _names(passes):
    return [[r[0] for r in p.rows] for p in passes]


def test_rows_that_fit_are_one_pass_as_given():
    # 5 rows x longest 9 = 45 padded tokens
    for budget in (0, 45, 1000):
        assert _passes(ROWS, budget) == [Pass(ROWS, 1.0, 1.0)]


def test_rows_over_the_budget_are_packed_longest_first():
    # by length: b 9, d 8, c 4, a 3, e 2; budget 20: [b, d] (2 x 9 = 18), [c, a, e] (3 x 4 = 12; c, a, e, + none)
    passes = _passes(ROWS, 20)
    assert _names(passes) == [["b", "d"], ["c", "a", "e"]]
    # factors: each pass's weight over the minibatch's (total 10): 6/10 and 4/10; they add up to 1
    assert [p.factor for p in passes] == pytest.approx([0.6, 0.4])
    assert [p.fraction for p in passes] == pytest.approx([0.6, 0.4])
    # budget 17: b alone (2 x 9 = 18 > 17), then d, c (2 x 8 = 16), then a, e
    assert _names(_passes(ROWS, 17)) == [["b"], ["d", "c"], ["a", "e"]]
    # a row longer than the budget is a pass alone
    assert _names(_passes(ROWS, 5)) == [["b"], ["d"], ["c"], ["a"], ["e"]]


def test_every_rank_runs_the_same_passes(monkeypatch):
    """Two ranks: rank 0 holds a, c, e (lengths 3, 4, 2), rank 1 holds b, d (9, 8). Budget 16:
    rank 1 needs 2 passes (b; d), rank 0 one (3 x 4 = 12), so rank 0 adds a placeholder pass of factor 0."""
    got = {}
    for rank in (0, 1):
        monkeypatch.setattr(dist, "_WORLD", World(rank=rank, size=2, backend="gloo"))
        got[rank] = _passes(ROWS, 16)
    assert _names(got[0]) == [["a", "c", "e"], ["a"]] and _names(got[1]) == [["b"], ["d"]]
    assert got[0][1].factor == 0.0
    # factor = size * pass weight / total weight (10): rank 0: 2 * 4 / 10; rank 1: 2 * 2 / 10, 2 * 4 / 10
    assert [p.factor for p in got[0]] == pytest.approx([0.8, 0.0])
    assert [p.factor for p in got[1]] == pytest.approx([0.4, 0.8])
    # the pass's share of the whole minibatch over both ranks: pass 0 = a, c, e, b (6/10), pass 1 = d (4/10)
    assert [p.fraction for p in got[0]] == [p.fraction for p in got[1]] == pytest.approx([0.6, 0.4])
    # without a budget each rank has its one pass: minibatch_share's rows and factor
    for rank in (0, 1):
        monkeypatch.setattr(dist, "_WORLD", World(rank=rank, size=2, backend="gloo"))
        (one,) = _passes(ROWS, 0)
        assert (one.rows, one.factor) == tuple(dist.minibatch_share(ROWS, lambda r: r[2]))


def test_a_nonfinite_pass_skips_the_step():
    model = torch.nn.Linear(2, 1)
    before = copy.deepcopy(model.state_dict())
    step = GuardedStep(model, torch.optim.SGD(model.parameters(), lr=0.1), 1.0, 3)
    x = torch.ones(1, 2)
    step.backward(model(x).sum())
    step.backward(model(x).sum() * float("nan"))
    assert step.step() is None and step.skipped == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the next step starts from zero gradients: two passes of half the loss are one pass of the whole
    step.backward(model(x).sum() * 0.5)
    step.backward(model(x).sum() * 0.5)
    assert step.step() is not None
    twice = copy.deepcopy(model.state_dict())
    model.load_state_dict(before)
    once = GuardedStep(model, torch.optim.SGD(model.parameters(), lr=0.1), 1.0, 3)
    once(model(x).sum())
    assert all(torch.allclose(twice[k], v, atol=1e-7) for k, v in model.state_dict().items())


def test_a_ppo_step_in_passes_is_the_step_in_one(tiny_policy):
    """The tiny model's samples of 4 test-echo episodes, one PPO minibatch: in one pass, and with a
    budget that splits it into several; the weights after the step and the logged figures agree up
    to float order."""
    cfg = RolloutConfig(max_turns=3, max_new_tokens=6)
    engine = inline_engine(tiny_policy, "test-echo", cfg, n=4)
    reqs = [EpisodeRequest(engine.env.task("train", i), i, f"g{i}", f"t{i}") for i in range(4)]
    trajs, _ = engine.play(reqs, PolicyActor(tiny_policy, cfg.max_new_tokens, 1.0, torch.Generator().manual_seed(0)))
    samples = [x for t in trajs for x in t.samples]
    pairs = [(x, 1.0 if i % 3 else -0.5) for i, x in enumerate(samples)]
    start = copy.deepcopy(tiny_policy.model.state_dict())
    rl = RLConfig(merge_duplicates=False, minibatch_size=len(pairs), epochs=1, kl_coef=0.0)
    longest = max(len(x) for x in samples)
    assert len(samples) * longest > 2 * longest  # the budget below makes several passes

    def run(budget):
        tiny_policy.model.load_state_dict(start)
        step = GuardedStep(tiny_policy.model, torch.optim.SGD(tiny_policy.model.parameters(), lr=0.5), 1e9, 3)
        stats = ppo_update(tiny_policy, pairs, step, rl, temperature=1.0, shuffle=np.random.default_rng(0),
                           micro_batch_tokens=budget)
        return stats, copy.deepcopy(tiny_policy.model.state_dict())

    one, w_one = run(0)
    several, w_several = run(2 * longest)
    assert len(micro_batches(list(range(len(pairs))), lambda i: 1.0, lambda i: len(samples[i]), 2 * longest)) >= 3
    moved = max(float((w_one[k] - start[k]).abs().max()) for k in start)
    assert moved > 1e-3  # the step changed the weights
    for k in start:
        assert torch.allclose(w_one[k], w_several[k], atol=1e-6, rtol=1e-5), k
    for field in ("loss", "clip_fraction", "approx_kl", "entropy", "grad_norm"):
        assert getattr(several, field) == pytest.approx(getattr(one, field), rel=1e-5, abs=1e-6), field
    assert several.tokens == one.tokens
    tiny_policy.model.load_state_dict(start)
