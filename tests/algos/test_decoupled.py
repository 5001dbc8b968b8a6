"""Decoupled PPO with truncated importance sampling (engine.correction=tis) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from turnforge.algos.corrections import CORRECTIONS, TISSettings, token_ratios
from turnforge.algos.losses import decoupled_ppo_loss, ppo_clip_loss

TIS = CORRECTIONS["tis"]


def test_equal_prox_and_behaviour_is_plain_ppo_with_unit_weights():
    torch.manual_seed(0)
    logp = torch.randn(3, 5, requires_grad=True)
    old, adv = torch.randn(3, 5), torch.randn(3, 5)
    mask = (torch.rand(3, 5) > 0.3).float()
    out, corrected = decoupled_ppo_loss(logp, old, old.clone(), adv, mask, TIS, TISSettings(cap=2.0), clip_low=0.2, clip_high=0.28)
    stats = corrected.stats(token_ratios(old, old, mask), mask)
    ref = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert out.loss.item() == pytest.approx(ref.loss.item(), abs=1e-7)
    assert stats.weight_mean == pytest.approx(1.0) and stats.ratio_max == pytest.approx(1.0) and stats.token_out_of_band == 0.0
    g1 = torch.autograd.grad(out.loss, logp)[0]
    g2 = torch.autograd.grad(ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28).loss, logp)[0]
    assert torch.allclose(g1, g2)


def test_hand_computed_weights_clip_and_truncation():
    # token 0: behav 0.5, prox 0.6 -> w = 1.2; current 0.9 -> r = 1.5, A = +1: clipped at 1.2 -> objective 1.2 * 1.2
    # token 1: behav 0.4, prox 0.2 -> w = 0.5; current 0.1 -> r = 0.5, A = -2: min(-1, -1.6) = -1.6 (clipped at 0.8) -> 0.5 * -1.6
    behav = torch.log(torch.tensor([[0.5, 0.4]]))
    prox = torch.log(torch.tensor([[0.6, 0.2]]))
    logp = torch.log(torch.tensor([[0.9, 0.1]])).requires_grad_(True)
    adv, mask = torch.tensor([[1.0, -2.0]]), torch.ones(1, 2)
    out, corrected = decoupled_ppo_loss(logp, prox, behav, adv, mask, clip_low=0.2, clip_high=0.2)  # default: tis, cap 2
    stats = corrected.stats(token_ratios(prox, behav, mask), mask)
    assert out.loss.item() == pytest.approx(-(1.2 * 1.2 + 0.5 * -1.6) / 2, abs=1e-6)
    assert stats.weight_mean == pytest.approx((1.2 + 0.5) / 2) and stats.ratio_max == pytest.approx(1.2)
    assert out.clip_fraction == 1.0  # both tokens are on the clipped branch: no gradient
    assert torch.autograd.grad(out.loss, logp)[0].abs().max() == 0
    # truncation: cap 1.1 on the first weight
    out, corrected = decoupled_ppo_loss(logp, prox, behav, adv, mask, TIS, TISSettings(cap=1.1), clip_low=0.2, clip_high=0.2)
    stats = corrected.stats(token_ratios(prox, behav, mask), mask)
    assert out.loss.item() == pytest.approx(-(1.1 * 1.2 + 0.5 * -1.6) / 2, abs=1e-6)
    assert stats.token_out_of_band == 0.5 and stats.ratio_max == pytest.approx(1.2) and stats.masked_fraction == 0


def test_unclipped_gradient_is_scaled_by_the_weight():
    # r = 1.05 inside the clip range: d(-w r A)/d logp = -w r A
    behav, prox = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.75)]])  # w = 1.5
    logp = torch.tensor([[math.log(0.75 * 1.05)]], requires_grad=True)
    out, _ = decoupled_ppo_loss(logp, prox, behav, torch.tensor([[2.0]]), torch.ones(1, 1), TIS, TISSettings(cap=None))
    assert torch.autograd.grad(out.loss, logp)[0].item() == pytest.approx(-1.5 * 1.05 * 2.0, rel=1e-5)


def test_ratios_and_cap_bad_input():
    with pytest.raises(ValueError, match=r"prox_logprobs \(1, 2\), behav_logprobs \(1, 3\)"):
        token_ratios(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))
    with pytest.raises(ValueError, match="greater than 0"):
        TISSettings(cap=0.0)
