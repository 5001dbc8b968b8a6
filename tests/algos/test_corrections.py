"""Off-policy corrections (``engine.correction``, turnforge.algos.corrections) against hand-computed
tensors, and their registry: one name per class, settings as the config sections engine.<name>."""

from __future__ import annotations

import math

import pytest
import torch

from turnforge.algos.corrections import (
    CORRECTIONS,
    SequenceMaskSettings,
    TISSettings,
    TokenMaskSettings,
    ratio_stats,
    sequence_ratios,
    token_ratios,
)
from turnforge.algos.losses import decoupled_ppo_loss, ppo_clip_loss
from turnforge.app.config import load_config
from turnforge.config import EngineConfig
from turnforge.errors import UserError


def test_token_ratios_are_prox_over_behav_and_1_off_the_mask():
    prox = torch.log(torch.tensor([[0.6, 0.2, 0.9]]))
    behav = torch.log(torch.tensor([[0.5, 0.4, 0.1]]))
    r = token_ratios(prox, behav, torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(r, torch.tensor([[1.2, 0.5, 1.0]]))


def test_sequence_ratio_is_the_geometric_mean_of_the_rows_action_tokens():
    ratio = torch.tensor([[2.0, 8.0, 1.0], [0.25, 1.0, 1.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # sqrt(2 * 8) = 4; a single token is its own ratio; a row without action tokens is 1
    torch.testing.assert_close(sequence_ratios(ratio, mask), torch.tensor([4.0, 0.25, 1.0]))


def test_tis_truncates_each_token_at_the_cap():
    ratio, mask = torch.tensor([[1.2, 0.5, 3.0, 1.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out = CORRECTIONS["tis"].correct(ratio, mask, TISSettings(cap=2.0))
    torch.testing.assert_close(out.weights[mask.bool()], torch.tensor([1.2, 0.5, 2.0]))
    assert out.kept.tolist() == [[True, True, True, False]]  # every action token keeps its gradient
    s = out.stats(ratio, mask)
    assert s.weight_mean == pytest.approx((1.2 + 0.5 + 2.0) / 3) and s.ratio_max == pytest.approx(3.0)
    assert s.token_out_of_band == pytest.approx(1 / 3) and s.masked_fraction == 0.0
    assert s.sequence_out_of_band == 0.0  # (1.2 * 0.5 * 3) ** (1/3) = 1.216 <= 2
    assert s.sequence_p50 == pytest.approx(1.8 ** (1 / 3), rel=1e-6)
    untruncated = CORRECTIONS["tis"].correct(ratio, mask, TISSettings(cap=None))
    torch.testing.assert_close(untruncated.weights, ratio)
    assert untruncated.band == (0.0, math.inf)


def test_tis_is_the_former_truncated_importance_weight_bit_for_bit():
    """What ``importance_weights`` computed before the corrections were objects (and the
    decoupled loss with it): ``clamp(where(mask, exp(prox - behav), 1), max=cap)``."""
    g = torch.Generator().manual_seed(0)
    prox, behav = torch.randn(4, 9, generator=g), torch.randn(4, 9, generator=g)
    mask = (torch.rand(4, 9, generator=g) > 0.3).float()
    legacy = torch.clamp(torch.where(mask.bool(), torch.exp(prox - behav), torch.ones_like(prox)), max=2.0)
    assert torch.equal(CORRECTIONS["tis"].correct(token_ratios(prox, behav, mask), mask).weights, legacy)
    logp, adv = torch.randn(4, 9, generator=g, requires_grad=True), torch.randn(4, 9, generator=g)
    out, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, clip_low=0.2, clip_high=0.28)
    assert torch.equal(out.loss, ppo_clip_loss(logp, prox, legacy * adv, mask, clip_low=0.2, clip_high=0.28).loss)


def test_sequence_mask_zeroes_rows_whose_geometric_mean_leaves_the_band():
    # row 0: tokens 4 and 0.25 are each outside [0.5, 2], their geometric mean 1 is inside -> weight 1 on both
    # row 1: 4 and 4 -> 4, outside -> weight 0 on both; row 2: 1.5 and 1.5 (third token padding) -> weight 1.5
    ratio = torch.tensor([[4.0, 0.25, 1.0], [4.0, 4.0, 1.0], [1.5, 1.5, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    out = CORRECTIONS["sequence_mask"].correct(ratio, mask, SequenceMaskSettings(lo=0.5, hi=2.0))
    on = mask.bool()
    torch.testing.assert_close(out.weights[on], torch.tensor([1.0, 1.0, 0.0, 0.0, 1.5, 1.5]))
    assert out.kept[on].tolist() == [True, True, False, False, True, True] and not out.kept[~on].any()
    s = out.stats(ratio, mask)
    assert s.sequence_out_of_band == pytest.approx(1 / 3) and s.masked_fraction == pytest.approx(2 / 6)
    assert s.token_out_of_band == pytest.approx(4 / 6)  # 4, 0.25, 4, 4
    assert (s.sequence_p1, s.sequence_p50) == (pytest.approx(1.0 + 0.02 * 0.5), pytest.approx(1.5))


def test_token_mask_zeroes_tokens_outside_the_band_on_both_sides():
    ratio = torch.tensor([[0.4, 0.5, 1.0, 2.0, 2.5]])
    mask = torch.ones(1, 5)
    out = CORRECTIONS["token_mask"].correct(ratio, mask, TokenMaskSettings(lo=0.5, hi=2.0))
    torch.testing.assert_close(out.weights, torch.tensor([[0.0, 0.5, 1.0, 2.0, 0.0]]))  # the band is closed
    assert out.kept.tolist() == [[False, True, True, True, False]]
    s = out.stats(ratio, mask)
    assert s.masked_fraction == pytest.approx(2 / 5) and s.token_out_of_band == pytest.approx(2 / 5)
    # numpy's linear quantiles of [0.4, 0.5, 1, 2, 2.5]: p1 at position 0.04, p99 at 3.96
    assert (s.token_p1, s.token_p50, s.token_p99) == (pytest.approx(0.404), pytest.approx(1.0), pytest.approx(2.48))
    assert s.weight_mean == pytest.approx(3.5 / 5)


def test_a_masked_token_gets_no_policy_gradient_and_the_rest_their_weight():
    """In the decoupled loss at logprobs == prox (r = 1, inside the clip) the gradient of a token
    is -w A / N: 0 where the correction masked it."""
    behav = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    prox = torch.log(torch.tensor([[0.1, 0.6, 0.5]]))  # ratios 0.2 (masked), 1.2, 1.0
    logp = prox.clone().requires_grad_(True)
    adv, mask = torch.tensor([[1.0, 2.0, -1.0]]), torch.ones(1, 3)
    out, corrected = decoupled_ppo_loss(logp, prox, behav, adv, mask, CORRECTIONS["token_mask"], TokenMaskSettings())
    grad = torch.autograd.grad(out.loss, logp)[0]
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.2 * 2.0 / 3, 1.0 / 3]]))
    assert out.loss.item() == pytest.approx(-(1.2 * 2.0 - 1.0) / 3, rel=1e-6)  # the masked token still counts in N
    assert corrected.kept.tolist() == [[False, True, True]]


def test_ratio_stats_of_an_empty_batch():
    s = ratio_stats(torch.ones(0), torch.ones(0), torch.ones(0), torch.ones(0, dtype=torch.bool), (0.5, 2.0))
    assert (s.weight_mean, s.ratio_max, s.token_p50, s.sequence_p99, s.masked_fraction) == (1.0, 1.0, 1.0, 1.0, 0.0)


def test_a_bad_shape_is_an_error_naming_both():
    with pytest.raises(ValueError, match=r"token_mask: ratio \(1, 2\) and mask \(1, 3\)"):
        CORRECTIONS["token_mask"].correct(torch.ones(1, 2), torch.ones(1, 3))


# the registry and the config


def test_the_config_takes_exactly_the_registered_names():
    from turnforge.app.reference import config_keys

    (key,) = [k for k in config_keys() if k.key == "engine.correction"]
    assert key.type == " or ".join(repr(n) for n in CORRECTIONS) == "'tis' or 'sequence_mask' or 'token_mask'"
    assert key.default == '"tis"'
    assert all(f"{name} (" in key.description for name in CORRECTIONS)
    with pytest.raises(UserError, match=r"bad value for 'engine.correction' \('icepop'\).*valid: tis, sequence_mask, token_mask"):
        load_config("sokoban-tiny", ["engine.correction=icepop"])


def test_each_corrections_settings_are_its_own_section_of_engine():
    from turnforge.app.reference import config_keys

    keys = {k.key: k for k in config_keys()}
    for name, c in CORRECTIONS.items():
        assert EngineConfig.model_fields[name].annotation is c.Settings
        assert {f"engine.{name}.{field}" for field in c.Settings.model_fields} <= set(keys)
    assert keys["engine.tis.cap"].type == "float or None" and keys["engine.tis.cap"].default == "2.0"
    assert EngineConfig().tis.cap == 2.0 and EngineConfig().correction == "tis"  # the former engine.is_cap default
    cfg = load_config("sokoban-tiny", ["engine.correction=token_mask", "engine.token_mask.lo=0.8", "flywheel.rounds=0"])
    assert CORRECTIONS[cfg.engine.correction].settings(cfg.engine) == TokenMaskSettings(lo=0.8, hi=2.0)
    with pytest.raises(UserError, match=r"unknown config key 'engine.is_cap'; valid keys here: .*'tis'"):
        load_config("sokoban-tiny", ["engine.is_cap=3"])
    with pytest.raises(UserError, match=r"'engine.sequence_mask'.*lo=3 must be below hi=2"):
        load_config("sokoban-tiny", ["engine.sequence_mask.lo=3"])
