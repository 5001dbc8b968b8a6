"""The whole loop on a tiny model on CPU: BC -> eval -> GRPO -> eval -> checkpoint, resume."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
from helpers import NO_FLYWHEEL, TINY_TEST_SHAPE
from safetensors.torch import load_file

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.app.setup import load_run_config
from turnforge.train.metrics import read_metrics, read_summary

pytestmark = pytest.mark.slow

FAST = [
    *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()], *NO_FLYWHEEL,
    "bc.num_demos=8", "bc.epochs=2", "bc.batch_size=8",
    "rl.iterations=3", "rl.tasks_per_iteration=3", "rl.group_size=2", "rl.minibatch_size=16",
    "rollout.max_turns=6", "eval.episodes=6", "eval.every=1", "checkpoint_every=1",
]


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def test_end_to_end_run_dir_contract(tmp_path):
    out = tmp_path / "run"
    summary = train(load_config("sokoban-tiny", FAST + ["rl.kl_coef=0.01"]), out, live=False)

    # summary.json contract: the typed summary the run returned, read back
    assert read_summary(out) == summary
    assert summary.eval_before_rl.episodes == summary.eval_after_rl.episodes == 6
    assert summary.env_steps > 0 and summary.train_tokens > 0 and summary.rl_iterations == 3
    assert summary.bc is not None and summary.bc.demonstrations == 8
    assert summary.peak_memory is not None and summary.peak_memory.process_mib > 100  # torch alone is more

    # every trainable parameter changed between the initial and the final model
    before, after = _weights(out / "base_model"), _weights(out / "checkpoints" / "final")
    assert before.keys() == after.keys()
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, unchanged

    # HF-format checkpoint loads with the Auto classes
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "final")
    tok = AutoTokenizer.from_pretrained(out / "checkpoints" / "final")
    assert model.config.vocab_size == len(tok) and tok.chat_template

    # trajectories: one row per sample, token columns aligned, logprobs null where not sampled
    table = pq.read_table(out / "trajectories" / "rl_00000.parquet")
    for col in ("task_id", "group_id", "token_ids", "logprobs", "loss_mask", "reward", "success", "num_turns", "policy_version"):
        assert col in table.column_names
    for row in table.to_pylist():
        assert len(row["token_ids"]) == len(row["logprobs"]) == len(row["loss_mask"])
        for lp, m in zip(row["logprobs"], row["loss_mask"]):
            assert (lp is None) == (m == 0)
    assert table.num_rows == sum(1 for _ in table.column("turn_index"))
    demos = pq.read_table(out / "trajectories" / "bc_demos.parquet").to_pylist()
    assert demos and all(all(lp is None for lp in r["logprobs"]) for r in demos)

    # metrics, TensorBoard, plot, config snapshot
    metrics = read_metrics(out)
    assert [e.tag for e in metrics.evals] == ["before-rl", "rl-1", "rl-2", "after-rl"]
    assert [m.iteration for m in metrics.iterations] == [1, 2, 3] and len(metrics.bc_epochs) == 2
    assert all(m.update.kl_ref >= 0 and m.rollout.episodes == 6 for m in metrics.iterations)
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tb").iterdir())
    assert (out / "learning_curve.png").stat().st_size > 10_000
    assert load_run_config(out).rl.iterations == 3

    # turnforge eval on the final checkpoint prints and writes the eval dict
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "turnforge.cli", "eval", str(out / "checkpoints" / "final"), "--env", "sokoban",
         "--episodes", "6", "--seed", "0", "--split", "heldout"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    written = json.loads((out / "checkpoints" / "final" / "eval_sokoban_heldout.json").read_text())
    assert json.loads(proc.stdout) == written
    # greedy evaluation of the same checkpoint on the same tasks equals the run's own final eval
    assert written["success_rate"] == summary.eval_after_rl.success_rate
    assert written["mean_return"] == summary.eval_after_rl.mean_return


def test_resume_ends_with_the_same_weights(tmp_path, fast_run):
    cfg = load_config("sokoban-tiny", FAST)
    partial = train(cfg, tmp_path / "b", live=False, stop_after=1)
    assert partial is None
    assert not (tmp_path / "b" / "summary.json").exists()
    train(load_run_config(tmp_path / "b"), tmp_path / "b", resume=True, live=False)
    a, b = _weights(fast_run / "checkpoints" / "final"), _weights(tmp_path / "b" / "checkpoints" / "final")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = read_summary(fast_run), read_summary(tmp_path / "b")
    assert sa.eval_after_rl == sb.eval_after_rl and sa.env_steps == sb.env_steps
    assert sa.train_tokens == sb.train_tokens
    # metrics of the resumed run hold each RL iteration once
    assert [m.iteration for m in read_metrics(tmp_path / "b").iterations] == [1, 2, 3]


def test_env_crash_is_excluded_and_run_goes_on(tmp_path):
    overrides = FAST + ["env.id=test-echo", "env.kwargs={crash_on: 1, episode_len: 2}", "bc.enabled=false", "check_env=false",
                        "max_failure_share=0.5"]  # a third of the held-out tasks crash
    summary = train(load_config("sokoban-tiny", overrides), tmp_path / "run", live=False)
    # tasks with index % 4 == 0 crash on their first step: excluded from eval, counted
    assert summary.eval_after_rl.infra_failures == 2  # held-out tasks 0 and 4 of 6
    assert summary.eval_after_rl.episodes == 4
    table = pq.read_table(tmp_path / "run" / "trajectories" / "rl_00000.parquet").to_pylist()
    crashed = [r for r in table if r["infra_failure"]]
    assert all(r["advantage"] is None for r in crashed)
    assert all(r["advantage"] is not None for r in table if not r["infra_failure"])


def test_nan_loss_steps_are_skipped_then_the_run_stops(tmp_path, monkeypatch):
    import turnforge.train.update as grpo_mod
    from turnforge.optim import NonFiniteLoss

    real = grpo_mod.ppo_clip_loss

    def nan_loss(*args, **kwargs):
        out = real(*args, **kwargs)
        return type(out)(out.loss * float("nan"), out.clip_fraction, out.approx_kl, out.kl_ref)

    monkeypatch.setattr(grpo_mod, "ppo_clip_loss", nan_loss)
    with pytest.raises(NonFiniteLoss, match="3 optimizer steps in a row had a NaN/inf loss"):
        train(load_config("sokoban-tiny", FAST + ["rl.max_bad_steps=3", "rl.skip_zero_variance_groups=false"]), tmp_path / "run", live=False)
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert events[-1]["event"] in ("rl_iter", "eval")


def test_any_local_hf_model_trains_through_the_hf_recipe(tmp_path):
    """A GPT-2-architecture model saved on disk goes through the same command path."""
    from turnforge.config import TinyModelConfig
    from turnforge.policy.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "gpt2", TinyModelConfig(architecture="gpt2", **TINY_TEST_SHAPE))
    overrides = [f"model.path={model_dir}", "bc.num_demos=4", "bc.epochs=1", "rl.iterations=1",
                 "rl.tasks_per_iteration=2", "rl.group_size=2", "rollout.max_turns=3", "rollout.max_new_tokens=4",
                 "eval.episodes=4", "rl.lr=0.001"]
    summary = train(load_config("sokoban-hf", overrides), tmp_path / "run", live=False)
    assert summary.model == str(model_dir) and summary.eval_after_rl.episodes == 4
    before, after = _weights(model_dir), _weights(tmp_path / "run" / "checkpoints" / "final")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_calculator_recipe_trains_with_tool_calls(tmp_path):
    """The tool recipe end to end: tool schemas and hermes calls, tool messages, counters."""
    overrides = [*[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()], "model.tiny.corpus_episodes=20",
                 "bc.num_demos=16", "bc.epochs=1", "rl.iterations=2", "rl.tasks_per_iteration=2", "rl.group_size=2",
                 "eval.episodes=4", "eval.every=1", "eval.pass_at_k_samples=0"]
    summary = train(load_config("calculator-tiny", overrides), tmp_path / "run", live=False)
    assert summary.env_id == "calculator" and summary.eval_after_rl.episodes == 4
    iters = read_metrics(tmp_path / "run").iterations
    assert len(iters) == 2 and all("n_tool_calls" in m.env_events or m.invalid_action_rate == 1.0 for m in iters)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "base_model")
    demos = pq.read_table(tmp_path / "run" / "trajectories" / "bc_demos.parquet").to_pylist()
    text = tok.decode(demos[0]["token_ids"])  # full_history: one whole-episode sample per demonstration
    assert text.count("<tool_call>") == 1 and "<|im_start|>tool\n" in text and "<answer>" in text


def test_actions_longer_than_max_new_tokens_are_reported(tmp_path, capsys):
    """Every Sokoban move is a word plus the stop token: with one new token per turn each one is
    cut. The run says so at start (with the number needed) and again when its rollouts show it."""
    summary = train(load_config("sokoban-tiny", FAST + ["rollout.max_new_tokens=1"]), tmp_path / "run", live=False)
    assert summary.rl_iterations == 3
    warnings = [w.message for w in read_metrics(tmp_path / "run").warnings]
    assert any("do not fit rollout.max_new_tokens=1" in w and "set rollout.max_new_tokens=" in w for w in warnings)
    assert any("hit rollout.max_new_tokens=1 before a stop token" in w for w in warnings)
    assert "warning: " in capsys.readouterr().err


def test_a_log_without_a_tty_has_lines_per_stage_not_per_step(tmp_path, capsys):
    """BC used to print one line per optimizer step without a terminal (1,254 in the default
    job). Now: a line per stage and message, progress at most every 10 s, and the last line
    states the gain against the BC policy at its best temperature, naming it."""
    cfg = load_config("sokoban-tiny", FAST + ["bc.batch_size=1", "rl.iterations=1", "eval.bc_temperatures=[1.0, 0.3]"])
    summary = train(cfg, tmp_path / "run", live=False)
    lines = capsys.readouterr().err.splitlines()
    assert summary.bc.optimizer_steps >= 50  # one step per sample
    bc_lines = [line for line in lines if line.startswith("[bc] ")]
    # the stage's last step, plus at most one line per 10 s of the run (whatever the machine's speed)
    assert 1 <= len(bc_lines) <= 1 + summary.wall_seconds / 10
    assert bc_lines[-1].startswith(f"[bc] {summary.bc.optimizer_steps}/{summary.bc.optimizer_steps}")
    assert len(lines) < 60 + summary.wall_seconds / 10, lines
    best = summary.eval_bc_best_temperature
    assert lines[-1].startswith(f"done in {summary.wall_seconds:.0f}s: held-out success {summary.eval_after_rl.success_rate:.3f}")
    assert (f"points against the BC policy at its best temperature (T={best.temperature:g}: {best.eval.success_rate:.3f})"
            in lines[-1])


def test_tempered_collection_trains_the_distribution_it_sampled(tmp_path):
    """Episodes sampled at T = 0.7 are scored at T = 0.7 by the update: with one minibatch step
    per iteration and a negligible learning rate the PPO ratio is 1 on every token (nothing
    clipped, KL ~0); scored at T = 1 instead, the KL of this nearly uniform tiny start is 1.5e-3
    (checked by breaking the update that way)."""
    over = FAST + ["rollout.temperature=0.7", "rl.epochs=1", "rl.minibatch_size=4096", "rl.lr=1e-9",
                   "rl.skip_zero_variance_groups=false"]
    train(load_config("sokoban-tiny", over), tmp_path / "run", live=False)
    for m in read_metrics(tmp_path / "run").iterations:
        assert m.update.clip_fraction == 0 and abs(m.update.approx_kl) < 1e-4, m.update
