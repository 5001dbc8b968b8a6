"""The decoupled update on the tiny model: the trainer re-scores the samples at the temperature they
were sampled at (TRL #4159: ratio 2.0 at T = 0.6 when the trainer scored at T = 1), and the update
weighs them with the correction ``engine.correction`` names, its ratios in ``UpdateStats``."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from helpers import inline_engine

from turnforge.config import EngineConfig, RLConfig, RolloutConfig
from turnforge.optim import GuardedStep
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest
from turnforge.train.update import ppo_update

CFG = RolloutConfig(max_turns=2, max_new_tokens=6)


@pytest.fixture()
def sampled(tiny_policy):
    """Samples of 4 test-echo episodes ``tiny_policy`` played at T = 0.6 with the built-in (KV-cache) sampler."""
    engine = inline_engine(tiny_policy, "test-echo", CFG, n=4)
    reqs = [EpisodeRequest(engine.env.task("train", i), i, f"g{i}", f"t{i}") for i in range(4)]
    trajs, _ = engine.play(reqs, PolicyActor(tiny_policy, CFG.max_new_tokens, 0.6, torch.Generator().manual_seed(0)))
    samples = [x for t in trajs for x in t.samples]
    assert sum(x.num_action_tokens for x in samples) >= 20
    return samples


def _update(policy, samples, temperature, engine=None, whole=False):
    """One decoupled update with learning rate 0 (the weights stay those that sampled): its
    ``OffPolicyStats`` (``whole``: its ``UpdateStats``)."""
    step = GuardedStep(policy.model, torch.optim.SGD(policy.model.parameters(), lr=0.0), 1.0, 3)
    pairs = [(x, 1.0 if i % 2 else -1.0) for i, x in enumerate(samples)]
    rl = RLConfig(merge_duplicates=False, skip_zero_variance_groups=False)
    stats = ppo_update(policy, pairs, step, rl, temperature=temperature, shuffle=np.random.default_rng(0),
                       decoupled=True, engine=engine)
    return stats if whole else stats.offpolicy


def test_the_update_rescores_at_the_sampling_temperature(tiny_policy, sampled):
    off = _update(tiny_policy, sampled, 0.6)
    # same weights, same tokens, same temperature: every ratio pi_prox / pi_behav is 1 up to float error
    for q in (off.token_ratio_p1, off.token_ratio_p50, off.token_ratio_p99, off.sequence_ratio_p1, off.sequence_ratio_p99):
        assert q == pytest.approx(1.0, abs=1e-5)
    assert off.log_ratio_abs_max < 1e-5 and off.is_weight_max == pytest.approx(1.0, abs=1e-5)
    # scored at T = 1 instead, the same tokens are off by far more than the numerics
    wrong = _update(tiny_policy, sampled, 1.0)
    assert wrong.token_ratio_p1 < 0.9 and wrong.token_ratio_p99 > 1.05 and wrong.log_ratio_abs_max > 0.1
    assert wrong.ratio_out_of_band > 0.05  # the mismatch watch sees it too


def test_the_update_asks_the_chosen_correction(tiny_policy, sampled):
    """Scored at T = 1 the ratios spread; a tight token band masks the tokens outside it, a tight
    sequence band the rows, and truncated IS masks nothing."""
    tis = _update(tiny_policy, sampled, 1.0)
    assert tis.masked_fraction == 0.0
    tokens = _update(tiny_policy, sampled, 1.0, EngineConfig(correction="token_mask", token_mask={"lo": 0.99, "hi": 1.01}))
    assert 0 < tokens.masked_fraction < 1 and tokens.masked_fraction == tokens.is_truncated_fraction
    rows = _update(tiny_policy, sampled, 1.0, EngineConfig(correction="sequence_mask", sequence_mask={"lo": 0.999, "hi": 1.001}))
    assert 0 < rows.sequence_out_of_band <= 1 and rows.masked_fraction > 0
    # the ratios do not depend on the correction, only what it makes of them
    assert (tis.token_ratio_p1, tis.sequence_ratio_p99) == (tokens.token_ratio_p1, rows.sequence_ratio_p99)


def test_the_ratio_distribution_is_in_the_record_the_viewer_charts(tiny_policy, sampled, tmp_path):
    from turnforge.view.rundir import read_series

    update = _update(tiny_policy, sampled, 1.0, whole=True)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "rl_iter", "update": dataclasses.asdict(update)}) + "\n")
    table = read_series(tmp_path / "metrics.jsonl")[0]["rl_iter"]
    row = dict(zip(table.columns, table.rows[0]))
    for name in ("token_ratio_p1", "token_ratio_p50", "token_ratio_p99", "sequence_ratio_p1", "sequence_ratio_p50",
                 "sequence_ratio_p99", "sequence_out_of_band", "masked_fraction", "is_truncated_fraction"):
        assert isinstance(row[f"update.offpolicy.{name}"], float)
    assert row["update.offpolicy.token_ratio_p1"] < row["update.offpolicy.token_ratio_p50"] < row["update.offpolicy.token_ratio_p99"]
