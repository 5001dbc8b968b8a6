import pytest
import torch

from turnforge.algos import grpo, pass_at_k_advantage, w_reinforce


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


def test_pass_at_k_hand_computed():
    # group 0: n=4, c=1, k=2: R = 1 - C(3,2)/C(4,2) = 1/2, sigma = 1/2;
    #   success (1 - 1/2) / (1/2) = 1; failure (1 - 1/2 - C(2,1)/C(3,1)) / (1/2) = (1/2 - 2/3) * 2 = -1/3
    # group 1: n=4, c=2, k=2: R = 1 - C(2,2)/C(4,2) = 5/6, sigma = sqrt(5)/6;
    #   success (1/6) / (sqrt(5)/6) = 1/sqrt(5); failure (1/6 - C(1,1)/C(3,1)) / (sqrt(5)/6) = -1/sqrt(5)
    # group 2: no success (pass@k = 0), group 3: n - c = 1 < k, so pass@2 = 1: no signal in either
    s = torch.tensor([1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0])
    g = torch.tensor([0] * 4 + [1] * 4 + [2] * 4 + [3] * 4)
    got = pass_at_k_advantage(s, g, 2)
    r5 = 1 / 5 ** 0.5
    want = torch.tensor([1, -1 / 3, -1 / 3, -1 / 3, r5, r5, -r5, -r5] + [0] * 8, dtype=torch.float32)
    torch.testing.assert_close(got, want)


def test_pass_at_1_is_grpo_with_the_population_std():
    s = torch.tensor([1, 0, 0, 0, 1, 1, 0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    # n=4, c=1: mean 1/4, population std sqrt(3)/4: success 3/sqrt(3) = sqrt(3), failure -1/sqrt(3)
    # n=3, c=2: mean 2/3, population std sqrt(2)/3: success 1/sqrt(2), failure -2/sqrt(2) = -sqrt(2)
    want = torch.tensor([3 ** 0.5, -(3 ** -0.5), -(3 ** -0.5), -(3 ** -0.5), 2 ** -0.5, 2 ** -0.5, -(2 ** 0.5)])
    torch.testing.assert_close(pass_at_k_advantage(s, g, 1), want)


def test_pass_at_k_group_smaller_than_k_and_bad_input():
    assert pass_at_k_advantage(torch.tensor([1, 0]), torch.tensor([0, 0]), 4).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="binary"):
        pass_at_k_advantage(torch.tensor([0.5, 1.0]), torch.tensor([0, 0]), 1)
    with pytest.raises(ValueError, match="k >= 1"):
        pass_at_k_advantage(torch.tensor([1, 0]), torch.tensor([0, 0]), 0)


def test_w_reinforce_hand_computed():
    assert w_reinforce(torch.tensor([True, False, True]), lam=0.1).tolist() == pytest.approx([0.1, -1.0, 0.1])
    with pytest.raises(ValueError, match="binary"):
        w_reinforce(torch.tensor([2.0]))
