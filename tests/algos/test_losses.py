import math

import torch

from turnforge.algos import kl_k3, ppo_clip_loss, sft_loss, weighted_nll


def test_ppo_clip_loss_hand_computed():
    # one sequence, 4 positions, the first is context (mask 0)
    old = torch.tensor([[0.0, math.log(0.5), math.log(0.5), math.log(0.5)]])
    new = torch.tensor([[0.0, math.log(0.5), math.log(0.75), math.log(0.25)]], requires_grad=True)
    adv = torch.tensor([[0.0, 1.0, 1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    out = ppo_clip_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # ratios 1, 1.5, 0.5 ; terms: min(1*1, 1*1)=1 ; min(1.5, 1.2)=1.2 ; min(-0.5, -0.8)=-0.8
    # loss = -(1 + 1.2 - 0.8) / 3
    assert math.isclose(out.loss.item(), -(1 + 1.2 - 0.8) / 3, rel_tol=1e-6)
    assert math.isclose(out.clip_fraction, 2 / 3, rel_tol=1e-6)  # both clipped tokens lose their gradient
    out.loss.backward()
    # d/dlogp of -(ratio*A)/3 at the unclipped token = -ratio*A/3 = -1/3 ; clipped tokens: 0 ; context: 0
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -1 / 3, 0.0, 0.0]]))


def test_ppo_clip_higher_is_asymmetric():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.25, 0.75]]))
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    # clip_high 0.28 keeps 1.25 unclipped; clip_low 0.2 clips 0.75 -> 0.8
    out = ppo_clip_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert math.isclose(out.loss.item(), -(1.25 - 0.8) / 2, rel_tol=1e-6)


def test_kl_k3_and_reference_term():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    k3 = kl_k3(logp, ref)
    r = math.log(0.5)
    torch.testing.assert_close(k3, torch.tensor([[math.exp(r) - r - 1, 0.0]]))
    out = ppo_clip_loss(logp, logp.detach(), torch.zeros(1, 2), torch.ones(1, 2), ref_logprobs=ref, kl_coef=0.5)
    assert math.isclose(out.loss.item(), 0.5 * float(k3.mean()), rel_tol=1e-6)


def test_sft_loss_is_mean_nll_over_action_tokens():
    logp = torch.log(torch.tensor([[0.9, 0.5, 0.25], [0.1, 0.1, 0.5]]))
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    expected = -(math.log(0.5) + math.log(0.25) + math.log(0.5)) / 3
    assert math.isclose(float(sft_loss(logp, mask)), expected, rel_tol=1e-6)


def test_weighted_nll_hand_computed():
    # two samples: action tokens at positions 1-2 and 2; weights 1 and 0.5
    lp = torch.tensor([[-9.0, math.log(0.5), math.log(0.25)], [-9.0, -9.0, math.log(0.5)]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    loss = weighted_nll(lp, mask, torch.tensor([1.0, 0.5]))
    # (1 x (log 2 + log 4) + 0.5 x log 2) / 3 action tokens (not / the weights' sum 2.5)
    assert math.isclose(loss.item(), (math.log(2) + math.log(4) + 0.5 * math.log(2)) / 3, rel_tol=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1 / 3, -1 / 3], [0.0, 0.0, -0.5 / 3]]))
    assert weighted_nll(lp, torch.zeros(2, 3), torch.ones(2)).item() == 0.0  # an empty mask: 0, not NaN


def test_aggregation_weights_hand_computed():
    from turnforge.algos import aggregation_weights

    action = torch.tensor([2, 4, 1])
    episode = torch.tensor([6, 6, 1])  # samples 0 and 1 are turns of one 6-token episode
    torch.testing.assert_close(aggregation_weights("token", action, episode), torch.ones(3))
    torch.testing.assert_close(aggregation_weights("sequence", action, episode), torch.tensor([0.5, 0.25, 1.0]))
    torch.testing.assert_close(aggregation_weights("episode", action, episode), torch.tensor([1 / 6, 1 / 6, 1.0]))


def test_episode_aggregation_gives_each_episode_equal_weight():
    # episode A: 3 tokens with advantage +1 ; episode B: 1 token with advantage -1 ; ratio 1
    logp = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    token = ppo_clip_loss(logp, logp, adv, mask)
    episode = ppo_clip_loss(logp, logp, adv, mask, weights=torch.tensor([1 / 3, 1.0]))
    assert math.isclose(token.loss.item(), -(3 - 1) / 4, rel_tol=1e-6)
    assert math.isclose(episode.loss.item(), 0.0, abs_tol=1e-7)  # +1 and -1 episodes cancel


