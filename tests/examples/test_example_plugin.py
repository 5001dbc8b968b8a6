"""The example env plugin (``examples/turnforge-example-envs``), installed as a third party
would install it: its envs are found through the ``turnforge.envs`` entry points, pass
``turnforge check-env`` (with options, with a task file, with a tokenizer), and train through
the public command line: Lights Out (generated tasks) and Guess the Number (tasks from JSONL)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import TINY_TEST_SHAPE
from turnforge.train.metrics import read_metrics, read_summary

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "turnforge-example-envs"
TASKS = EXAMPLE / "turnforge_example_envs" / "guess_number_tasks.jsonl"
SMALL = [
    *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()], "threads=1", "bc.num_demos=40", "bc.epochs=1",
    "rl.iterations=2", "rl.tasks_per_iteration=2", "rl.group_size=4", "eval.episodes=10", "eval.every=0",
    "eval.pass_at_k_samples=0",
]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example package installed (no dependencies, no index) into a fresh directory, built
    from a copy so that nothing is written into the source tree."""
    source = tmp_path_factory.mktemp("src") / EXAMPLE.name
    shutil.copytree(EXAMPLE, source)
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, capture_output=True, timeout=300)
    return target


def turnforge(site: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-m", "turnforge.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def test_plugin_envs_are_registered_and_pass_check_env(site, tiny_model_dir):
    listed = turnforge(site, "envs")
    assert listed.returncode == 0 and "lightsout" in listed.stdout and "guess-number" in listed.stdout
    assert "entry point" in listed.stdout
    ok = turnforge(site, "check-env", "lightsout", "size=4", "presses=5")
    assert ok.returncode == 0 and "lightsout: ok" in ok.stdout, ok.stderr
    ok = turnforge(site, "check-env", "guess-number", "--tasks", str(TASKS))
    assert ok.returncode == 0 and "guess-number: ok" in ok.stdout, ok.stderr
    # without a task file the dataset env says how to give it one
    missing = turnforge(site, "check-env", "guess-number")
    assert missing.returncode == 1 and "set env.tasks=PATH.jsonl" in missing.stderr and "Traceback" not in missing.stderr
    # "[2 3]" and the stop token need 6 tiny-tokenizer tokens: 4 would cut every action, a failure naming the budget
    short = turnforge(site, "check-env", "lightsout", "--model", str(tiny_model_dir), "--max-new-tokens", "4")
    assert short.returncode == 1 and "needs 6 tokens with the stop token: give --max-new-tokens 6 or more" in short.stderr
    enough = turnforge(site, "check-env", "lightsout", "--model", str(tiny_model_dir), "--max-new-tokens", "6")
    assert enough.returncode == 0 and "lightsout: ok" in enough.stdout, enough.stderr


@pytest.mark.parametrize("recipe", ["lightsout-tiny", "guess-number-tiny"])
def test_plugin_env_trains_two_iterations(site, tmp_path, recipe):
    run = tmp_path / recipe
    proc = turnforge(site, "train", str(EXAMPLE / "recipes" / f"{recipe}.yaml"), "--out", str(run), *SMALL, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = read_summary(run)
    assert summary.rl_iterations == 2 and summary.eval_after_rl.episodes == 10
    assert summary.bc is not None and summary.bc.demonstrations == 40
    assert [m.iteration for m in read_metrics(run).iterations] == [1, 2]
    bc = load_file(str(run / "checkpoints" / "bc" / "model.safetensors"))
    base = load_file(str(run / "base_model" / "model.safetensors"))
    assert any(not torch.equal(base[k], bc[k]) for k in base)  # behaviour cloning trained on the plugin's expert
