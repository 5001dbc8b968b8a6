"""Progress shows stage/iteration/reward/success/tokens/s/ETA; metrics go to JSONL + TensorBoard."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
from rich.console import Console

from turnforge.app.config import load_config
from turnforge.train.metrics import BCStats, BestTemperature, EvalRecord, read_metrics
from turnforge.train.reporting import MetricsLog, Progress, final_line, plot_learning_curve
from turnforge.types import EvalResult


class Clock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_when_not_a_tty(capsys):
    clock = Clock()
    with Progress("demo", live=False, clock=clock) as p:
        p.stage("rl", total=4)
        clock.now = 12.0
        p.update(2, reward=1.5, success=0.25, tokens_per_s=1000.0)
    err = capsys.readouterr().err
    assert "stage rl (4 steps)" in err
    assert "[rl] 2/4 reward=1.5 success=0.25 tokens_per_s=1000 eta=12s" in err


def test_without_a_tty_progress_lines_come_at_most_every_interval(capsys):
    """1,000 optimizer steps over 100 s (the BC stage printed one line per step): the stage's
    line, one progress line per 10 s with its ETA, and the last step."""
    clock = Clock()
    with Progress("demo", live=False, interval=10.0, clock=clock) as p:
        p.stage("bc", total=1000)
        for step in range(1, 1001):
            clock.now = step * 0.1
            p.update(step, loss=1.0 / step)
        p.message("bc: done")
    lines = capsys.readouterr().err.splitlines()
    progress = [line for line in lines if line.startswith("[bc] ")]
    assert lines[0] == "stage bc (1000 steps)" and lines[-1] == "bc: done"
    assert len(progress) == 10  # at 10 s, 20 s, ..., 90 s, and the last step at 100 s
    assert all(" eta=" in line for line in progress[:-1])
    assert progress[-1].startswith("[bc] 1000/1000") and progress[-1].endswith("(done in 100s)")


def test_an_activity_reports_progress_and_eta_throttled(capsys):
    clock = Clock()
    with Progress("demo", live=False, interval=10.0, clock=clock) as p:
        p.stage("flywheel", total=4)
        with p.activity("eval before-rl", 100) as advance:
            for done in range(1, 101):
                clock.now = done * 1.0  # one episode a second: 100 s
                advance(done)
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[eval before-rl]")]
    assert progress[0] == "[eval before-rl] 10/100 episodes eta=90s"
    assert len(progress) == 9  # at 10..90 s; the evaluation's result line closes it


def test_an_activity_whose_items_all_finish_late_still_shows_it_runs(capsys):
    """Lookahead's episodes finish together at the end: `turnforge eval` printed nothing for 75 s."""
    clock = Clock()
    with Progress("ckpt", live=False, interval=10.0, clock=clock, command="turnforge eval") as p:
        with p.activity("lookahead", 8) as advance:
            for t in range(1, 26):
                clock.now = float(t)
                advance(0 if t < 25 else 8)
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[lookahead]")]
    assert progress == ["[lookahead] 0/8 episodes (10s)", "[lookahead] 0/8 episodes (20s)"]


def _live() -> tuple[Progress, io.StringIO]:
    """A live ``Progress`` drawing on a terminal-like buffer."""
    buf = io.StringIO()
    p = Progress("demo", live=True)
    p.console = Console(file=buf, force_terminal=True, width=100)
    return p, buf


def test_live_panel_shows_an_activity_as_a_progress_bar():
    p, buf = _live()
    with p:
        p.stage("rl", total=10)
        with p.activity("eval rl-5", 50) as advance:
            advance(20)
            p._live.refresh()
    assert "eval rl-5" in buf.getvalue() and "20/50" in buf.getvalue()


