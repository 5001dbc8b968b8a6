"""Progress shows stage/iteration/reward/success/tokens/s/ETA; metrics go to JSONL + TensorBoard."""

from __future__ import annotations

import io
import json

from rich.console import Console

from turnforge.train.reporting import MetricsLog, Progress, plot_learning_curve


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


def test_metrics_log_and_curve(tmp_path):
    log = MetricsLog(tmp_path)
    log.log("eval", 0, success_rate=0.1, mean_return=-1.0)
    log.log("bc_done", 50)
    log.log("eval", 50, success_rate=0.3, mean_return=0.5)
    log.log("eval", 150, success_rate=0.6, mean_return=2.0)
    log.close()
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["env_steps"] for e in events] == [0, 50, 50, 150]
    png = plot_learning_curve(tmp_path, "demo")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # resuming at env step 50 drops later events
    MetricsLog(tmp_path, keep_until_env_steps=50).close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
