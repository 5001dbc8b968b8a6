"""The viewer in headless Chromium: the page's counts and tokens against DuckDB queries on the
same run, the click path overview -> group -> trajectory, the served page, two runs side by side."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from view_helpers import build, check_trajectory, duck, goto, wait_ready


@pytest.fixture(scope="module")
def page_file(view_run, tmp_path_factory) -> Path:
    return build([view_run], tmp_path_factory.mktemp("page") / "run.html")


def cards(page, run: int = 0) -> dict[str, int]:
    panel = page.locator(f".panel[data-run='{run}']")
    return {name: int(panel.locator(f"[data-testid=total-{name}]").inner_text().split()[0].replace(",", ""))
            for name in ("episodes", "samples", "failures", "truncated")}


def test_overview_counts_match_duckdb(page, page_file, view_run, tmp_path):
    goto(page, page_file.as_uri(), "overview")
    expected = duck(view_run, """SELECT count(*) AS episodes, count(*) FILTER (WHERE infra_failure IS NOT NULL) AS failures,
                                        count(*) FILTER (WHERE truncation_reason IS NOT NULL) AS truncated FROM trajectories""")[0]
    expected["samples"] = duck(view_run, "SELECT count(token_ids) AS n FROM samples")[0]["n"]
    assert expected["failures"] > 0 and expected["samples"] > expected["episodes"] > 0  # the fixture has what is checked
    assert cards(page) == expected
    # failures by stage, each against its own query
    by_stage = {r["stage"]: r for r in duck(view_run, "SELECT stage, count(*) AS episodes, "
                                                      "count(*) FILTER (WHERE infra_failure IS NOT NULL) AS failures "
                                                      "FROM trajectories GROUP BY stage")}
    shown = page.evaluate("""[...document.querySelectorAll('table.stages tbody tr')].map(tr =>
        [tr.dataset.stage, +tr.children[1].textContent.replace(/,/g, ''), +tr.children[5].textContent.replace(/,/g, '')])""")
    assert {s: (e, f) for s, e, f in shown} == {s: (r["episodes"], r["failures"]) for s, r in by_stage.items()}
    assert set(by_stage) == {"bc", "flywheel", "rl"}
    # the learning curves and the BC-at-each-temperature table are drawn
    assert page.locator(".chart[data-kind=rl_iter] circle.pt").count() >= 2
    assert page.locator("text=BC at each temperature").count() == 1
    page.screenshot(path=str(tmp_path / "overview.png"), full_page=True)
    assert (tmp_path / "overview.png").stat().st_size > 10_000


def test_click_through_overview_group_trajectory(page, page_file, view_run, tmp_path):
    goto(page, page_file.as_uri(), "overview")
    # a point of the RL reward curve: the episodes of that iteration (rl_iter 2 wrote stage rl iteration 1)
    page.evaluate("delete document.body.dataset.ready")
    page.locator(".chart[data-kind=rl_iter]").first.locator("circle.pt").nth(1).click()
    wait_ready(page, "browse")
    assert "stage=rl" in page.url and "iteration=1" in page.url
    want = duck(view_run, "SELECT count(*) AS e, count(DISTINCT group_id) AS g FROM trajectories WHERE stage = 'rl' AND iteration = 1")[0]
    count = page.locator("[data-testid=match-count]")
    assert (int(count.get_attribute("data-episodes")), int(count.get_attribute("data-groups"))) == (want["e"], want["g"])

    # a group: its attempts side by side, best reward first
    row = page.locator("tr.group").first
    group_id = row.get_attribute("data-group")
    page.evaluate("delete document.body.dataset.ready")
    row.locator("td").first.click()  # a cell without a link: the row opens its group
    wait_ready(page, "group")
    members = duck(view_run, "SELECT trajectory_id, reward FROM trajectories WHERE stage = 'rl' AND iteration = 1 AND group_id = ? "
                             "ORDER BY reward DESC NULLS LAST", [group_id])
    shown = page.evaluate("[...document.querySelectorAll('.attempt')].map(a => a.dataset.trajectory)")
    assert sorted(shown) == sorted(m["trajectory_id"] for m in members) and len(shown) == len(members)
    rewards = {m["trajectory_id"]: m["reward"] for m in members}
    ordered = [rewards[t] for t in shown if rewards[t] is not None]
    assert ordered == sorted(ordered, reverse=True)
    # each attempt lists one action per sample with action tokens (window context), the best against the worst below
    actions = {r["trajectory_id"]: r["n"] for r in duck(view_run, "SELECT trajectory_id, count(*) FILTER (WHERE list_sum(loss_mask) > 0) AS n "
                                                                   "FROM samples WHERE stage = 'rl' AND iteration = 1 AND group_id = ? GROUP BY ALL", [group_id])}
    assert {t: page.locator(f".attempt[data-trajectory='{t}'] ol > li").count() for t in shown} == actions
    assert page.locator("[data-testid=diff] > div").count() >= max(actions.values())
    page.screenshot(path=str(tmp_path / "group.png"), full_page=True)

    # its first attempt, token by token
    first = shown[0]
    page.evaluate("delete document.body.dataset.ready")
    page.locator(f".attempt[data-trajectory='{first}'] .ah a").click()
    wait_ready(page, "traj")
    check_trajectory(page, view_run, "rl", 1, first)
    for mode in ("logprob", "advantage"):
        page.evaluate("delete document.body.dataset.ready")
        page.locator(f"input[name=color][value={mode}]").check()
        wait_ready(page, "traj")
        assert f"color={mode}" in page.url
    page.screenshot(path=str(tmp_path / "trajectory.png"), full_page=True)
    assert all((tmp_path / f"{n}.png").stat().st_size > 10_000 for n in ("group", "trajectory"))


def test_infra_failure_shows_its_error_text(page, page_file, view_run):
    failed = duck(view_run, "SELECT stage, iteration, trajectory_id, infra_failure FROM trajectories "
                            "WHERE infra_failure IS NOT NULL AND stage = 'rl' ORDER BY trajectory_id LIMIT 1")[0]
    goto(page, page_file.as_uri() + "#browse?stage=rl&outcome=infra", "browse")
    want = duck(view_run, "SELECT count(*) AS n FROM trajectories WHERE stage = 'rl' AND infra_failure IS NOT NULL")[0]["n"]
    assert int(page.locator("[data-testid=match-count]").get_attribute("data-episodes")) == want
    page.evaluate("delete document.body.dataset.ready")
    page.locator(f"a.chip[data-trajectory='{failed['trajectory_id']}']").click()
    wait_ready(page, "traj")
    assert page.locator("[data-testid=infra-failure]").inner_text() == failed["infra_failure"]
    check_trajectory(page, view_run, failed["stage"], failed["iteration"], failed["trajectory_id"])


def test_judge_verdict_and_gateway_splits(page, judged_run, tmp_path):
    out = build([judged_run], tmp_path / "judged.html")
    row = duck(judged_run, "SELECT stage, iteration, trajectory_id, any_value(judge_prompt) AS prompt, any_value(judge_output) AS output, "
                           "any_value(judge_score) AS score, any_value(verifier_reward) AS verifier FROM samples "
                           "WHERE trajectory_id = 'rl-0-0-0' GROUP BY ALL")[0]
    goto(page, out.as_uri() + "#traj?run=0&stage=rl&iteration=0&id=rl-0-0-0", "traj")
    judge = page.locator("[data-testid=judge]")
    assert float(judge.locator("[data-testid=judge-score]").inner_text()) == pytest.approx(row["score"], abs=1e-6)
    assert float(judge.locator("[data-testid=verifier-reward]").inner_text()) == pytest.approx(row["verifier"])
    blocks = page.locator(".judge pre.block").all_inner_texts()
    assert blocks == [row["prompt"], row["output"]]
    splits = [line for line in (judged_run / "gateway_splits.jsonl").read_text().splitlines()]
    assert page.locator("table.splits tbody tr").count() == len(splits) == 2
    check_trajectory(page, judged_run, "rl", 0, "rl-0-0-0")


def test_pass_at_k_and_diagnostics_are_shown(page, judged_run, tmp_path):
    """A summary's report with pass@k as a {k: value} map is a curve too, its never-solved share
    a labelled figure; evaluation records' pass@k columns get charts of their own."""
    out = build([judged_run], tmp_path / "diag.html")
    goto(page, out.as_uri(), "overview")
    points = page.locator(".chart[data-kind=pass_at_k] g.series[data-series=diagnostics] .pt").evaluate_all(
        "ps => ps.map(p => [+p.dataset.x, +p.dataset.y])")
    assert points == [[0, 0.25], [3, 0.5]]  # log2 k
    assert page.locator("[data-key='diagnostics.never_solved_share']").inner_text() == "12.5%"
    chart = page.locator(".chart[data-kind=eval]", has_text="pass@k: result.pass_at_8")
    assert chart.locator(".pt").count() == 2
    assert page.locator("[data-testid=summary-after]").inner_text().startswith("50.0%")


