"""The CLI: user errors print one line and exit 2, with no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import run_main


def run_cli(*args, cwd=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "turnforge.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["train", "nope-recipe"], "unknown recipe 'nope-recipe'"),
        (["train", "rl.itertions=2"], "unknown config key 'rl.itertions'"),
        (["train", "env.id=chess"], "unknown env 'chess'; valid envs:"),
        (["train", "env.kwargs.bogus=1"], "env 'sokoban' has no option 'bogus'; valid options:"),
        (["train", "model.path=/no/such/model"], "model path '/no/such/model' does not exist"),
        (["eval", "/no/such/ckpt"], "model path '/no/such/ckpt' does not exist"),
        (["train", "--resume", "/no/such/run"], "no config.yaml there"),
        (["train", "cluster=ray", "engine.mode=async", "engine.ray_address=127.0.0.1:1"], "cannot reach a Ray cluster at '127.0.0.1:1'"),
        (["train", "engine.eta=2"], "engine.eta=2 needs engine.mode=async"),
        (["train", "engine.mode=async", "engine.partial_rollouts=true"], "engine.partial_rollouts=true needs engine.eta >= 1"),
        (["train", "engine.env_slots=4"], "engine.env_slots=4 cannot hold one group of rl.group_size=8"),
        (["train", "env.id=sokoban", "rl.advantage=gigpo", "env.id=test-nope"], "unknown env 'test-nope'"),
        (["train", "frozenlake-tiny", "env.id=2048", "rl.shaping=potential"],
         "potential-based shaping (rl.shaping=potential) needs env '2048' to implement potential(), or set rl.shaping=none"),
        (["train", "env.tasks=/no/such/tasks.jsonl"], "env 'sokoban' generates its own levels (a LevelEnv); env.tasks applies"),
        (["check-env", "chess"], "unknown env 'chess'; valid envs:"),
        (["check-env", "sokoban", "bogus=1"], "env 'sokoban' has no option 'bogus'"),
        (["train", "calculator-tiny", "rollout.context=window"], "env 'calculator' answers with tool messages"),
        (["train", "calculator-tiny", "env.kwargs.tool_call_format=xml"], "unknown tool_call_format 'xml'"),
        (["train", "env.id=sokoban-slow", "env.kwargs.median_ms=-1", "engine.env_workers=2"],
         "env 'sokoban-slow' could not be built with options {'median_ms': -1}: ValueError: median_ms"),
    ],
)
def test_user_errors_exit_2_with_one_line(tmp_path, monkeypatch, capsys, args, expected):
    if args[0] == "train" and "--resume" not in args:
        args = [*args, "--out", str(tmp_path / "run")]
    if "cluster=ray" in args:  # a real process: a failed ray.init leaves state behind in this one
        proc = run_cli(*args, cwd=tmp_path)
        code, stderr = proc.returncode, proc.stderr
    else:
        code, _, stderr = run_main(args, tmp_path, monkeypatch, capsys)
    assert code == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "run").exists()


def test_check_env_takes_options_and_a_task_file(tmp_path):
    ok = run_cli("check-env", "sokoban", "dim=7")
    assert ok.returncode == 0 and "sokoban: ok" in ok.stdout, ok.stderr
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(f'{{"n": {i}, "split": "{"heldout" if i < 2 else "train"}"}}\n' for i in range(20)))
    # a level env generates its own tasks: a task file is refused with the reason
    refused = run_cli("check-env", "sokoban", "--tasks", str(tasks))
    assert refused.returncode == 2 and "generates its own levels" in refused.stderr


def test_check_env_failure_is_one_line_with_exit_1(tmp_path):
    plugin = tmp_path / "tinyheld.py"
    plugin.write_text(
        "from turnforge import Env, StepResult, TaskDataset\n"
        "class OneHeldout(Env):\n"
        "    action_names = ('go',)\n"
        "    tasks = TaskDataset([{'n': i, 'split': 'heldout' if i == 0 else 'train'} for i in range(30)])\n"
        "    def reset(self, task, seed):\n"
        "        return f'task {task.data[\"n\"]}'\n"
        "    def step(self, action):\n"
        "        ok = action.strip() == 'go'\n"
        "        return StepResult('done' if ok else 'say go', 1.0 if ok else -0.1, ok, False, invalid_action=not ok, success=ok)\n"
    )
    dist = tmp_path / "tinyheld-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tinyheld\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[turnforge.envs]\none-heldout = tinyheld:OneHeldout\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "turnforge.cli", "check-env", "one-heldout"], capture_output=True,
                          text=True, env=env, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr
    assert "held-out split has only 1 task(s)" in lines[0] and "give it at least 10 distinct tasks" in lines[0]
    ok = subprocess.run([sys.executable, "-m", "turnforge.cli", "check-env", "one-heldout", "--min-heldout", "1"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0 and "one-heldout: ok" in ok.stdout, ok.stderr
    # train refuses it at start, before any model work, with the same fix
    train = subprocess.run([sys.executable, "-m", "turnforge.cli", "train", "env.id=one-heldout", "bc.enabled=false",
                            "flywheel.rounds=0",
                            "--out", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
    assert train.returncode == 2 and "fails check_env" in train.stderr and "at least 10" in train.stderr
    assert not (tmp_path / "run").exists()


def test_recipes_and_envs_list(tmp_path, monkeypatch, capsys):
    proc = run_cli("recipes")
    assert proc.returncode == 0 and "sokoban-tiny" in proc.stdout
    # piped (not a terminal): whole lines, never cut to 80 columns; --json for programs
    from turnforge.envs import list_envs, register, registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    long_id = "an-env-with-a-long-id-that-an-80-column-table-would-cut-" + "x" * 30
    register(long_id, "turnforge.envs.sokoban:SokobanEnv", dim=6, num_boxes=1, max_steps=120)
    code, stdout, _ = run_main(["envs"], tmp_path, monkeypatch, capsys)
    rows = [line.split("\t") for line in stdout.splitlines()]
    assert code == 0 and [r[0] for r in rows] == list(list_envs())
    assert [long_id, "builtin", '{"dim": 6, "num_boxes": 1, "max_steps": 120}'] in rows
    code, stdout, _ = run_main(["envs", "--json"], tmp_path, monkeypatch, capsys)
    listed = {e["id"]: e for e in json.loads(stdout)}
    assert code == 0 and listed[long_id]["defaults"] == {"dim": 6, "num_boxes": 1, "max_steps": 120}
    assert listed["frozenlake-slippery"] == {"id": "frozenlake-slippery", "source": "builtin",
                                              "defaults": {"size": 4, "is_slippery": True}}
