"""``turnforge merge``'s sanity check and its sweep's evaluations, with evaluations counted:
the thresholds on hand-made figures; a merge that broke its checkpoints gets one warning line
naming the drop and what to try; each point of a sweep of two checkpoints of one run is
evaluated once; ``--no-check`` evaluates nothing. (The evaluations themselves are real in
``test_merge_sweep.py``.)"""

from __future__ import annotations

import shutil

import pytest

from helpers import run_main
from turnforge.merge import sweep
from turnforge.merge.check import advice, problems
from turnforge.merge.methods import MergeSpec
from turnforge.merge.sweep import eval_targets, run_sweep
from turnforge.types import EvalResult


def _result(success: float, invalid: float) -> EvalResult:
    return EvalResult("sokoban", "heldout", 20, success, 0.0, invalid, 10.0)


def test_problems_name_a_collapse_and_an_invalid_jump_not_noise():
    parents = [_result(0.25, 0.01), _result(0.20, 0.03)]
    assert problems(_result(0.0, 0.92), parents) == ["success 0.000 against the checkpoints' 0.250 / 0.200",
                                                     "invalid actions 92% against at most 3%"]
    assert problems(_result(0.15, 0.05), parents) == []  # a smaller loss is within what 20 episodes can tell
    assert problems(_result(0.0, 0.0), [_result(0.10, 0.0)]) == []  # 2 of 20 against 0: noise
    assert problems(_result(0.30, 0.25), parents) == ["invalid actions 25% against at most 3%"]
    assert "higher --density (now 0.2" in advice(MergeSpec("ties", (1.0, 1.0)))
    assert "--method linear or slerp" in advice(MergeSpec("task_arithmetic", (1.0, 1.0)))


@pytest.fixture
def one_run(tiny_model_dir, tmp_path):
    """A run directory with two checkpoints (copies of the tiny model) and its base."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("env:\n  id: sokoban\n")
    for name in ("bc", "final"):
        shutil.copytree(tiny_model_dir, run / "checkpoints" / name)
    return run


@pytest.fixture
def calls(monkeypatch):
    """Every ``evaluate_on`` call (model directory name, target label); the merge scores 0 with
    92% invalid actions, a checkpoint 0.25 with 1%."""
    seen: list[tuple[str, str]] = []

    def fake(model, target, episodes):
        seen.append((model.name, target.label))
        return _result(0.25, 0.01) if model.name in ("bc", "final") else _result(0.0, 0.92)

    monkeypatch.setattr(sweep, "evaluate_on", fake)
    return seen


def test_a_sweep_of_two_checkpoints_of_one_run_evaluates_each_point_once(one_run, calls, tmp_path):
    parents = [one_run / "checkpoints" / "bc", one_run / "checkpoints" / "final"]
    targets = eval_targets(parents, ["a", "b"])
    assert [(t.label, t.parents) for t in targets] == [("sokoban", (0, 1))]  # one run: one target
    rows = run_sweep(parents, tmp_path / "sw", MergeSpec("linear", (0.5, 0.5)), None, 3, 4, targets, log=lambda _: None)
    assert calls == [("t=0", "sokoban"), ("t=0.5", "sokoban"), ("t=1", "sokoban")]
    assert [list(r.results) for r in rows] == [["sokoban"]] * 3


def test_the_check_warns_in_one_line_when_the_merge_broke_its_checkpoints(one_run, calls, tmp_path, monkeypatch, capsys):
    ckpts = one_run / "checkpoints"
    code, out, err = run_main(["merge", ckpts / "bc", ckpts / "final", "--base", ckpts / "bc", "--method", "ties",
                               "--out", tmp_path / "m"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert calls == [("m", "sokoban"), ("bc", "sokoban"), ("final", "sokoban")]  # the merge, then each checkpoint
    assert "check on sokoban (20 held-out episodes): merged success 0.000, invalid 92%;" in out
    warnings = [line for line in out.splitlines() if line.startswith("warning")]
    assert warnings == ["warning the ties merge looks broken on sokoban: success 0.000 against the checkpoints' 0.250 / 0.250, "
                        "invalid actions 92% against at most 1%; try --method linear or slerp, or a higher --density (now 0.2: "
                        "the share of each task vector kept; dense task vectors, as fine-tuning every weight gives, lose most "
                        "of what they learned)"]
    calls.clear()
    code, out, err = run_main(["merge", ckpts / "bc", ckpts / "final", "--no-check", "--out", tmp_path / "m2"],
                              tmp_path, monkeypatch, capsys)
    assert code == 0 and calls == [] and "check on" not in out


def test_no_check_without_a_run_and_no_check_with_a_sweep(tiny_model_dir, one_run, calls, tmp_path, monkeypatch, capsys):
    loose = shutil.copytree(tiny_model_dir, tmp_path / "loose")
    code, out, err = run_main(["merge", loose, tiny_model_dir, "--out", tmp_path / "m"], tmp_path, monkeypatch, capsys)
    assert code == 0 and calls == [] and "no sanity check: no checkpoint sits in its run directory" in out
    ckpts = one_run / "checkpoints"
    code, _, err = run_main(["merge", ckpts / "bc", ckpts / "final", "--sweep", "2", "--no-check", "--out", tmp_path / "x"],
                            tmp_path, monkeypatch, capsys)
    assert code == 2 and "--no-check skips the sanity check of one merge; --sweep evaluates every point" in err
