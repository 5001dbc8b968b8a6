"""The CLI: user errors print one line and exit 2, with no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


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
        (["bench", "rollout", "--env", "chess"], "unknown benchmark env 'chess'"),
        (["train", "calculator-tiny", "rollout.context=window"], "env 'calculator' answers with tool messages"),
        (["train", "calculator-tiny", "env.kwargs.tool_call_format=xml"], "unknown tool_call_format 'xml'"),
        (["train", "env.id=sokoban-slow", "env.kwargs.median_ms=-1", "engine.env_workers=2"],
         "env 'sokoban-slow' could not be built with options {'median_ms': -1}: ValueError: median_ms"),
    ],
)
def test_user_errors_exit_2_with_one_line(tmp_path, args, expected):
    if args[0] == "train" and "--resume" not in args:
        args = [*args, "--out", str(tmp_path / "run")]
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_recipes_and_envs_list(tmp_path):
    proc = run_cli("recipes")
    assert proc.returncode == 0 and "sokoban-tiny" in proc.stdout
    proc = run_cli("envs")
    assert proc.returncode == 0 and "frozenlake-slippery" in proc.stdout and "2048" in proc.stdout
