"""Fixtures of the viewer tests: one small real run (built once, shared by the pytest workers),
a synthetic run with judge verdicts and gateway splits, and headless Debian Chromium driven by
Playwright (``executable_path=/usr/bin/chromium``; never a downloaded browser build).

Without Chromium or Playwright the browser tests skip, naming ``make setup``; under CI
(``CI=true``) they fail instead, so a machine that lost the set-up cannot pass silently."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # view_bench: synthesize_run

from view_bench import CHROMIUM, CHROMIUM_ARGS, synthesize_run  # noqa: E402

#: A tiny run with every stage the overview shows: BC (2 temperatures), a flywheel round and 2
#: RL iterations, on the echo test env, whose tasks with index % 4 == 0 crash on their second
#: step: infrastructure failures in every stage. The flywheel evaluates on 3 episodes, the run on
#: 4: evaluations of two sizes (and, BC's, of two temperatures).
RUN_OVERRIDES = [
    "env.id=test-echo", "env.kwargs={crash_on: 2, episode_len: 3, max_obs_words: 8}", "check_env=false",
    "max_failure_share=0.9", "bc.num_demos=8", "bc.expert_noise=0", "bc.epochs=1", "bc.batch_size=8",
    "rollout.max_turns=4", "eval.episodes=4", "eval.every=1", "eval.bc_temperatures=[1.0,0.5]",
    "rl.iterations=2", "rl.tasks_per_iteration=2", "rl.group_size=3",
    "flywheel.rounds=1", "flywheel.env_steps_per_round=20", "flywheel.tasks_per_wave=4", "flywheel.eval_episodes=3",
    "flywheel.mechanisms=[replay]", "flywheel.filters=[infra,loops,dedup]", "flywheel.group_size=2",
    "flywheel.replay_max_success=1.0",
]


def _shared_dir(tmp_path_factory) -> Path:
    """A directory every pytest-xdist worker of this session sees (the base temp's parent under
    xdist, the base temp itself otherwise)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _once(tmp_path_factory, name: str, make) -> Path:
    """``make(path)`` once per session across workers (a file lock), then the path."""
    root = _shared_dir(tmp_path_factory)
    path = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / ".complete").exists():
            shutil.rmtree(path, ignore_errors=True)
            make(path)
            (path / ".complete").write_text("")
    return path


@pytest.fixture(scope="session")
def view_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A finished tiny run (see ``RUN_OVERRIDES``) from the session's tiny model; read-only for
    the tests."""
    def make(path: Path) -> None:
        from turnforge.app.config import load_config
        from turnforge.app.run import train

        train(load_config("sokoban-tiny", [*RUN_OVERRIDES, f"model.path={tiny_model_dir}"]), path, live=False)

    return _once(tmp_path_factory, "view_run", make)


@pytest.fixture(scope="session")
def view_run_b(tmp_path_factory, view_run) -> Path:
    """A second run for the side-by-side view: a copy of ``view_run`` (the same tasks)."""
    return _once(tmp_path_factory, "view_run_b", lambda path: shutil.copytree(view_run, path))


#: What a run that measures what its policy can solve (issue 31) may add to summary.json and
#: metrics.jsonl: the page shows any such field, whatever its exact name.
DIAGNOSTICS = {"pass_at_k": {"1": 0.25, "8": 0.5}, "never_solved_share": 0.125}


@pytest.fixture(scope="session")
def judged_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A synthetic run (the store writer, the tiny tokenizer) whose episodes carry judge
    verdicts, with two gateway splits for its first episode, and pass@k figures in its
    summary and evaluation records."""
    run = synthesize_run(tmp_path_factory.mktemp("judged") / "run", tiny_model_dir, samples=60, group_size=3, max_turns=3,
                         groups_per_iteration=3, judge=True, splits=True).path
    result = {"env_id": "frozenlake", "split": "heldout", "episodes": 8, "success_rate": 0.25, "mean_return": 0.25,
              "invalid_action_rate": 0.0, "mean_turns": 3.0, "infra_failures": 0}
    summary = {"recipe": "synthetic", "wall_seconds": 60.0, "env_steps": 60, "eval_before_rl": result,
               "eval_after_rl": {**result, "success_rate": 0.5}, "success_gain_points": 25.0, "diagnostics": DIAGNOSTICS}
    (run / "summary.json").write_text(json.dumps(summary))
    with (run / "metrics.jsonl").open("a") as f:
        for it, p8 in ((1, 0.4), (2, 0.6)):
            f.write(json.dumps({"event": "eval", "tag": f"pass-{it}", "iteration": it, "env_steps": 100 * it, "time": 0.0,
                                "result": {**result, "pass_at_8": p8}}) + "\n")
    return run


