import pytest
import torch

from turnforge.algos import grpo


def test_grpo_golden_values():
    # group 0: [1, 2, 3] mean 2, unbiased std 1 -> [-1, 0, 1]
    # group 1: [5] alone -> 0
    # group 2: [4, 0] mean 2, unbiased std sqrt(8) = 2.8284271 -> [0.7071068, -0.7071068]
    # group 3: [7, 7] zero variance -> 0
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 4.0, 0.0, 7.0, 7.0])
    groups = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3])
    adv = grpo(rewards, groups, eps=0.0 + 1e-6)
    expected = torch.tensor([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 0.0, 2 / (8**0.5 + 1e-6), -2 / (8**0.5 + 1e-6), 0.0, 0.0])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)


def test_grpo_without_std_is_centred_and_groups_may_interleave():
    rewards = torch.tensor([3.0, 10.0, 1.0, 20.0])
    groups = torch.tensor([7, 9, 7, 9])  # arbitrary ids, interleaved
    adv = grpo(rewards, groups, std_normalize=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -5.0, -1.0, 5.0]))


def test_grpo_bad_input_names_argument():
    with pytest.raises(ValueError, match="rewards and group_ids"):
        grpo(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="NaN/inf at positions \\[1\\]"):
        grpo(torch.tensor([0.0, float("nan")]), torch.tensor([0, 0]))
