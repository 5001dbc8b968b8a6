"""``turnforge merge --sweep`` on two real tiny runs (a Sokoban and a FrozenLake specialist of one
base): every point is evaluated on both envs as ``turnforge eval`` would, so the end points repeat
each run's own final evaluation exactly, and so does the sanity check after one merge;
``--toward init`` interpolates toward the base."""

from __future__ import annotations

import json

import pytest
from helpers import NO_FLYWHEEL, run_main

QUICK = [*NO_FLYWHEEL, "bc.num_demos=6", "bc.epochs=1", "bc.batch_size=8", "rl.iterations=0", "eval.episodes=3",
         "rollout.max_turns=8", "check_env=false"]  # (8: frozenlake's demonstrations reach the goal, or BC refuses them)


@pytest.fixture(scope="module")
def specialists(tiny_model_dir, tmp_path_factory):
    from turnforge.app.config import load_config
    from turnforge.app.run import train

    root = tmp_path_factory.mktemp("specialists")
    for recipe in ("sokoban-tiny", "frozenlake-tiny"):
        train(load_config(recipe, [*QUICK, f"model.path={tiny_model_dir}"]), root / recipe, live=False)
    return root / "sokoban-tiny", root / "frozenlake-tiny"


def test_the_sweep_evaluates_every_point_on_both_envs(specialists, tmp_path, monkeypatch, capsys):
    a, b = specialists
    code, out, err = run_main(["merge", a / "checkpoints" / "final", b / "checkpoints" / "final", "--sweep", "3",
                               "--episodes", "3", "--out", tmp_path / "sw"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    record = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert [p["t"] for p in record["points"]] == [0, 0.5, 1]
    assert all(set(p["results"]) == {"sokoban", "frozenlake"} for p in record["points"])
    own = [json.loads((run / "summary.json").read_text())["eval_after_rl"] for run in (a, b)]
    ends = record["points"][0]["results"]["sokoban"], record["points"][-1]["results"]["frozenlake"]
    for mine, theirs in zip(ends, own):  # t = 0 is the Sokoban model, t = 1 the FrozenLake one: their final evaluations
        assert (mine["success_rate"], mine["mean_return"], mine["mean_turns"]) == \
            (theirs["success_rate"], theirs["mean_return"], theirs["mean_turns"])
    assert (tmp_path / "sw" / "sweep.png").stat().st_size > 0 and "| t | sokoban | frozenlake |" in out
    assert all((tmp_path / "sw" / f"t={t}" / "manifest.json").exists() for t in ("0", "0.5", "1"))


def test_the_check_after_one_merge_evaluates_the_checkpoints_as_their_runs_did(specialists, tmp_path, monkeypatch, capsys):
    """With --episodes equal to the runs' eval.episodes, each checkpoint's figures in the check
    are its run's own final evaluation."""
    a, b = specialists
    code, out, err = run_main(["merge", a / "checkpoints" / "final", b / "checkpoints" / "final", "--episodes", "3",
                               "--out", tmp_path / "m"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    lines = {line.split()[2]: line for line in out.splitlines() if line.startswith("check on ")}
    assert set(lines) == {"sokoban", "frozenlake"}
    for run, env in ((a, "sokoban"), (b, "frozenlake")):
        own = json.loads((run / "summary.json").read_text())["eval_after_rl"]
        assert (f"checkpoints/final') success {own['success_rate']:.3f}, invalid {own['invalid_action_rate']:.0%}"
                in lines[env].split("; ", 1)[1]) and lines[env].count("; ") == 1  # the merge, then its one checkpoint


def test_toward_init_interpolates_to_the_base(specialists, tiny_model_dir, tmp_path, monkeypatch, capsys):
    a, _ = specialists  # trained from tiny_model_dir (model.path)
    code, out, err = run_main(["merge", a / "checkpoints" / "final", "--toward", "init", "--base", tiny_model_dir,
                               "--sweep", "2", "--episodes", "3", "--out", tmp_path / "li"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    record = json.loads((tmp_path / "li" / "sweep.json").read_text())
    assert [set(p["results"]) for p in record["points"]] == [{"sokoban"}, {"sokoban"}]
    assert record["parents"][1] == str(tiny_model_dir.resolve())


@pytest.mark.parametrize("args, expected", [
    (["--toward", "start"], "--toward 'start': the only valid value is 'init'"),
    (["--toward", "init"], "--toward init interpolates a checkpoint toward its start weights: give --base INIT"),
    (["--sweep", "1"], "--sweep 1: give at least 2 points"),
    (["--sweep", "3", "--weights", "0.5,0.5"], "--sweep sets the weights (1 - t, t) itself; leave out --weights"),
])
def test_sweep_and_toward_bad_input(specialists, tmp_path, monkeypatch, capsys, args, expected):
    a, b = specialists
    code, _, err = run_main(["merge", a / "checkpoints" / "final", *(() if "--toward" in args else (b / "checkpoints" / "final",)),
                             *args, "--out", tmp_path / "x"], tmp_path, monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines() == [f"error: {err.strip()[7:]}"] and expected in err
    assert not (tmp_path / "x").exists()


def test_a_sweep_needs_checkpoints_inside_their_runs(specialists, tmp_path, monkeypatch, capsys):
    import shutil

    a, b = specialists
    loose = shutil.copytree(a / "checkpoints" / "final", tmp_path / "loose")
    code, _, err = run_main(["merge", loose, b / "checkpoints" / "final", "--sweep", "2", "--out", tmp_path / "x"],
                            tmp_path, monkeypatch, capsys)
    assert code == 2 and "is not inside a run directory (RUN/checkpoints/<name>/ next to RUN/config.yaml)" in err
    assert not (tmp_path / "x").exists()
