"""AWR's weights and the effective sample size against hand-computed values."""

import math

import pytest
import torch

from turnforge.algos.awr import awr_weights, effective_sample_size


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