@pytest.fixture(scope="session")
def browser():
    """Headless Debian Chromium through Playwright, one per worker."""
    why = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        why = "the playwright package is missing"
    if why is None and not Path(CHROMIUM).exists():
        why = f"Debian's chromium is missing ({CHROMIUM})"
    if why is not None:
        message = f"{why}: run `make setup` (it installs chromium and the dev extra)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser):
    """A fresh page whose JavaScript errors fail the test."""
    pg = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    pg.on("pageerror", lambda err: errors.append(str(err)))
    pg.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    yield pg
    pg.close()
    assert not errors, errors


@pytest.fixture(scope="session")
def segment_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A tiny RL run with ``rollout.context=summarize`` on the echo env, its threshold low enough
    that every episode has several segments, each but the last ending in the policy's summary;
    episodic memory recalls from a store of one success (every echo observation shares a word
    with it), so every segment opens with a memory block."""
    def make(path: Path) -> None:
        from turnforge.app.config import load_config
        from turnforge.app.run import train
        from turnforge.config import MemoryConfig
        from turnforge.rollout.episodic import EpisodicMemory, MemoryEntry
        from turnforge.runs import RunDir

        store = path.parent / f"{path.name}-memory"
        store.mkdir(exist_ok=True)
        words = "the box wall floor target up down left right # _ . $ @ 2 4 8 16 hole goal"  # test-echo's words
        EpisodicMemory(MemoryConfig(enabled=True), "test-echo",
                       [MemoryEntry("test-echo:train:0", "t", "rl", 0, "plain", words, ("up",))]).write(RunDir(store).memory)
        train(load_config("sokoban-tiny", [
            "memory.enabled=true", f"memory.store={store}", "memory.max_tokens=24",
            "env.id=test-echo", "env.kwargs={episode_len: 8, max_obs_words: 8}", "check_env=false", "bc.enabled=false",
            "flywheel.rounds=0", "eval.bc_temperatures=[]", "eval.pass_at_k_samples=0", "eval.episodes=2",
            "rollout.context=summarize", "rollout.max_turns=8", "rollout.max_context_tokens=256",
            "rollout.summary_threshold=120", "rollout.summary_prompt=Summary?", "rollout.summary_max_tokens=6",
            "rl.iterations=1", "rl.tasks_per_iteration=2", "rl.group_size=2", f"model.path={tiny_model_dir}"]), path, live=False)

    return _once(tmp_path_factory, "segment_run", make)


@pytest.fixture(scope="session")
def image_run(tmp_path_factory) -> Path:
    """A tiny gui-click run of the tiny vision-language model: every sample holds one screenshot."""
    def make(path: Path) -> None:
        from helpers import NO_FLYWHEEL, TINY_TEST_SHAPE

        from turnforge.app.config import load_config
        from turnforge.app.run import train

        train(load_config("gui-click-tiny", [
            *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()], *NO_FLYWHEEL,
            "model.tiny.vision.image_size=56", "model.tiny.vision.hidden_size=32", "model.tiny.vision.intermediate_size=64",
            "model.tiny.corpus_episodes=20", "env.kwargs.size=64", "bc.num_demos=4", "bc.epochs=1",
            "rl.iterations=1", "rl.tasks_per_iteration=2", "rl.group_size=2", "eval.episodes=2"]), path, live=False)

    return _once(tmp_path_factory, "image_run", make)
