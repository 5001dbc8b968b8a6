"""What the overview's charts draw: one series per evaluation temperature and size (never a line
through evaluations of different ones), rounds and iterations numbered as the store numbers
them, pass@k as a curve with its labelled figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from view_helpers import build, duck, goto

from turnforge.app.setup import load_run_config
from turnforge.train.metrics import read_metrics
from turnforge.view.data import RunView
from turnforge.view.records import Table
from turnforge.view.rundir import eval_series


@pytest.fixture(scope="module")
def page_file(view_run, tmp_path_factory) -> Path:
    return build([view_run], tmp_path_factory.mktemp("charts") / "run.html")


def series_on_page(page, kind: str) -> dict[str, dict]:
    """The series of the first chart of ``kind``: label -> main, points (x, y), whether a line joins them."""
    return page.evaluate("""(kind) => Object.fromEntries([...document.querySelector(`.chart[data-kind=${kind}]`)
        .querySelectorAll('g.series')].map((g) => [g.dataset.series, { main: g.dataset.main === '1', line: !!g.querySelector('polyline'),
          points: [...g.querySelectorAll('.pt')].map((p) => [+p.dataset.x, +p.dataset.y]) }]))""", kind)


def flat(points) -> list[float]:
    """[(x, y), ...] as [x, y, ...]: for pytest.approx."""
    return [v for p in points for v in p]


def test_eval_series_tells_temperatures_and_sizes_apart():
    """The default run's records: BC at four more temperatures at the step of 'before-rl', the
    flywheel's 200-episode evaluations, the final one of 500 (3 lost to infrastructure failures)."""
    columns = ["tag", "env_steps", "result.episodes", "result.infra_failures"]
    rows = [["before-rl", 10, 500, 0], *[["bc", 10, 500, 0]] * 4, ["flywheel-1", 20, 200, 0], ["flywheel-2", 30, 199, 1],
            ["after-rl", 30, 497, 3]]
    config = {"eval": {"temperature": 1.0, "episodes": 500, "bc_temperatures": [1.0, 0.7, 0.5, 0.3, 0.1]}}
    t = eval_series(Table(columns, rows), config)
    got = [dict(zip(t.columns, r)) for r in t.rows]
    assert [g["temperature"] for g in got] == [1.0, 0.7, 0.5, 0.3, 0.1, 1.0, 1.0, 1.0]
    assert [g["size"] for g in got] == [500] * 5 + [200, 200, 500]
    assert [g["main"] for g in got] == [True, False, False, False, False, False, False, True]
    assert len({g["series"] for g in got}) == 6 and got[0]["series"] == got[-1]["series"] == "T=1, 500 episodes"
    assert got[1]["series"] == "T=0.7, 500 episodes" and got[5]["series"] == got[6]["series"] == "T=1, 200 episodes"
    assert [g["point"] for g in got][5:] == ["flywheel round 0", "flywheel round 1", "after-rl"]
    # records that keep their temperature (runs written since) are taken at their word, whatever the config's order
    kept = eval_series(Table(columns + ["temperature"], [r + [t] for r, t in zip(rows, [1.0, 0.1, 0.3, 0.5, 0.7, 1.0, 1.0, 1.0])]),
                       config)
    assert [dict(zip(kept.columns, r))["temperature"] for r in kept.rows] == [1.0, 0.1, 0.3, 0.5, 0.7, 1.0, 1.0, 1.0]
    assert kept.columns.count("temperature") == 1


def test_held_out_curve_draws_one_series_per_temperature_and_size(page, page_file, view_run, tmp_path):
    cfg = load_run_config(view_run)
    evals = read_metrics(view_run).evals
    summary = json.loads((view_run / "summary.json").read_text())
    start = next(e for e in evals if e.tag == "before-rl")
    label = lambda t, n: f"T={t:g}, {n} episodes"  # noqa: E731
    want = {label(cfg.eval.temperature, cfg.eval.episodes):
            [(e.env_steps, e.result.success_rate) for e in evals if e.tag != "bc" and not e.tag.startswith("flywheel")],
            label(cfg.eval.temperature, cfg.flywheel.eval_episodes):
            [(e.env_steps, e.result.success_rate) for e in evals if e.tag.startswith("flywheel")]}
    for x in summary["eval_bc_best_temperature"]["all"]:
        if x["temperature"] != cfg.eval.temperature:
            want[label(x["temperature"], cfg.eval.episodes)] = [(start.env_steps, x["result"]["success_rate"])]
    assert len(want) == 3 and cfg.eval.episodes != cfg.flywheel.eval_episodes  # the fixture has what is checked
    goto(page, page_file.as_uri(), "overview")
    shown = series_on_page(page, "eval")
    assert set(shown) == set(want)
    for name, points in want.items():
        assert flat(shown[name]["points"]) == pytest.approx(flat(points), abs=1e-6), name
        assert shown[name]["line"] == (len(points) > 1), name  # a line joins the points of one series only
        assert shown[name]["main"] == (name == label(cfg.eval.temperature, cfg.eval.episodes))
    legend = page.locator(".chart[data-kind=eval] .series-legend [data-series]").evaluate_all("xs => xs.map(x => x.dataset.series)")
    assert sorted(legend) == sorted(want)
    page.locator(".chart[data-kind=eval]").first.screenshot(path=str(tmp_path / "eval.png"))


