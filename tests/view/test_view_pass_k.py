"""A flywheel round's ``pass_k_dropped`` (the kept episodes ``flywheel.pass_k`` weighs 0) is a
count, not a pass@k series, and a run without ``flywheel.pass_k`` records 0 in every round: the
overview draws it only for a run that set ``flywheel.pass_k`` (or recorded a value other than 0),
under a title that says what it counts (issue 67)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from view_helpers import build, goto

from turnforge.train.metrics import read_metrics

TITLE = "Flywheel: kept episodes left out by flywheel.pass_k (weight 0)"


@pytest.fixture(scope="module")
def pass_k_run(view_run, tmp_path_factory) -> Path:
    """``view_run`` as a run with ``flywheel.pass_k=2`` that left 3 episodes out of its round."""
    run = tmp_path_factory.mktemp("pass_k") / "run"
    shutil.copytree(view_run, run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["flywheel"]["pass_k"] = 2
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        if r["event"] == "flywheel_round":
            r["pass_k_dropped"] = 3
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def charts(page) -> dict[str, list[list]]:
    """Each chart's title -> its series as [run, [(x, y), ...]]."""
    return page.evaluate("""Object.fromEntries([...document.querySelectorAll('.chart')].map((c) => [
        c.querySelector('.head span').textContent,
        [...c.querySelectorAll('g.series')].map((g) => [+g.dataset.run, [...g.querySelectorAll('.pt')].map((p) => [+p.dataset.x, +p.dataset.y])])]))""")


def metric_choices(page) -> set[str]:
    return set(page.evaluate("[...document.querySelectorAll('.chart select option')].map((o) => o.value)"))


def test_a_run_without_pass_k_has_no_such_chart(page, view_run, tmp_path):
    rounds = read_metrics(view_run).flywheel
    assert rounds and all(r.pass_k_dropped == 0 for r in rounds)  # recorded, as 0: the case the chart must not draw
    goto(page, build([view_run], tmp_path / "plain.html").as_uri(), "overview")
    shown = charts(page)
    assert "Flywheel: entropy per round" in shown  # the flywheel's charts are there
    assert not [t for t in shown if "pass_k" in t or "pass@k: pass" in t], list(shown)
    assert "pass_k_dropped" not in metric_choices(page)


def test_a_run_with_pass_k_has_it_labelled_and_only_its_own_series(page, view_run, pass_k_run, tmp_path):
    goto(page, build([pass_k_run], tmp_path / "pass_k.html").as_uri(), "overview")
    shown = charts(page)
    assert shown[TITLE] == [[0, [[0, 3]]]]  # round 0 (the store's numbering), 3 episodes
    assert not [t for t in shown if t.startswith("pass@k: pass_k")], list(shown)
    # side by side with the run without it: the chart, with the second run's series alone
    goto(page, build([view_run, pass_k_run], tmp_path / "both.html").as_uri(), "overview")
    assert charts(page)[TITLE] == [[1, [[0, 3]]]]
