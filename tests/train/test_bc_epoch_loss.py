"""BC's logged loss per epoch (``bc_epoch``) is the epoch's mean per action token: its
minibatches' losses weighted by their action tokens, not the last minibatch's."""

from __future__ import annotations

import pytest
from helpers import NO_FLYWHEEL

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.train import bc as bc_module
from turnforge.train.metrics import read_metrics


def test_bc_epoch_loss_is_the_token_weighted_mean_of_its_minibatches(tmp_path, tiny_model_dir, monkeypatch):
    losses, tokens = [], []  # each minibatch's loss and action tokens, as the trainer sees them
    passes, weighted = bc_module.micro_batches, bc_module.share_weighted

    def micro_batches(rows, weight, length, budget):
        tokens.append(sum(weight(r) for r in rows))
        return passes(rows, weight, length, budget)

    def share_weighted(values, shares):
        out = weighted(values, shares)
        losses.append(out[0][0])
        return out

    monkeypatch.setattr(bc_module, "micro_batches", micro_batches)
    monkeypatch.setattr(bc_module, "share_weighted", share_weighted)
    cfg = load_config("sokoban-tiny", [
        *NO_FLYWHEEL, f"model.path={tiny_model_dir}", "env.id=test-echo", "env.kwargs={episode_len: 3, max_obs_words: 8}",
        "check_env=false", "bc.num_demos=4", "bc.expert_noise=0", "bc.epochs=2", "bc.batch_size=3",
        "rollout.max_turns=4", "eval.episodes=1", "rl.iterations=0"])
    train(cfg, tmp_path / "run", live=False)
    epochs = read_metrics(tmp_path / "run").bc_epochs
    per_epoch = len(losses) // 2
    assert len(epochs) == 2 and per_epoch >= 3 and len(losses) == len(tokens) == 2 * per_epoch
    for e, record in enumerate(epochs):
        ls, ts = losses[e * per_epoch:(e + 1) * per_epoch], tokens[e * per_epoch:(e + 1) * per_epoch]
        assert len(set(ts)) > 1 or len(set(ls)) > 1  # the minibatches differ: the mean is not any one of them
        assert record.loss == pytest.approx(sum(x * t for x, t in zip(ls, ts)) / sum(ts), rel=1e-9)
        assert record.loss != pytest.approx(ls[-1], rel=1e-6)  # not the epoch's last minibatch
