"""Clipped value loss and explained variance against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from turnforge.algos import explained_variance, value_loss


def test_clipped_value_loss_value_and_gradient():
    values = torch.tensor([[1.0, 3.0]], requires_grad=True)
    old, returns, mask = torch.tensor([[0.0, 2.0]]), torch.tensor([[2.0, 2.0]]), torch.ones(1, 2)
    # pos 0: max((1-2)^2, (0+0.5-2)^2) = 2.25 (clipped branch, no gradient)
    # pos 1: max((3-2)^2, (2+0.5-2)^2) = 1 (unclipped branch, gradient 0.5 * (3-2) / 2 positions)
    loss = value_loss(values, old, returns, mask, clip=0.5)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.0) / 2)
    loss.backward()
    assert values.grad[0].tolist() == pytest.approx([0.0, 0.5])


def test_unclipped_value_loss_and_mask():
    values = torch.tensor([[1.0, 3.0, 100.0]])
    old, returns = torch.zeros(1, 3), torch.tensor([[2.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third position is not a value position
    assert value_loss(values, old, returns, mask).item() == pytest.approx(0.5)


def test_value_loss_shape_mismatch_names_shapes():
    with pytest.raises(ValueError, match=r"values.*\(1, 2\).*returns.*\(1, 3\)"):
        value_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))


def test_explained_variance_hand_computed():
    # residual [0, 0, -1]: var 2/9; target [1, 2, 4]: var 14/9 -> 1 - 1/7
    assert explained_variance(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 4.0])) == pytest.approx(6 / 7)
    assert explained_variance(torch.tensor([2.0, 2.0]), torch.tensor([1.0, 3.0])) == pytest.approx(0.0)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert explained_variance(torch.tensor([1.0, 2.0, 3.0, 9.0]), torch.tensor([1.0, 2.0, 4.0, 0.0]), mask) == pytest.approx(6 / 7)
    assert explained_variance(torch.ones(3), torch.ones(3)) != explained_variance(torch.ones(3), torch.ones(3))  # NaN