def test_group_diff_shows_the_best_attempts_actions_green_and_the_worsts_red(page, judged_run, tmp_path):
    group = duck(judged_run, "SELECT iteration, group_id FROM trajectories WHERE stage = 'rl' GROUP BY ALL "
                             "HAVING max(reward) > min(reward) ORDER BY iteration, group_id LIMIT 1")[0]
    out = build([judged_run], tmp_path / "group.html")
    goto(page, out.as_uri() + f"#group?run=0&stage=rl&iteration={group['iteration']}&group={group['group_id']}", "group")
    actions = page.evaluate("""[...document.querySelectorAll('.attempt')].map(a => [...a.querySelectorAll('.act')].map(x => x.textContent))""")
    best, worst = actions[0], actions[-1]
    lines = page.evaluate("""[...document.querySelectorAll('[data-testid=diff] > div')].map(d =>
        [d.className, d.textContent, getComputedStyle(d).backgroundColor])""")
    only_best = [t for c, t, _ in lines if c == "only-best"]
    only_worst = [t for c, t, _ in lines if c == "only-worst"]
    assert only_best and only_worst
    assert all(t in best and t not in worst for t in only_best) and all(t in worst and t not in best for t in only_worst)
    green, red = (lambda rgb: rgb[1] > rgb[0]), (lambda rgb: rgb[0] > rgb[1])  # noqa: E731
    rgb = lambda text: [int(v) for v in text[text.index("(") + 1:text.index(")")].split(",")[:3]]  # noqa: E731
    assert all(green(rgb(bg)) for c, _, bg in lines if c == "only-best")
    assert all(red(rgb(bg)) for c, _, bg in lines if c == "only-worst")


