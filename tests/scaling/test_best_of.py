"""``turnforge eval --best-of`` on a real tiny run: the oracle row is the run's pass@k on the same
episodes, the table repeats for the same seed, the critic selector reads the run's value model;
vote on hand-made attempts; bad input."""

from __future__ import annotations

import dataclasses
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


def test_mc_and_judge_selectors_on_a_real_run(critic_run, tmp_path, monkeypatch, capsys):
    """mc plays rollouts from the attempts' snapshots without changing the attempts (the oracle row
    is the one without it) and repeats for the same seed; judge (the checkpoint itself, yes/no)
    scores every attempt."""
    code, _, err = _eval(critic_run, tmp_path, monkeypatch, capsys, "--best-of", "1,2,4", "--select", "oracle",
                         "--out", tmp_path / "plain.json")
    assert code == 0, err
    for name in ("a", "b"):
        code, _, err = _eval(critic_run, tmp_path, monkeypatch, capsys, "--best-of", "1,2,4", "--select", "oracle,mc,judge",
                             "--mc-rollouts", "2", "--mc-horizon", "3", "reward.judge.mode=yes_no", "--out", tmp_path / f"{name}.json")
        assert code == 0, err
    plain, a, b = (json.loads((tmp_path / f"best_of_{n}.json").read_text()) for n in ("plain", "a", "b"))
    curves = {c["selector"]: c for c in a["curves"]}
    assert curves["oracle"]["success"] == plain["curves"][0]["success"]  # snapshots kept, same attempts
    assert [c["success"] for c in a["curves"]] == [c["success"] for c in b["curves"]]  # same seed, same table
    mc, judge = curves["mc"], curves["judge"]
    assert mc["env_steps"] > 0 and mc["unscored"] == 0 and judge["env_steps"] == 0 and judge["unscored"] == 0
    for c in (mc, judge):
        assert c["success"][0] == pytest.approx(curves["oracle"]["success"][0]) and 0.0 <= c["auc"] <= 1.0
    assert "mc: scoring took" in (tmp_path / "best_of_a.md").read_text()


def test_mc_scores_estimate_each_state_of_a_task_once(monkeypatch):
    """Two attempts through the same first state share its estimate; a state whose rollouts all
    failed (NaN) is left out of its attempt's mean; an attempt with no estimate at all is -inf."""
    import numpy as np

    import turnforge.critic.mc as mc_module
    from turnforge.critic.mc import MCEstimate
    from turnforge.scaling.best_of import MCScorer, mc_scores
    from turnforge.types import EnvSnapshot

    seen = []

    def fake_estimate(engine, starts, actor, *, rollouts, gamma, seed, prefix):
        seen.extend(starts)
        values = {"s0": 0.2, "a1": 0.8, "b1": np.nan, "c0": np.nan}
        return MCEstimate(np.array([values[s.snapshot.payload] for s in starts]), np.zeros(len(starts)), 10 * len(starts))

    monkeypatch.setattr(mc_module, "estimate", fake_estimate)

    def attempt(i, states, task=0):
        turns = tuple(Turn("o", "a", 0.0, False, "") for _ in states)
        return dataclasses.replace(_attempt(i, "x", False), turns=turns, task=Task("frozenlake", "heldout", task),
                                   snapshots=tuple(EnvSnapshot("frozenlake", s) for s in states))

    groups = [[attempt(0, ["s0", "a1"]), attempt(1, ["s0", "b1"])], [attempt(2, ["c0"], task=1)]]
    scores, steps, unscored = mc_scores(groups, MCScorer(None, None, rollouts=2, horizon=8, max_turns=8, seed=0))
    assert [s.snapshot.payload for s in seen] == ["s0", "a1", "b1", "c0"]  # s0 once for both attempts
    assert [s.max_turns for s in seen] == [8, 7, 7, 8]  # the horizon, or the turns the episode has left
    assert scores == [[pytest.approx(0.5), pytest.approx(0.2)], [float("-inf")]] and steps == 40 and unscored == 1


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
    (["--best-of", "4", "--select", "oracle,beam"], "unknown selector 'beam'; valid selectors: oracle, logprob, vote, critic, mc, judge"),
    (["--best-of", "4", "--select", "judge", "reward.judge.model=/nonexistent/judge"], "/nonexistent/judge"),
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