def test_rounds_and_iterations_are_numbered_as_the_store_numbers_them(page, page_file, view_run):
    store = {s: [r["iteration"] for r in duck(view_run, "SELECT DISTINCT iteration FROM trajectories WHERE stage = ? ORDER BY 1", [s])]
             for s in ("rl", "flywheel")}
    assert store == {"rl": [0, 1], "flywheel": [0]}
    series = RunView(view_run).overview().series
    column = lambda kind, name: [r[series[kind].columns.index(name)] for r in series[kind].rows]  # noqa: E731
    assert column("rl_iter", "iteration") == store["rl"] and column("flywheel_round", "round") == store["flywheel"]
    goto(page, page_file.as_uri(), "overview")
    assert [p[0] for p in series_on_page(page, "rl_iter")["view_run"]["points"]] == store["rl"]
    assert [p[0] for p in series_on_page(page, "flywheel_round")["view_run"]["points"]] == store["flywheel"]
    rounds = page.evaluate("""(() => { const h = [...document.querySelectorAll('h2')].find((e) => e.textContent === 'Flywheel rounds');
        return [...h.nextElementSibling.querySelectorAll('tbody tr')].map((tr) => tr.children[0].textContent); })()""")
    assert rounds == [str(i) for i in store["flywheel"]]
    titles = page.locator(".chart[data-kind=eval] .pt title").all_text_contents()
    assert any("flywheel round 0" in t for t in titles) and any("RL iteration 0" in t for t in titles)
    # the round's link, the Browse list and the chart point name the same stored episodes
    page.evaluate("delete document.body.dataset.ready")
    page.locator(".chart[data-kind=flywheel_round] .pt").first.click()
    goto_ready = page.wait_for_function("document.body.dataset.ready === 'browse'")
    assert goto_ready and "stage=flywheel" in page.url and "iteration=0" in page.url
    assert page.locator(".rounds-list a.sel").inner_text().startswith("round 0")


def test_pass_at_k_is_a_curve_with_its_figures(page, page_file, view_run):
    """summary.json's boundary_start and boundary_after (issue 31): pass@k against k, one series
    each, and the never-solved share, entropy and malformed rates as labelled figures."""
    summary = json.loads((view_run / "summary.json").read_text())
    goto(page, page_file.as_uri(), "overview")
    shown = series_on_page(page, "pass_at_k")
    assert set(shown) == {"at the start", "after training"} and shown["after training"]["main"]
    for tag, name in (("boundary_start", "at the start"), ("boundary_after", "after training")):
        report = summary[tag]
        assert report["pass_at_k"] and report["infra_failures"] > 0  # task 0 of the echo env crashes: left out and counted
        assert flat(shown[name]["points"]) == pytest.approx(flat([(math.log2(p["k"]), p["value"]) for p in report["pass_at_k"]]))
        figure = lambda key: page.locator(f"[data-key='{tag}.{key}']").inner_text()  # noqa: E731,B023
        assert figure("never_solved_at_8") == f"{100 * report['never_solved_at_8']:.1f}%"
        assert float(figure("entropy")) == pytest.approx(report["entropy"], abs=1e-3)
        assert figure("malformed_rate") == f"{100 * report['malformed_rate']:.1f}%"
        assert figure("eval_malformed_rate").startswith(f"{100 * report['eval_malformed_rate']:.1f}%")
        assert figure("solved_tasks") == f"{report['solved_tasks']} / {report['tasks']}"
        assert int(figure("infra_failures")) == report["infra_failures"]
        pass_at = {p["k"]: p["value"] for p in report["pass_at_k"]}
        assert float(figure("pass_at_1")) == pytest.approx(pass_at[1], abs=1e-3)
        assert float(figure(f"pass_at_{max(pass_at)}")) == pytest.approx(pass_at[max(pass_at)], abs=1e-3)
    start, after = (set(summary[tag]["solved"]) for tag in ("boundary_start", "boundary_after"))
    assert page.locator("[data-key='boundary_after.gained_lost']").inner_text() == f"{len(after - start)} / {len(start - after)}"
    assert page.locator("[data-key='boundary_start.gained_lost']").count() == 0  # the start has nothing to compare with
    assert page.locator("text=boundary_start.pass_at_k").count() == 0  # no raw key = value pairs


def test_bc_loss_chart_plots_the_logged_epoch_losses(page, page_file, view_run):
    losses = [(e.epoch, e.loss) for e in read_metrics(view_run).bc_epochs]
    goto(page, page_file.as_uri(), "overview")
    assert flat(series_on_page(page, "bc_epoch")["view_run"]["points"]) == pytest.approx(flat(losses), abs=1e-6)
