"""One RL iteration's learning step, built by hand: real tiny-model episodes of the echo env,
credit, ``learn`` (the policy and critic updates) and ``iteration_record``, without a run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import inline_engine

from turnforge.app.config import load_config
from turnforge.optim import GuardedStep
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest
from turnforge.train.credit import assign_credit
from turnforge.train.metrics import StreamStats
from turnforge.train.rl import iteration_record, learn
from turnforge.train.rollouts import RolloutBatch


def _cfg(*overrides: str):
    return load_config("sokoban-tiny", ["env.id=test-echo", "rl.advantage=psr", "rl.group_size=3", "rl.minibatch_size=4",
                                        "rl.lr=0.01", "rollout.max_turns=2", "rollout.max_new_tokens=4",
                                        "flywheel.rounds=0", *overrides])


def _batch(policy, cfg, successes: list[bool]):
    """Two groups of three echo episodes sampled by the policy, their success flags set by hand
    (psr reads only the flag)."""
    engine = inline_engine(policy, "test-echo", cfg.rollout, n=6, episode_len=2, max_obs_words=4)
    requests = [EpisodeRequest(engine.env.task("train", i // 3), i, f"g{i // 3}", f"t{i}") for i in range(6)]
    actor = PolicyActor(policy, cfg.rollout.max_new_tokens, 1.0, torch.Generator().manual_seed(0))
    trajs, stats = engine.play(requests, actor)
    trajs = [dataclasses.replace(t, success=ok) for t, ok in zip(trajs, successes)]
    stream = StreamStats(env_steps_executed=stats.turns, trainer_wait_seconds=0.0, trainer_idle_ratio=0.0,
                         stale_restarts=0, resumed_steps=0, mean_generation_batch=6.0)
    return trajs, RolloutBatch(trajs, stats, stats.turns, stream)


def _step(policy, cfg):
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=cfg.rl.lr, weight_decay=0.0)
    return GuardedStep(policy.model, optimizer, cfg.rl.max_grad_norm, cfg.rl.max_bad_steps)


def test_learn_trains_on_the_credited_samples_and_the_record_counts_them(tiny_policy):
    cfg = _cfg()
    trajs, got = _batch(tiny_policy, cfg, [True, False, False, True, True, False])
    credit = assign_credit(trajs, cfg, 0, pad_id=tiny_policy.pad_id)
    before = {k: v.clone() for k, v in tiny_policy.model.state_dict().items()}
    learned = learn(trajs, credit, cfg, 0, tiny_policy, _step(tiny_policy, cfg))
    after = tiny_policy.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert learned.critic is None  # psr reads no state values
    assert learned.update.tokens == sum(len(x) for x, _ in credit.samples) * cfg.rl.epochs  # every token of every row read
    record = iteration_record(0, trajs, got, credit, learned, rollout_seconds=1.0, credit_seconds=0.5, lr=cfg.rl.lr,
                              skipped_steps=0, policy_version=1)
    assert record.iteration == 1 and record.success == pytest.approx(3 / 6)
    assert record.reward == pytest.approx(sum(t.episode_return for t in trajs) / 6)
    assert record.samples == len(credit.samples) == sum(len(t.samples) for t in trajs)  # both groups carry signal
    assert record.zero_variance_groups == 0.0 and record.mean_turns == pytest.approx(sum(t.num_turns for t in trajs) / 6)


def test_a_batch_without_signal_leaves_the_weights_alone(tiny_policy):
    cfg = _cfg()  # rl.skip_zero_variance_groups: groups whose advantages are all zero are left out
    trajs, got = _batch(tiny_policy, cfg, [False] * 6)
    credit = assign_credit(trajs, cfg, 0, pad_id=tiny_policy.pad_id)
    before = {k: v.clone() for k, v in tiny_policy.model.state_dict().items()}
    learned = learn(trajs, credit, cfg, 0, tiny_policy, _step(tiny_policy, cfg))
    assert all(torch.equal(before[k], v) for k, v in tiny_policy.model.state_dict().items())
    record = iteration_record(0, trajs, got, credit, learned, rollout_seconds=1.0, credit_seconds=0.5, lr=cfg.rl.lr,
                              skipped_steps=0, policy_version=1)
    assert record.samples == 0 and record.zero_variance_groups == 1.0 and record.success == 0.0
