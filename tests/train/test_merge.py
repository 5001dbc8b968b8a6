"""Merging repeated samples: hand-computed rows, and the merged PPO loss equals the
unmerged one (value and gradients) on a real tiny model with the clip active."""

import math

import numpy as np
import pytest
import torch

from turnforge.algos import aggregation_weights, ppo_clip_loss
from turnforge.policy.generate import token_logprobs
from turnforge.policy.model import load_policy
from turnforge.train.common import collate
from turnforge.train.merge import merge_samples, minibatches
from turnforge.types import Sample


def make_sample(ids, action_len, logprob, traj="t", turn=0, version=0):
    ids = np.asarray(ids, np.int64)
    mask = np.zeros(len(ids), np.int8)
    mask[-action_len:] = 1
    lp = np.full(len(ids), np.nan, np.float32)
    lp[-action_len:] = logprob
    versions = np.where(mask == 1, version, -1).astype(np.int32)
    return Sample(ids, mask, lp, versions, traj, turn)


def test_merge_hand_computed():
    a = make_sample([5, 6, 7, 8], 2, -1.0, traj="e0")
    a2 = make_sample([5, 6, 7, 8], 2, -1.000002, traj="e1")  # same tokens, batched-generation numerics
    a3 = make_sample([5, 6, 7, 8], 2, -1.0, traj="e2")
    b = make_sample([5, 6, 7, 9], 2, -0.5, traj="e0", turn=1)
    stale = make_sample([5, 6, 7, 8], 2, -1.0, traj="e3", version=1)  # another policy version: kept apart
    rows = merge_samples([(a, 1.0), (a2, 3.0), (b, 0.5), (a3, -2.0), (stale, 1.0)], [0.5, 0.25, 1.0, 1.0, 1.0])
    assert [r.count for r in rows] == [2, 1, 1, 1]
    pos = rows[0]
    # weights 0.5 and 0.25: W = 0.75, A = (0.5 * 1 + 0.25 * 3) / 0.75 = 5/3
    assert math.isclose(pos.weight, 0.75) and math.isclose(pos.advantage, 5 / 3)
    np.testing.assert_allclose(pos.sample.logprobs[-2:], [-1.000001, -1.000001], rtol=1e-7)
    assert np.isnan(pos.sample.logprobs[0])
    assert rows[1].sample is b and rows[1].advantage == 0.5
    assert rows[2].advantage == -2.0 and rows[2].weight == 1.0  # the negative copy stays its own row
    assert rows[3].sample is stale


def test_minibatches_count_represented_samples():
    a = make_sample([1, 2], 1, -1.0)
    rows = merge_samples([(a, 1.0)] * 5 + [(make_sample([1, 3], 1, -1.0), 1.0), (make_sample([1, 4], 1, -1.0), 1.0)], [1.0] * 7)
    assert [r.count for r in rows] == [5, 1, 1]
    assert minibatches(rows, [1, 0, 2], 4) == [[1, 0], [2]]
    assert minibatches(rows, [1, 2, 0], 4) == [[1, 2, 0]]


@pytest.mark.parametrize("loss_agg", ["token", "episode"])
def test_merged_loss_and_gradient_equal_unmerged(tiny_model_dir, loss_agg):
    policy = load_policy(str(tiny_model_dir))
    model = policy.model
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 9, 5)]
    actions = [torch.randint(3, vocab, (2,), generator=g).tolist() for _ in range(3)]
    # sampling logprobs: the model's own, shifted so ratios land on both sides of the clip
    raw = []
    for k, (p, act) in enumerate([(0, 0), (0, 0), (0, 1), (1, 2), (0, 0), (1, 2), (2, 0), (0, 0)]):
        ids = prompts[p] + actions[act]
        raw.append((ids, f"ep{k % 3}", k))
    samples, advs = [], [1.5, 0.7, -1.0, 2.0, -0.4, 2.0, 0.3, 0.9]
    with torch.no_grad():
        for ids, traj, k in raw:
            x = make_sample(ids, 2, 0.0, traj=traj, turn=k)
            b = collate([x], policy.pad_id)
            lp, _ = token_logprobs(model, b.ids, b.attention, 1.0)
            shift = 0.3 if len(ids) % 2 else -0.3
            x.logprobs[-2:] = lp[0, -2:].numpy() + shift
            samples.append(x)
    pairs = list(zip(samples, advs))
    ep_tokens = {}
    for x in samples:
        ep_tokens[x.trajectory_id] = ep_tokens.get(x.trajectory_id, 0) + x.num_action_tokens
    weights = aggregation_weights(
        loss_agg, torch.tensor([x.num_action_tokens for x in samples]), torch.tensor([ep_tokens[x.trajectory_id] for x in samples])
    )

    def loss_and_grads(rows_samples, rows_advs, rows_weights):
        model.zero_grad(set_to_none=True)
        b = collate(rows_samples, policy.pad_id, rows_advs)
        lp, ent = token_logprobs(model, b.ids, b.attention, 1.0, with_entropy=True)
        out = ppo_clip_loss(lp, b.old_logprobs, b.advantages, b.mask, weights=rows_weights, entropy=ent, entropy_coef=0.01)
        out.loss.backward()
        return out, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain, plain_grads = loss_and_grads(samples, advs, weights)
    rows = merge_samples(pairs, weights.tolist())
    assert len(rows) < len(samples)
    merged, merged_grads = loss_and_grads(
        [r.sample for r in rows], [r.advantage for r in rows], torch.tensor([r.weight for r in rows], dtype=torch.float32)
    )
    assert plain.clip_fraction > 0  # the clip is active, so the merge rule is exercised
    torch.testing.assert_close(merged.loss, plain.loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(merged_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_one_trajectory_one_weight_however_many_calls_or_splits():
    """rl.loss_agg=episode: an agent run whose calls became three samples (splits) weighs, summed over
    its action tokens, what a one-call episode weighs: 1 each (the rule agent runs train under)."""
    from turnforge.config import RLConfig
    from turnforge.train.update import weighted_rows

    def sample(traj, n_actions, turn):
        ids = np.arange(3 + n_actions, dtype=np.int64) + 10 * turn
        mask = np.array([0, 0, 0] + [1] * n_actions, np.int8)
        lp = np.where(mask == 1, -0.5, np.nan).astype(np.float32)
        return Sample(ids, mask, lp, np.where(mask == 1, 0, -1).astype(np.int32), traj, turn)

    split = [(sample("agent", n, k), 1.0) for k, n in enumerate((4, 5, 6))]
    single = [(sample("one-call", 7, 0), 1.0)]
    rows = weighted_rows(split + single, RLConfig(loss_agg="episode", merge_duplicates=False))
    total = {}
    for row in rows:
        total[row.sample.trajectory_id] = total.get(row.sample.trajectory_id, 0.0) + row.weight * row.sample.num_action_tokens
    assert total == pytest.approx({"agent": 1.0, "one-call": 1.0})
    tokens = weighted_rows(split + single, RLConfig(loss_agg="token", merge_duplicates=False))  # the default: by tokens
    assert sum(r.weight * r.sample.num_action_tokens for r in tokens if r.sample.trajectory_id == "agent") == 15
