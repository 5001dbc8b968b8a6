"""Progress shows stage/iteration/reward/success/tokens/s/ETA; metrics go to JSONL + TensorBoard."""

from __future__ import annotations

import io
import json

from rich.console import Console

import pytest

from turnforge.train.metrics import BCStats, EvalRecord, read_metrics
from turnforge.train.reporting import MetricsLog, Progress, plot_learning_curve
from turnforge.types import EvalResult


def test_plain_lines_when_not_a_tty(capsys):
    with Progress("demo", live=False) as p:
        p.stage("rl", total=4)
        p.update(2, reward=1.5, success=0.25, tokens_per_s=1000.0)
    err = capsys.readouterr().err
    assert "stage rl (4 steps)" in err
    assert "[rl] 2/4 reward=1.5 success=0.25 tokens_per_s=1000 eta=" in err


def test_live_panel_renders_the_fields():
    buf = io.StringIO()
    p = Progress("demo", live=True)
    p.console = Console(file=buf, force_terminal=True, width=100)
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
    png = plot_learning_curve(tmp_path, "demo")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # resuming at env step 50 drops later events
    MetricsLog(tmp_path, keep_until_env_steps=50).close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_reader_refuses_an_unknown_field(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "warning", "env_steps": 0, "time": 1.0, "message": "m",
                                                        "colour": "red"}) + "\n")
    with pytest.raises(ValueError, match="line 1: RunWarning has no field 'colour'"):
        read_metrics(tmp_path)
