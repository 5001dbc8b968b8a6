"""The viewer's table of flywheel rounds: one column per mechanism of the run, read from the
round records' ``mechanisms`` (``turnforge.train.mechanisms``), whatever mechanisms there are."""

from __future__ import annotations

from view_helpers import build, goto

from turnforge.train.metrics import read_metrics


def test_flywheel_rounds_show_each_mechanism_of_the_run(page, view_run, tmp_path):
    goto(page, build([view_run], tmp_path / "run.html").as_uri(), "overview")
    (record,) = read_metrics(view_run).flywheel  # one round, flywheel.mechanisms=[replay]
    shown = page.evaluate("""(() => {
        const h = [...document.querySelectorAll('h2')].find((e) => e.textContent === 'Flywheel rounds');
        const t = h.nextElementSibling.querySelector('table');
        return { head: [...t.querySelectorAll('th')].map((e) => e.textContent),
                 row: [...t.querySelectorAll('tbody tr')[0].children].map((e) => e.textContent) }; })()""")
    assert shown["head"][:4] == ["round", "held-out success", "plain (episodes / successes)", "replay"]
    assert shown["row"][2] == f"{record.plain[0]} / {record.plain[1]}"
    assert shown["row"][3] == f"(size {record.mechanisms['replay'].size})"  # replay plays no episodes of its own
