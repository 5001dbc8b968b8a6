"""AWR's weights and the effective sample size against hand-computed values."""

import math

import pytest
import torch

from turnforge.algos.awr import anchor_state_advantages, awr_weights, effective_sample_size


def test_awr_weights_hand_computed():
    # beta = 0.5, max 4: A = 0 -> e^0 = 1; A = 0.5 -> e^1; A = -1 -> e^-2;
    # A = 0.6 -> e^1.2 = 3.3201 (under the clip); A = 1 -> e^2 = 7.389 -> clipped at 4
    adv = torch.tensor([0.0, 0.5, -1.0, 0.6, 1.0])
    got = awr_weights(adv, beta=0.5, max_weight=4.0)
    want = torch.tensor([1.0, math.e, math.exp(-2.0), math.exp(1.2), 4.0])
    torch.testing.assert_close(got, want)
    assert got.dtype == torch.float32


def test_awr_weights_never_overflow_and_keep_order():
    # A / beta = 1e4 would overflow exp in float32 and float64: the exponent is clipped first
    got = awr_weights(torch.tensor([1e3, -1e3, 0.05, 0.02]), beta=0.1, max_weight=20.0)
    assert got[0].item() == pytest.approx(20.0) and got[1].item() == 0.0
    assert got[2] > got[3] > 0  # exp(0.5) > exp(0.2)


def test_awr_weights_refuse_bad_input():
    with pytest.raises(ValueError, match="beta"):
        awr_weights(torch.zeros(2), beta=0.0, max_weight=20.0)
    with pytest.raises(ValueError, match="max_weight"):
        awr_weights(torch.zeros(2), beta=1.0, max_weight=-1.0)
    with pytest.raises(ValueError, match=r"NaN/inf at positions \[1\]"):
        awr_weights(torch.tensor([0.0, float("nan")]), beta=1.0, max_weight=20.0)


def test_effective_sample_size_hand_computed():
    # equal weights: 1; w = [1, 1, 2]: (4)^2 / (3 * 6) = 16 / 18; one weight carries all: 1 / N
    assert effective_sample_size(torch.tensor([0.3, 0.3, 0.3, 0.3])) == pytest.approx(1.0)
    assert effective_sample_size(torch.tensor([1.0, 1.0, 2.0])) == pytest.approx(16 / 18)
    assert effective_sample_size(torch.tensor([0.0, 5.0, 0.0, 0.0])) == pytest.approx(0.25)
    with pytest.raises(ValueError, match=">= 0"):
        effective_sample_size(torch.tensor([1.0, -1.0]))


def test_anchor_state_advantages_hand_computed():
    # episode 0: states a, b, c, actions x, y, x, rewards 0, 0, 1 (success); episode 1: a, b, d with
    # x, x, x and 0, 0, 0; episode 2: a, e with y, x and 0, -0.1.
    # gamma = 0.5: returns 0.25, 0.5, 1 | 0, 0, 0 | -0.05, -0.1
    # state a: V = (0.25 + 0 - 0.05) / 3 = 0.2 / 3; Q(a, x) = (0.25 + 0) / 2 = 0.125, Q(a, y) = -0.05
    # state b: V = 0.25; Q(b, y) = 0.5, Q(b, x) = 0; c, d, e: visited once -> A = 0, visits 1
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, -0.1])
    episodes = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    a, b, c, d, e = range(5)
    states = torch.tensor([a, b, c, a, b, d, a, e])
    x, y = 0, 1
    actions = torch.tensor([x, y, x, x, x, x, y, x])
    adv, visits = anchor_state_advantages(rewards, episodes, states, actions, gamma=0.5)
    v = 0.2 / 3
    want = torch.tensor([0.125 - v, 0.25, 0.0, 0.125 - v, -0.25, 0.0, -0.05 - v, 0.0])
    torch.testing.assert_close(adv, want)
    assert visits.tolist() == [3, 2, 1, 3, 2, 1, 3, 1]