def _summary(best: bool) -> SimpleNamespace:
    """What ``final_line`` reads of a ``RunSummary`` (a finished flywheel run, seed 0)."""
    ev = lambda rate: EvalResult("sokoban", "heldout", 500, rate, 0.0, 0.0, 9.0)  # noqa: E731
    return SimpleNamespace(wall_seconds=1299.0, eval_before_rl=ev(0.458), eval_after_rl=ev(0.694), success_gain_points=23.6,
                           eval_bc_best_temperature=BestTemperature(0.5, ev(0.538), []) if best else None,
                           gain_over_bc_best_points=15.6 if best else None)


def test_the_last_line_names_the_baseline_of_each_gain(tmp_path):
    cfg = load_config("sokoban-tiny")
    line = final_line(_summary(best=True), cfg, tmp_path)
    assert line.startswith("done in 1299s: held-out success 0.694 at the end (T=1, 500 episodes), +15.6 points against "
                           "the BC policy at its best temperature (T=0.5: 0.538), +23.6 points against the BC policy at T=1 "
                           "(0.458); run dir ")
    line = final_line(_summary(best=False), load_config("sokoban-tiny", ["bc.enabled=false"]), tmp_path)
    assert ("+23.6 points against the starting policy (no BC) at T=1 (0.458); its best temperature was not measured "
            "(set eval.bc_temperatures)") in line


def test_the_last_line_of_a_tool_env_says_how_often_the_tool_was_called(tmp_path):
    ev = lambda rate, tools: EvalResult("arithmetic", "heldout", 100, rate, 0.0, 0.0, 2.0, tool_call_rate=tools)  # noqa: E731
    summary = SimpleNamespace(wall_seconds=60.0, eval_before_rl=ev(0.73, 0.74), eval_after_rl=ev(0.99, 1.0),
                              success_gain_points=26.0, eval_bc_best_temperature=BestTemperature(0.0, ev(0.76, 0.77), []),
                              gain_over_bc_best_points=23.0)
    line = final_line(summary, load_config("smollm2-arithmetic", ["bc.enabled=false"]), tmp_path)
    assert ("; episodes calling a tool 1.000 (the starting policy (no BC) at T=0: 0.770); run dir ") in line
    assert "calling a tool" not in final_line(_summary(best=True), load_config("sokoban-tiny"), tmp_path)


def test_live_panel_renders_the_fields():
    p, buf = _live()
    with p:
        p.stage("bc", total=10)
        p.update(5, loss=0.5, reward=1.0, success=0.5, tokens_per_s=123.0)
    out = buf.getvalue()
    for field in ("stage", "bc", "step", "reward", "success", "tokens_per_s", "eta"):
        assert field in out


def _eval(tag, success, ret):
    return EvalRecord(tag, 0, EvalResult("demo", "heldout", 10, success, ret, 0.0, 3.0))


def test_metrics_log_and_curve(tmp_path):
    log = MetricsLog(tmp_path)
    log.log(_eval("before-rl", 0.1, -1.0), 0)
    bc = BCStats(4, 50, 50, 0, 1.0, 0.0, 0, 0.5, 7, 0)
    log.log(bc, 50)
    log.log(_eval("rl-1", 0.3, 0.5), 50)
    log.log(_eval("after-rl", 0.6, 2.0), 150)
    log.close()
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["env_steps"] for e in events] == [0, 50, 50, 150]
    assert [e["event"] for e in events] == ["eval", "bc_done", "eval", "eval"]
    metrics = read_metrics(tmp_path)  # typed records back, env steps and times filled in
    assert [e.result.success_rate for e in metrics.evals] == [0.1, 0.3, 0.6]
    assert metrics.bc.demonstrations == 4 and metrics.bc.env_steps == 50 and metrics.bc.time > 0
    png = plot_learning_curve(tmp_path / "learning_curve.png", metrics, "demo")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # resuming at env step 50 drops later events
    MetricsLog(tmp_path, keep_until_env_steps=50).close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_reader_refuses_an_unknown_field(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "warning", "env_steps": 0, "time": 1.0, "message": "m",
                                                        "colour": "red"}) + "\n")
    with pytest.raises(ValueError, match="line 1: RunWarning has no field 'colour'"):
        read_metrics(tmp_path)
