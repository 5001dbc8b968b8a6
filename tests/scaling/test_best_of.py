"""``turnforge eval --best-of`` on a real tiny run: the oracle row is the run's pass@k on the same
episodes, the table repeats for the same seed, the critic selector reads the run's value model;
vote on hand-made attempts; bad input."""

from __future__ import annotations

import json

import pytest

from helpers import run_main
from turnforge.scaling.best_of import run_best_of
from turnforge.types import Task, Trajectory, Turn

def _eval(run, tmp_path, monkeypatch, capsys, *args):
    return run_main(["eval", run / "checkpoints" / "final", "--episodes", "8", *args], tmp_path, monkeypatch, capsys)


def test_oracle_is_pass_at_k_and_the_table_repeats(critic_run, tmp_path, monkeypatch, capsys):
    code, _, err = _eval(critic_run, tmp_path, monkeypatch, capsys, "--pass-at-k", "4", "--out", tmp_path / "p.json")
    assert code == 0, err
    pass_at_k = {p["k"]: p["value"] for p in json.loads((tmp_path / "p.json").read_text())["boundary"]["pass_at_k"]}
    for name in ("a", "b"):
        code, _, err = _eval(critic_run, tmp_path, monkeypatch, capsys, "--best-of", "1,2,4", "--select", "oracle,logprob,critic",
                             "--out", tmp_path / f"{name}.json")
        assert code == 0, err
    a, b = (json.loads((tmp_path / f"best_of_{n}.json").read_text()) for n in ("a", "b"))
    oracle = next(c for c in a["curves"] if c["selector"] == "oracle")
    assert a["ns"] == [1, 2, 4] and a["attempts"] == 4 and a["tasks"] == 8
    assert oracle["success"] == pytest.approx([pass_at_k[k] for k in (1, 2, 4)])  # the same episodes as --pass-at-k 4
    assert 0 < oracle["success"][0] < oracle["success"][2]  # attempts differ: something to select
    assert [c["success"] for c in a["curves"]] == [c["success"] for c in b["curves"]]  # same seed, same table
    critic = next(c for c in a["curves"] if c["selector"] == "critic")
    assert all(0.0 <= v <= 1.0 for v in critic["success"]) and critic["success"][0] == pytest.approx(oracle["success"][0])
    assert (tmp_path / "best_of_a.png").stat().st_size > 0 and "| oracle |" in (tmp_path / "best_of_a.md").read_text()


def _attempt(i: int, answer: str, ok: bool) -> Trajectory:
    turn = Turn("q", f"<answer>{answer}</answer>", float(ok), False, "")
    return Trajectory(f"t{i}", Task("calc", "heldout", 0), "g", i, (turn,), (), float(ok), ok, True, False, None, 0)


def test_vote_picks_the_majority_answer():
    class Env:
        env_id = "calc"

        def final_answer(self, text):
            return text.removeprefix("<answer>").removesuffix("</answer>")

    attempts = [_attempt(0, "7", True), _attempt(1, "7", True), _attempt(2, "3", False), _attempt(3, "5", False)]
    r = run_best_of(attempts, 4, (1, 3), ("oracle", "vote"), Env(), split="heldout", temperature=1.0, seed=0, play_seconds=1.0)
    oracle, vote = r.curves
    assert oracle.success == pytest.approx((0.5, 1.0))  # pass@3 with 2 successes in 4: 1 - C(2,3)/C(4,3) = 1
    # triples: {7,7,3} 1, {7,7,5} 1, {7,3,5} 1/3 twice (a three-way tie) -> (1 + 1 + 2/3) / 4
    assert vote.success == pytest.approx((0.5, (2 + 2 / 3) / 4)) and r.seconds_per_attempt == 0.25
    assert vote.gap_closed == pytest.approx(((2 + 2 / 3) / 4 - 0.5) / 0.5) and vote.auc is None


@pytest.mark.parametrize("args, expected", [
    (["--best-of", "0,2"], "--best-of '0,2': every N must be >= 1"),
    (["--best-of", "two"], "--best-of 'two': give comma-separated attempt counts"),
    (["--best-of", "4", "--select", "oracle,mc"], "unknown selector 'mc'; valid selectors: oracle, logprob, vote, critic"),
    (["--best-of", "4", "--select", "vote"], "--select vote compares final answers: env 'frozenlake' has none"),
    (["--best-of", "4", "--pass-at-k", "4"], "--best-of plays the pass@k episodes itself"),
])
def test_best_of_bad_input(critic_run, tmp_path, monkeypatch, capsys, args, expected):
    code, _, err = _eval(critic_run, tmp_path, monkeypatch, capsys, *args, "--out", tmp_path / "x.json")
    assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "best_of_x.json").exists()


def test_the_critic_selector_needs_the_runs_value_model(tiny_model_dir, tmp_path, monkeypatch, capsys):
    code, _, err = run_main(["eval", tiny_model_dir, "--env", "frozenlake", "--episodes", "2", "--best-of", "2",
                             "--select", "critic", "--out", tmp_path / "x.json"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "--select critic needs the run's learned value model: checkpoint" in err and "not inside a run directory" in err
