"""A tiny flywheel round with advantage-weighted regression on Monte-Carlo Q values
(``flywheel.weighting=mc_awr``) on slippery FrozenLake: every turn of the round's episodes is
weighted, the restarts count in the round's env steps and in the run's, every parameter trains."""

from __future__ import annotations

import torch
from helpers import TINY_TEST_SHAPE
from safetensors.torch import load_file

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.train.metrics import read_metrics

AWR = [
    *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()],
    "env.kwargs.is_slippery=true", "env.kwargs.hole_prob=0.1", "bc.num_demos=20", "bc.epochs=4", "bc.batch_size=8",
    "rollout.max_turns=10",
    "eval.episodes=4", "eval.bc_temperatures=[]", "eval.pass_at_k_samples=0", "rl.iterations=0",
    "flywheel.rounds=1", "flywheel.env_steps_per_round=40", "flywheel.tasks_per_wave=2", "flywheel.group_size=2",
    "flywheel.allocation=uniform", "flywheel.mechanisms=[]", "flywheel.eval_episodes=4",
    "flywheel.weighting=mc_awr", "flywheel.mc_restarts=2", "flywheel.awr_beta=0.05",
    "threads=1",  # the tiny model's kernels are faster on one thread than on two contended ones
]


def test_a_flywheel_round_with_mc_awr(tmp_path):
    out = tmp_path / "run"
    summary = train(load_config("frozenlake-tiny", AWR), out, live=False)
    (r,) = read_metrics(out).flywheel
    a = r.awr
    assert a is not None and a.failed == 0
    # the restarts ran after each wave (more than one here) and count in the round's budget and the run's env steps
    collected = r.round_env_steps - a.env_steps
    assert a.env_steps > 0 and collected > 0 and r.round_env_steps >= 40
    assert summary.env_steps == summary.bc.demo_env_steps + r.round_env_steps
    # K restarts of every distinct state (V) and of every distinct action taken in one (Q)
    assert a.restarts == 2 * (a.states + a.actions) and a.actions >= a.states
    # every turn of every episode played is trained on, failed ones included, with its own weight
    assert a.samples == collected == r.rft_samples and r.plain[0] > r.plain[1]
    assert 0 < a.ess < 1 and a.mean_abs_advantage > 0 and 0 < a.mean_weight <= 20
    # the weighted fine-tuning changed every parameter tensor of the BC policy
    before, after = (load_file(str(out / "checkpoints" / name / "model.safetensors")) for name in ("bc", "final"))
    assert before.keys() == after.keys() and not [k for k in before if torch.equal(before[k], after[k])]
    assert "## Advantage-weighted regression" in (out / "flywheel_report.md").read_text()


def test_a_flywheel_round_with_group_awr(tmp_path):
    """No restarts: the advantages come from the group's other visits to a state; the turns of
    states visited once are left out."""
    out = tmp_path / "run"
    overrides = [x for x in AWR if not x.startswith("flywheel.mc_restarts")]
    summary = train(load_config("frozenlake-tiny", overrides + ["flywheel.weighting=group_awr", "flywheel.group_size=4"]),
                    out, live=False)
    (r,) = read_metrics(out).flywheel
    a = r.awr
    assert a is not None and a.restarts == a.env_steps == 0 and r.round_env_steps >= 40
    assert summary.env_steps == summary.bc.demo_env_steps + r.round_env_steps
    assert 0 < a.samples <= r.round_env_steps and a.samples == r.rft_samples  # every group shares its first state
    assert 0 < a.states <= a.actions and a.mean_abs_advantage > 0
