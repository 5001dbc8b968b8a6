"""A whole run with episodic memory: demonstrations in waves (later ones shown earlier ones), the
flywheel's and RL's successes added, evaluations shown the memory and never added to it, a
resumed run retrieving exactly what an uninterrupted one does, and ``memory.store``."""

from __future__ import annotations

import hashlib
import json
import shutil

import duckdb
import pyarrow.parquet as pq
import pytest
from helpers import TINY_TEST_SHAPE, run_main
from transformers import AutoTokenizer

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.app.setup import load_run_config
from turnforge.rollout.episodic import HEADER
from turnforge.train.metrics import read_summary

pytestmark = pytest.mark.slow

FAST = [
    *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()], "memory.enabled=true", "memory.demo_waves=2",
    "eval.bc_temperatures=[]", "eval.pass_at_k_samples=0",
    "bc.num_demos=8", "bc.epochs=1", "bc.batch_size=8",
    "flywheel.rounds=1", "flywheel.env_steps_per_round=40", "flywheel.eval_episodes=4", "flywheel.tasks_per_wave=4",
    "flywheel.filters=[infra]", "flywheel.mechanisms=[]",
    "rl.iterations=3", "rl.tasks_per_iteration=2", "rl.group_size=2", "rl.minibatch_size=16",
    "rollout.max_turns=5", "eval.episodes=4", "eval.every=0", "checkpoint_every=1",
]


def _sha(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_memory_run_recalls_its_own_successes_and_resumes_exactly(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    summary = train(load_config("sokoban-tiny", FAST), out, live=False)
    memory = pq.read_table(out / "memory.parquet").to_pylist()
    assert memory and {r["env_id"] for r in memory} == {"sokoban"}
    assert all(r["task_id"].startswith("sokoban:train:") for r in memory)  # evaluations never add
    assert {r["stage"] for r in memory} >= {"bc"}
    heldout = {r[0] for r in duckdb.sql(f"SELECT DISTINCT task_id FROM '{out}/trajectories/*.parquet'").fetchall()
               if "heldout" in r[0]}
    assert not heldout & {r["task_id"] for r in memory}
    assert summary.eval_after_rl.memory_recall_rate == 1.0  # every held-out episode was shown a past success
    # the second wave of demonstrations was shown the first wave's (BC learns prompts with a memory block)
    tokenizer = AutoTokenizer.from_pretrained(out / "base_model")
    first = duckdb.sql(f"SELECT trajectory_id, token_ids FROM '{out}/trajectories/bc_demos.parquet' "
                       "WHERE turn_index = 0 ORDER BY trajectory_id").fetchall()
    shown = {tid: HEADER in tokenizer.decode(ids) for tid, ids in first}
    assert shown == {f"demo-{i}": i >= 4 for i in range(8)}
    # interrupted after RL iteration 1 and resumed: the same weights and the same memory
    other = tmp_path / "resumed"
    train(load_config("sokoban-tiny", FAST), other, live=False, stop_after=1)
    resumed = train(load_run_config(other), other, resume=True, live=False)
    assert _sha(other / "checkpoints" / "final") == _sha(out / "checkpoints" / "final")
    assert pq.read_table(other / "memory.parquet").to_pylist() == memory
    assert resumed.eval_after_rl == read_summary(out).eval_after_rl
    # `turnforge eval` of the final checkpoint recalls from the run's memory: the run's final evaluation, exactly
    code, _, err = run_main(["eval", out / "checkpoints" / "final", "--out", tmp_path / "eval.json"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    assert evaluated["settings"]["memory"] == {"store": str(out), "tasks": len(memory), "k": 1}
    assert {k: evaluated[k] for k in ("success_rate", "mean_return", "mean_turns", "memory_recall_rate")} == {
        k: getattr(summary.eval_after_rl, k) for k in ("success_rate", "mean_return", "mean_turns", "memory_recall_rate")}
    elsewhere = shutil.copytree(out / "checkpoints" / "final", tmp_path / "elsewhere")  # no run directory around it
    code, _, err = run_main(["eval", elsewhere, "--config", out / "config.yaml"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "memory.enabled=true recalls a run's memory: evaluate a checkpoint inside its run directory" in err
    # another run retrieves from this one's memory, read-only
    reader = tmp_path / "reader"
    train(load_config("sokoban-tiny", [*FAST, f"memory.store={out}", "flywheel.rounds=0", "rl.iterations=1"]), reader,
          live=False)
    assert not (reader / "memory.parquet").exists()
    assert read_summary(reader).eval_before_rl.memory_recall_rate == 1.0
