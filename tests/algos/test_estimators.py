"""Golden values for the advantage estimators beyond GRPO (computed by hand in the comments)."""

import math

import pytest
import torch

from turnforge.algos import decoupled_gae, discounted_returns, gae, gigpo, length_adaptive_lam, reinforce_pp, rloo

S2 = math.sqrt(2.0)


def test_rloo_leave_one_out_baseline_and_group_of_one():
    # group 0: [1, 0, 0] -> 1 - 0, 0 - 0.5, 0 - 0.5; group 1: [3] alone -> 0
    adv = rloo(torch.tensor([1.0, 0.0, 0.0, 3.0]), torch.tensor([0, 0, 0, 1]))
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, 0.0]))


def test_reinforce_pp_batch_normalised():
    # [1, 2, 3, 6]: mean 3, centred [-2, -1, 0, 3], unbiased std sqrt(14/3)
    adv = reinforce_pp(torch.tensor([1.0, 2.0, 3.0, 6.0]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-2.0, -1.0, 0.0, 3.0]) / math.sqrt(14 / 3))


def test_reinforce_pp_baseline_subtracts_group_mean_then_global_std():
    # group means 1.5 and 4.5 -> centred [-0.5, 0.5, -1.5, 1.5]; std over the batch sqrt(5/3)
    adv = reinforce_pp(torch.tensor([1.0, 2.0, 3.0, 6.0]), torch.tensor([0, 0, 1, 1]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, -1.5, 1.5]) / math.sqrt(5 / 3))


def test_discounted_returns_restart_per_episode():
    # episode 0: [0, 1] with gamma 0.5 -> [0.5, 1]; episode 1: [2, 0, 4] -> [2 + 0 + 1, 0 + 2, 4]
    out = discounted_returns(torch.tensor([0.0, 1.0, 2.0, 0.0, 4.0]), torch.tensor([0, 0, 1, 1, 1]), 0.5)
    torch.testing.assert_close(out, torch.tensor([0.5, 1.0, 3.0, 2.0, 4.0], dtype=torch.float64))


# Episodes A, B share group 0; C is alone in group 1 (its anchor id 0 equals A's and B's
# first state but it must not join their anchor group: anchors are per episode group).
#   A: anchors [0, 1],    rewards [0, 1]     -> return 1, step returns (gamma .5) [0.5, 1]
#   B: anchors [0, 2, 1], rewards [0, 0, 0]  -> return 0, step returns [0, 0, 0]
#   C: anchors [0],       rewards [2]        -> return 2
GIGPO_CASE = dict(
    step_rewards=torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 2.0]),
    episode_ids=torch.tensor([0, 0, 1, 1, 1, 2]),
    group_ids=torch.tensor([0, 0, 0, 0, 0, 1]),
    anchor_ids=torch.tensor([0, 1, 0, 2, 1, 0]),
    gamma=0.5,
)


def test_gigpo_without_std():
    # A^E: A +0.5, B -0.5, C 0 (alone). Anchor 0 in group 0: {A:0.5, B:0} -> +0.25, -0.25;
    # anchor 1: {A:1, B:0} -> +0.5, -0.5; anchor 2: {B} alone -> 0; C alone -> 0.
    adv = gigpo(**GIGPO_CASE, std_normalize=False)
    torch.testing.assert_close(adv, torch.tensor([0.75, 1.0, -0.75, -0.5, -1.0, 0.0]))


def test_gigpo_with_std_and_omega():
    # every non-singleton group here has two members, so each centred value divided by the
    # unbiased std is +-1/sqrt(2); omega scales the step part.
    adv = gigpo(**GIGPO_CASE, omega=0.5, eps=0.0)
    e, s = 1 / S2, 0.5 / S2
    torch.testing.assert_close(adv, torch.tensor([e + s, e + s, -e - s, -e, -e - s, 0.0]))


