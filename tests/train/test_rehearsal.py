"""Rehearsal toward the starting policy (rl.rehearsal_coef): the loss by hand, the cache (a run: tests/e2e/test_rehearsal_run.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from turnforge.runs import RunDir
from turnforge.train.rehearsal import Rehearsal, read_cache, rehearsal_loss, write_cache
from turnforge.types import Sample


class Uniform(torch.nn.Module):
    """Logits 0 everywhere except one favoured token: the log-probabilities are known in closed form."""

    def __init__(self, vocab: int, favoured: int, logit: float) -> None:
        super().__init__()
        self.vocab, self.favoured, self.logit = vocab, favoured, logit

    def forward(self, input_ids, attention_mask=None, **_):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        logits[..., self.favoured] = self.logit

        class Out:
            pass

        out = Out()
        out.logits = logits
        return out


def sample(ids, mask, tid="t"):
    n = len(ids)
    return Sample(np.asarray(ids, np.int64), np.asarray(mask, np.int8), np.full(n, np.nan, np.float32),
                  np.full(n, -1, np.int32), tid, 0)


def test_rehearsal_loss_is_the_token_mean_nll_at_the_temperature():
    # vocab 4, token 2 has logit 2: at T = 2 the logits are (0, 0, 1, 0) -> p(2) = e / (e + 3), p(other) = 1 / (e + 3)
    model = Uniform(4, 2, 2.0)
    xs = [sample([1, 2, 3], [0, 1, 1]), sample([0, 2], [0, 1])]  # action tokens: 2, 3 | 2
    got = rehearsal_loss(model, xs, pad_id=0, temperature=2.0)
    z = math.e + 3
    want = -(math.log(math.e / z) + math.log(1 / z) + math.log(math.e / z)) / 3
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_the_cache_round_trips_and_batches_cycle(tmp_path):
    xs = [sample([1, 2, 3], [0, 1, 1], "a"), sample([0, 2], [0, 1], "b"), sample([3, 3, 1, 2], [0, 0, 1, 1], "c")]
    r = Rehearsal(xs, 0.5, 0.1, episodes=3, played=4, env_steps=9)
    write_cache(RunDir(tmp_path).rehearsal, r)
    back, meta = read_cache(RunDir(tmp_path).rehearsal)
    assert meta == {"episodes": 3, "played": 4, "env_steps": 9}
    for a, b in zip(xs, back):
        assert a.trajectory_id == b.trajectory_id and np.array_equal(a.token_ids, b.token_ids)
        assert np.array_equal(a.loss_mask, b.loss_mask) and np.array_equal(a.versions, b.versions)
        assert np.array_equal(np.isnan(a.logprobs), np.isnan(b.logprobs))
    order = np.array([2, 0, 1])
    assert [x.trajectory_id for x in r.batch(0, 2, order)] == ["c", "a"]
    assert [x.trajectory_id for x in r.batch(1, 2, order)] == ["b", "c"]  # cycles
    assert [x.trajectory_id for x in r.batch(0, 5, order)] == ["c", "a", "b"]  # never more than the cache