def test_the_runs_cpu_and_kernel_path_are_shown(page, page_file, view_run):
    """summary.json records where the run's figures repeat (CPU model and flags, torch's kernel
    path, threads, MKL); the overview shows them under the run's name."""
    import json

    from turnforge.kernels import cpu_identity

    software = json.loads((view_run / "summary.json").read_text())["software"]
    cpu = cpu_identity()
    assert (software["cpu_vendor"], software["cpu_family_model"], tuple(software["cpu_flags"])) == \
        (cpu["vendor"], cpu["family_model"], cpu["flags"])
    assert software["threads"] >= 1 and software["cpu_capability"]
    goto(page, page_file.as_uri(), "overview")
    line = page.locator(".panel[data-run='0'] [data-testid=machine]").inner_text()
    assert software["cpu_model"] in line and f"kernels {software['cpu_capability']}" in line
    assert f"torch {software['torch']}" in line and all(f in line for f in software["cpu_flags"])


def test_filters_agree_with_duckdb(page, page_file, view_run):
    cases = [
        ("stage=flywheel", "stage = 'flywheel'"),
        ("outcome=success", "success"),
        ("outcome=failure", "infra_failure IS NULL AND NOT success"),
        ("source=demo&reward_min=0.5", "source = 'demo' AND reward >= 0.5"),
        ("task=train%3A1&outcome=infra", "contains(task_id, 'train:1') AND infra_failure IS NOT NULL"),
    ]
    for query, where in cases:
        goto(page, page_file.as_uri() + "#browse?" + query, "browse")
        want = duck(view_run, f"SELECT count(*) AS e, count(DISTINCT (stage, iteration, group_id)) AS g FROM trajectories WHERE {where}")[0]
        count = page.locator("[data-testid=match-count]")
        assert (int(count.get_attribute("data-episodes")), int(count.get_attribute("data-groups"))) == (want["e"], want["g"]), query


