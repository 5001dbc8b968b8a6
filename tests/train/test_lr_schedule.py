"""The learning-rate schedules of BC and RL, against hand-computed values."""

import pytest

from turnforge.optim import lr_factor


def test_constant_schedule_keeps_the_base_rate():
    assert [lr_factor("constant", i, 10) for i in (0, 5, 10)] == [1.0, 1.0, 1.0]


def test_cosine_schedule_decays_from_one_to_zero():
    # 0.5 * (1 + cos(pi * i / 8)) at i = 0, 2, 4, 6, 8
    expected = [1.0, 0.8535533905932737, 0.5, 0.14644660940672627, 0.0]
    assert [lr_factor("cosine", i, 8) for i in (0, 2, 4, 6, 8)] == pytest.approx(expected, abs=1e-12)
    assert lr_factor("cosine", 9, 8) == pytest.approx(0.0)  # past the end it stays at 0