def test_gigpo_repeated_anchor_within_an_episode():
    # D loops in state 0 twice: anchors [0, 0, 1], rewards [0, 0, 1], gamma 1 -> step returns [1, 1, 1]
    # E: anchors [0], reward [0] -> [0].  Anchor 0: {1, 1, 0}, mean 2/3. A^E: D +0.5, E -0.5.
    adv = gigpo(
        torch.tensor([0.0, 0.0, 1.0, 0.0]), torch.tensor([5, 5, 5, 9]), torch.tensor([3, 3, 3, 3]),
        torch.tensor([0, 0, 1, 0]), gamma=1.0, std_normalize=False,
    )
    torch.testing.assert_close(adv, torch.tensor([0.5 + 1 / 3, 0.5 + 1 / 3, 0.5, -0.5 - 2 / 3]))


def test_gigpo_bad_input():
    with pytest.raises(ValueError, match="one length"):
        gigpo(torch.zeros(3), torch.zeros(3), torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="no steps"):
        gigpo(*(torch.zeros(0),) * 4)
    with pytest.raises(ValueError, match="contiguous"):
        gigpo(torch.zeros(3), torch.tensor([0, 1, 0]), torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="group_ids differ"):
        gigpo(torch.zeros(2), torch.tensor([0, 0]), torch.tensor([0, 1]), torch.zeros(2))
    with pytest.raises(ValueError, match="NaN"):
        gigpo(torch.tensor([float("nan")]), torch.zeros(1), torch.zeros(1), torch.zeros(1))


# One sequence: [prompt, act, act, obs, act]; turn rewards on each turn's last action token.
# Values at unmasked positions (9) must be ignored.
R = torch.tensor([[0.0, 0.0, 1.0, 0.0, 2.0]])
V = torch.tensor([[9.0, 0.5, 0.4, 9.0, 0.3]])
M = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]])


def test_gae_skips_unmasked_positions():
    # gamma .9, lam .8, masked order t1, t2, t4:
    # t4: delta = 2 - .3 = 1.7                   A = 1.7
    # t2: delta = 1 + .9*.3 - .4 = .87           A = .87 + .72*1.7 = 2.094
    # t1: delta = 0 + .9*.4 - .5 = -.14          A = -.14 + .72*2.094 = 1.36768
    adv, ret = gae(R, V, M, 0.9, 0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 1.36768, 2.094, 0.0, 1.7]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.86768, 2.494, 0.0, 2.0]]))


def test_gae_per_sequence_lambda():
    # row 0 lam 1, gamma 1: Monte-Carlo returns [3, 3, 2] -> A = returns - values
    # row 1 lam 0: A = delta = [-.1, .9, 1.7] with gamma 1
    adv, ret = gae(R.repeat(2, 1), V.repeat(2, 1), M.repeat(2, 1), 1.0, torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(adv, torch.tensor([[0.0, 2.5, 2.6, 0.0, 1.7], [0.0, -0.1, 0.9, 0.0, 1.7]]))
    torch.testing.assert_close(ret[0], torch.tensor([0.0, 3.0, 3.0, 0.0, 2.0]))


def test_decoupled_gae_uses_each_lambda():
    adv, ret = decoupled_gae(R, V, M, 1.0, lam_policy=0.0, lam_critic=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, -0.1, 0.9, 0.0, 1.7]]))  # one-step TD
    torch.testing.assert_close(ret, torch.tensor([[0.0, 3.0, 3.0, 0.0, 2.0]]))  # Monte-Carlo


def test_length_adaptive_lambda():
    # lengths 3, 100, 0 with alpha .05: 1 - 1/.15 < 0 -> 0; 1 - 1/5 = .8; empty -> 0
    mask = torch.zeros(3, 100)
    mask[0, :3] = 1
    mask[1] = 1
    torch.testing.assert_close(length_adaptive_lam(mask, 0.05), torch.tensor([0.0, 0.8, 0.0], dtype=torch.float64))


def test_gae_bad_input_names_shapes():
    with pytest.raises(ValueError, match=r"values.*\(1, 4\)"):
        gae(R, V[:, :4], M, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"lam must be .*\[1\]"):
        gae(R, V, M, 1.0, torch.tensor([0.5, 0.5]))