@pytest.fixture()
def served(view_run, view_run_b):
    """``turnforge view RUN RUN2 --serve --port 0`` in a process: its URL."""
    proc = subprocess.Popen([sys.executable, "-m", "turnforge.cli", "view", str(view_run), str(view_run_b), "--serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert found, line + proc.stderr.read()
        yield found.group(0)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_served_page_pages_the_same_data(page, browser, served, page_file, view_run, view_run_b, tmp_path):
    goto(page, served + "#overview", "overview")
    assert page.locator(".panel[data-run]").count() == 2
    # two runs side by side: every table of a run's section whole in its panel (none clipped)
    clipped = page.evaluate("""[...document.querySelectorAll('.runs > .panel table')].filter(t =>
        t.scrollWidth > t.closest('.panel').clientWidth + 1).map(t => t.className + ' ' + t.closest('.runs').previousElementSibling.textContent)""")
    assert page.locator("table.stages").count() == 2 and clipped == []
    assert cards(page, 0) == cards(page, 1)
    served_cards = cards(page, 0)
    # filters answered by the server's DuckDB queries give the counts the file page computes itself
    file_page = browser.new_page()
    for query in ("stage=rl", "outcome=infra", "stage=bc&reward_min=1", "sort=spread&limit=2"):
        goto(page, served + "#browse?" + query, "browse")
        goto(file_page, page_file.as_uri() + "#browse?" + query, "browse")
        both = [p.evaluate("""(() => { const c = document.querySelector('[data-testid=match-count]');
            return [c.dataset.episodes, c.dataset.groups, [...document.querySelectorAll('tr.group')].map(r => r.dataset.group)]; })()""")
                for p in (page, file_page)]
        assert both[0] == both[1], query
    goto(file_page, page_file.as_uri(), "overview")
    assert cards(file_page) == served_cards
    file_page.close()
    # a trajectory of the second run, fetched through the server, token-exact; the same task in both runs
    tid = duck(view_run_b, "SELECT trajectory_id FROM trajectories WHERE stage = 'rl' AND infra_failure IS NULL ORDER BY trajectory_id LIMIT 1")[0]["trajectory_id"]
    goto(page, served + f"#traj?run=1&stage=rl&iteration=0&id={tid}", "traj")
    check_trajectory(page, view_run_b, "rl", 0, tid)
    task = duck(view_run_b, "SELECT task_id FROM trajectories WHERE trajectory_id = ? AND stage = 'rl'", [tid])[0]["task_id"]
    n = duck(view_run, "SELECT count(*) AS n FROM trajectories WHERE task_id = ?", [task])[0]["n"]
    assert page.locator("[data-testid=same-task-0] tbody tr").count() == min(n, 50)
    page.screenshot(path=str(tmp_path / "served.png"), full_page=True)


def test_segments_their_summaries_and_memory_are_shown(page, segment_run, tmp_path):
    out = build([segment_run], tmp_path / "segments.html")
    row = duck(segment_run, "SELECT trajectory_id, count(*) AS n, sum(summary_tokens) AS summary FROM samples "
                            "WHERE stage = 'rl' AND iteration = 0 GROUP BY trajectory_id ORDER BY n DESC, trajectory_id LIMIT 1")[0]
    assert row["n"] >= 2 and row["summary"] > 0
    goto(page, out.as_uri() + f"#traj?run=0&stage=rl&iteration=0&id={row['trajectory_id']}", "traj")
    heads = page.locator("[data-testid=segment]").all_inner_texts()
    assert len(heads) == row["n"] and heads[0].startswith("segment 0 · from turn 0") and "(continues 0)" in heads[1]
    assert page.locator(".tok.summary").count() == row["summary"]
    memory = duck(segment_run, "SELECT memory_tokens FROM samples WHERE trajectory_id = ? AND stage = 'rl'", [row["trajectory_id"]])
    assert len(memory) == row["n"] and all(0 < m["memory_tokens"] <= 24 for m in memory)  # the recalled block, in every segment
    assert page.locator(".tok.memory").count() == sum(m["memory_tokens"] for m in memory)
    assert page.locator("[data-testid=memory]").first.inner_text().startswith("recalled memory")
    check_trajectory(page, segment_run, "rl", 0, row["trajectory_id"])


def test_screenshots_a_sample_holds_are_shown(page, image_run, tmp_path, monkeypatch):
    import base64
    import hashlib
    import urllib.request

    from turnforge.view import page as page_module
    from turnforge.view.data import RunView
    from turnforge.view.server import ViewServer

    row = duck(image_run, "SELECT trajectory_id, image_sha256 FROM samples WHERE stage = 'rl' AND iteration = 0 "
                          "ORDER BY trajectory_id, turn_index LIMIT 1")[0]
    (sha,) = row["image_sha256"]
    shown = duck(image_run, "SELECT sum(len(image_sha256)) AS n FROM samples WHERE stage = 'rl' AND iteration = 0 "
                            "AND trajectory_id = ?", [row["trajectory_id"]])[0]["n"]
    out = build([image_run], tmp_path / "images.html")
    goto(page, out.as_uri() + f"#traj?run=0&stage=rl&iteration=0&id={row['trajectory_id']}", "traj")
    assert page.locator("[data-testid=images] img").count() == shown
    src = page.locator("[data-testid=images] img").first.get_attribute("src")
    assert hashlib.sha256(base64.b64decode(src.split(",", 1)[1])).hexdigest() == sha  # the very image the model saw
    check_trajectory(page, image_run, "rl", 0, row["trajectory_id"])
    monkeypatch.setattr(page_module, "IMAGE_BUDGET", 0)  # over the page's image budget: the hash, not the picture
    small = tmp_path / "no-images.html"
    small.write_text(page_module.build_page([RunView(image_run)]))
    goto(page, small.as_uri() + f"#traj?run=0&stage=rl&iteration=0&id={row['trajectory_id']}", "traj")
    assert page.locator("[data-testid=images] img").count() == 0 and page.locator("[data-testid=images] code").first.inner_text() == sha[:12]
    with ViewServer([RunView(image_run)], port=0) as server:  # served: every image, by its hash
        with urllib.request.urlopen(f"{server.url}/api/image?run=0&sha={sha}") as res:
            assert hashlib.sha256(res.read()).hexdigest() == sha
        goto(page, server.url.rstrip("/") + f"/#traj?run=0&stage=rl&iteration=0&id={row['trajectory_id']}", "traj")
        assert page.locator("[data-testid=images] img").count() == shown
        page.locator("[data-testid=images] img").first.evaluate("img => img.decode()")  # the served PNG loads
        assert page.locator("[data-testid=images] img").first.evaluate("img => img.naturalWidth") == 64
