"""The README's "Bring your own env" example is complete: it runs as printed, passes
check_env, and trains through the public API."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import NO_FLYWHEEL, TINY_TEST_SHAPE

from turnforge.app.config import load_config
from turnforge.envs import registry

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    section = README.read_text().split("## Bring your own env", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_readme_is_short_and_has_no_history():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    for phrase in ("this session", "previous default"):
        assert phrase not in text.lower()


@pytest.mark.slow
def test_readme_env_example_runs_checks_and_trains(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    exec(compile(readme_example(), str(README), "exec"), {"__name__": "readme_example"})  # registers and checks it
    from turnforge.app.run import train

    overrides = [*NO_FLYWHEEL, "env.id=guess-64", "bc.expert_noise=0", *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()],
                 "threads=1", "bc.num_demos=40", "bc.epochs=2", "rl.iterations=2", "rl.tasks_per_iteration=2",
                 "rl.group_size=4", "eval.episodes=12", "eval.every=0"]
    summary = train(load_config("sokoban-tiny", overrides), tmp_path / "run", live=False)
    assert summary.env_id == "guess-64" and summary.rl_iterations == 2 and summary.eval_after_rl.episodes == 12
    assert summary.bc.expert_success_rate == 1.0  # binary search always finds the number