def test_kl_estimators_k1_k2_k3():
    from turnforge.algos import kl_estimate

    logp = torch.log(torch.tensor([0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.5]))
    d = math.log(2)  # logp - ref = +ln2, -ln2
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([d, -d]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([d * d / 2, d * d / 2]))
    # k3 = exp(ref - logp) - (ref - logp) - 1: [0.5 + ln2 - 1, 2 - ln2 - 1]
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([d - 0.5, 1 - d]))


def test_dual_clip_bounds_negative_advantage_loss_and_its_gradient():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[5.0, 5.0]])).requires_grad_(True)
    adv = torch.tensor([[-1.0, 1.0]])
    out = ppo_clip_loss(new, old, adv, torch.ones(1, 2), 0.2, 0.2, dual_clip=3.0)
    # token 0: min(5 * -1, 1.2 * -1) = -5, dual clip max(-5, 3 * -1) = -3 ; token 1: min(5, 1.2) = 1.2
    assert math.isclose(out.loss.item(), -(-3.0 + 1.2) / 2, rel_tol=1e-6)
    out.loss.backward()
    torch.testing.assert_close(new.grad, torch.zeros(1, 2))  # both tokens are on a clipped branch


def test_entropy_bonus_is_subtracted():
    z = torch.zeros(1, 2)
    ent = torch.tensor([[1.0, 3.0]])
    out = ppo_clip_loss(z, z, z, torch.tensor([[0.0, 1.0]]), entropy=ent, entropy_coef=0.1)
    assert math.isclose(out.loss.item(), -0.3, rel_tol=1e-6)


def test_entropy_floor_penalty_hand_computed():
    from turnforge.algos import entropy_floor_penalty

    ent = torch.tensor([[9.0, 0.2, 0.4], [9.0, 9.0, 0.9]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])  # mean entropy over the actions: (0.2 + 0.4 + 0.9) / 3 = 0.5
    out = entropy_floor_penalty(ent, mask, floor=0.8, coef=2.0)
    assert math.isclose(out.item(), 2.0 * (0.8 - 0.5), rel_tol=1e-6)
    out.backward()  # d/dH_i = -coef / 3 on the masked positions, 0 elsewhere
    torch.testing.assert_close(ent.grad, torch.tensor([[0.0, -2 / 3, -2 / 3], [0.0, 0.0, -2 / 3]]))
    above = torch.tensor([[0.0, 0.9, 0.9]], requires_grad=True)
    zero = entropy_floor_penalty(above, torch.tensor([[0.0, 1.0, 1.0]]), floor=0.8, coef=2.0)
    zero.backward()
    assert zero.item() == 0.0 and not above.grad.any()  # at or above the floor: no pull at all


def test_signed_nll_hand_computed():
    from turnforge.algos import signed_nll

    # row 0: a success, weight 1, two action tokens: -(-0.5 - 1.0) = 1.5
    # row 1: a failure, weight -0.5, one action token of p = 0.5: 0.5 x 1 x -log(1 - 0.5) = 0.5 ln 2
    lp = torch.tensor([[-0.5, -1.0], [-math.log(2.0), -3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss = signed_nll(lp, mask, torch.tensor([1.0, -0.5]))
    assert math.isclose(loss.item(), (1.5 + 0.5 * math.log(2.0)) / 3, rel_tol=1e-6)
    loss.backward()
    # d/dlp of 0.5 x -log(1 - e^lp) = 0.5 x p / (1 - p) = 0.5 at p = 0.5; over 3 tokens; the masked token: 0
    assert torch.allclose(lp.grad, torch.tensor([[-1 / 3, -1 / 3], [0.5 / 3, 0.0]]))


def test_signed_nll_is_weighted_nll_without_negatives_and_bounded_near_certainty():
    from turnforge.algos import signed_nll

    lp = torch.tensor([[-0.2, -0.7], [-1.5, -0.1]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    w = torch.tensor([0.5, 2.0])
    assert torch.equal(signed_nll(lp, mask, w), weighted_nll(lp, mask, w))
    # a failed action the policy is sure of: p clamped to 1 - 1e-6, a finite loss of -log(1e-6)
    sure = signed_nll(torch.zeros(1, 1), torch.ones(1, 1), torch.tensor([-1.0]))
    assert math.isfinite(sure.item()) and math.isclose(sure.item(), -math.log(1e-6), rel_tol=1e-3)
