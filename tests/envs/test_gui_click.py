"""``gui-click``: a task is its screen (same task, same PNG bytes); the expert solves every held-out
task; random clicks succeed as often as the target's share of the screen; invalid answers change
nothing; a wrong action or an oversized box ends the episode; snapshots restore the screen; the
splits are disjoint; bad options are one line; ``check_env`` passes.

The MiniWoB source needs Chromium: without it (or Playwright, or the miniwob package) those
tests skip, naming ``make setup``, as tests/envs/test_miniwob.py's do; under CI they fail."""

from __future__ import annotations

import io
import math
import pickle
import random

import pytest
from PIL import Image

from turnforge.envs import check_env, make
from turnforge.envs.gui.click import GuiClickEnv
from turnforge.envs.tasks import content_key
from turnforge.errors import UserError
from turnforge.types import Task


def play_expert(env, task) -> list:
    env.reset(task, 0)
    results = []
    while not (results and results[-1].terminated):
        results.append(env.step(env.expert_action()))
    return results


def task_of(env, kind: str, split: str = "train", start: int = 0) -> Task:
    return next(t for t in (env.task(split, i) for i in range(start, start + 200)) if t.data["kind"] == kind)


def image(env) -> Image.Image:
    (png,) = env.observation_images()
    return Image.open(io.BytesIO(png))


def test_the_same_task_gives_the_same_png_bytes():
    a, b = make("gui-click"), make("gui-click")
    for i in range(6):
        ta, tb = a.task("heldout", i), b.task("heldout", i)
        assert ta.data == tb.data
        assert a.reset(ta, 0) == b.reset(tb, 7)
        first = a.observation_images()
        assert first == b.observation_images() and first[0].startswith(b"\x89PNG")
        a.step(a.expert_action())
        b.step(b.expert_action())
        assert a.observation_images() == b.observation_images()
    firsts = set()
    for i in range(8):
        a.reset(a.task("train", i), 0)
        firsts.add(a.observation_images())
    assert len(firsts) == 8  # other tasks, other screens


def test_the_expert_solves_every_one_of_50_held_out_tasks():
    env = make("gui-click")
    kinds, returns = {}, []
    for i in range(50):
        task = env.task("heldout", i)
        results = play_expert(env, task)
        assert results[-1].success and not any(r.invalid_action for r in results), task.data
        kinds[task.data["kind"]] = kinds.get(task.data["kind"], 0) + 1
        returns.append(sum(r.reward for r in results))
    assert set(kinds) == {"click", "type", "scroll"}  # every kind was played
    # UI-R1 with unit weights: 3 per right step; click tasks take one step, type and scroll two
    assert sorted(set(returns)) == [3.0, 6.0]


def test_random_clicks_succeed_as_often_as_the_target_covers_the_screen():
    env = make("gui-click", kinds=["click"])
    rng = random.Random(0)
    n, wins, expected, variance = 1000, 0, 0.0, 0.0
    for i in range(n):
        task = env.task("train", i)
        env.reset(task, 0)
        box = task.data["widgets"][task.data["target"]]["box"]
        p = (box[2] - box[0] + 1) * (box[3] - box[1] + 1) / 112**2
        expected, variance = expected + p, variance + p * (1 - p)
        wins += env.step(env.random_action(rng)).success
    assert 0.01 < expected / n < 0.1
    assert abs(wins - expected) < 3.5 * math.sqrt(variance), (wins, expected)


def test_invalid_answers_change_nothing_and_quote_the_grammar():
    env = make("gui-click")
    task = task_of(env, "type")
    obs = env.reset(task, 0)
    key, shown = env.anchor_key(), env.observation_images()
    for bad, why in [("dance", "could not parse 'dance'"), ("click(200, 5)", "off the image: x must be in 0..111"),
                     ("click(9, 9, 1, 1)", "x1 <= x2"), ('type("")', "needs some text")]:
        r = env.step(bad)
        assert (r.invalid_action, r.reward, r.terminated, r.success) == (True, 0.0, False, False)
        assert why in r.observation and 'Valid actions: click(x, y) | click(x1, y1, x2, y2) | type("text") | scroll(up|down)' in r.observation
        assert r.observation.endswith(obs) and env.anchor_key() == key and env.observation_images() == shown
    assert env.step(env.expert_action()).reward == 3.0
    costly = make("gui-click", invalid_action_penalty=-0.5)
    costly.reset(task, 0)
    assert costly.step("dance").reward == -0.5


def test_a_wrong_action_ends_the_episode():
    env = make("gui-click")
    click = task_of(env, "click")
    env.reset(click, 0)
    x1, y1, x2, y2 = click.data["widgets"][click.data["target"]]["box"]
    r = env.step(f"click({x2 + 1 if x2 < 111 else x1 - 1}, {y1})")  # one pixel beside the target
    assert (r.terminated, r.success, r.reward) == (True, False, 2.0) and "missed the target" in r.observation
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("click(1, 1)")
    typing = task_of(env, "type")
    env.reset(typing, 0)
    r = env.step(f'type("{typing.data["word"]}")')  # before clicking the field
    assert (r.terminated, r.success, r.reward) == (True, False, 1.0) and "a click action was due" in r.observation
    env.reset(typing, 0)
    env.step(env.expert_action())
    r = env.step('type("zzz")')
    assert (r.terminated, r.success, r.reward) == (True, False, 2.0)
    scroll = task_of(env, "scroll")
    for first, reward in (("scroll(up)", 2.0), ("click(5, 5)", 1.0)):  # the target is below the fold
        env.reset(scroll, 0)
        r = env.step(first)
        assert (r.terminated, r.success, r.reward) == (True, False, reward)


def test_type_and_scroll_episodes_show_their_new_state():
    env = make("gui-click")
    typing = task_of(env, "type")
    env.reset(typing, 0)
    before = env.observation_images()
    r = env.step(env.expert_action())
    assert not r.terminated and r.reward == 3.0 and "The field has focus." in r.observation
    assert env.observation_images() != before and env.expert_action() == f'type("{typing.data["word"]}")'
    scroll = task_of(env, "scroll")
    env.reset(scroll, 0)
    assert env.expert_action() == "scroll(down)"
    top = image(env)
    r = env.step("scroll(down)")
    assert not r.terminated and "Scrolled down one screen." in r.observation
    below = image(env)
    assert top.size == below.size == (112, 112) and top.tobytes() != below.tobytes()
    assert top.getpixel((111, 2)) != below.getpixel((111, 2))  # the scroll bar's thumb moved down
    x1, y1, x2, y2 = scroll.data["widgets"][scroll.data["target"]]["box"]
    assert y1 >= 112 and env.expert_action() == f"click({(x1 + x2) // 2}, {(y1 + y2) // 2 - 112})"


def test_a_screen_sized_box_on_a_centred_target_fails_and_a_tight_box_wins():
    data = {"source": "synthetic", "kind": "click", "size": 112, "page_height": 112, "target": 1,
            "widgets": [{"type": "button", "label": "OK", "colour": "red", "box": [4, 4, 31, 19]},
                        {"type": "button", "label": "Save", "colour": "blue", "box": [42, 48, 69, 63]}]}
    task = Task("gui-click", "train", 0, data)  # a hand-made task, as a JSONL task file gives one
    env = make("gui-click")
    assert env.reset(task, 0).startswith('Click the blue "Save" button.')
    assert image(env).getpixel((55, 55))[:3] == (0x1F, 0x5F, 0xD6)  # the target is drawn where its box says
    r = env.step("click(0, 0, 111, 111)")  # centre (55.5, 55.5): inside the target, but 44.8 x its area
    assert (r.terminated, r.success) == (True, False) and "more than 4 times the target's area" in r.observation
    assert r.reward == pytest.approx(2.0, abs=0.1)
    env.reset(task, 0)
    r = env.step("click(41, 47, 70, 64)")
    assert r.success and r.reward == pytest.approx(2.0 + r.info["reward_argument"]) and r.info["reward_argument"] > 0.9


def test_snapshot_restore_brings_back_the_screen():
    env, other = make("gui-click"), make("gui-click")
    task = task_of(env, "type")
    env.reset(task, 0)
    env.step(env.expert_action())  # the field has focus
    snap = pickle.loads(pickle.dumps(env.snapshot()))
    key, shown, obs = env.anchor_key(), env.observation_images(), env.expert_action()
    assert env.step('type("nope")').terminated
    assert "The field has focus." in env.restore(snap)
    assert (env.anchor_key(), env.observation_images(), env.expert_action()) == (key, shown, obs)
    other.restore(snap)
    assert (other.anchor_key(), other.observation_images()) == (key, shown)
    assert other.step(other.expert_action()).success and env.step(env.expert_action()).success


def test_train_and_held_out_tasks_are_disjoint_by_content():
    env = make("gui-click")
    train = {content_key(env.task("train", i).data) for i in range(400)}
    heldout = {content_key(env.task("heldout", i).data) for i in range(100)}
    assert len(train) == 400 and len(heldout) == 100 and not train & heldout


def test_bad_options_are_one_line():
    cases = [({"kinds": ["drag"]}, "unknown kind 'drag' in kinds for source 'synthetic'; valid kinds: 'click', 'scroll', 'type'"),
             ({"kinds": []}, "kinds is empty; valid kinds: 'click', 'scroll', 'type'"),
             ({"source": "desktop"}, "unknown source 'desktop'; valid sources: 'miniwob', 'synthetic'"),
             ({"size": 10}, "size must be an integer from 64 to 1024 (pixels); got 10"),
             ({"reward_weights": {"hit": 1}}, "unknown reward weight 'hit'; valid weights: 'action_type', 'argument', 'box'"),
             ({"miniwob_tasks": ["click-tab"]}, "unknown miniwob task 'click-tab' in miniwob_tasks; valid tasks: "),
             ({"widgets": [0, 2]}, "widgets must be [min, max] with 1 <= min <= max <= 5 (widgets per synthetic screen); got [0, 2]"),
             ({"widgets": [3]}, "widgets must be [min, max]"),
             ({"colour": "red"}, "env 'gui-click' has no option 'colour'; valid options: 'invalid_action_penalty', 'kinds'")]
    for kwargs, message in cases:
        with pytest.raises(UserError) as err:
            make("gui-click", **kwargs)
        assert message in str(err.value) and "\n" not in str(err.value), (kwargs, str(err.value))


def test_images_contract_and_size_option():
    assert GuiClickEnv.has_images is True
    env = make("gui-click", size=160)
    assert env.observation_images() == ()
    env.reset(env.task("train", 0), 0)
    assert image(env).size == (160, 160) and "159 at the right" in env.instructions
    for i in range(20):
        data = env.task("train", i).data
        assert all(0 <= wd["box"][0] <= wd["box"][2] < 160 and 0 <= wd["box"][1] <= wd["box"][3] < data["page_height"]
                   for wd in data["widgets"])


def test_check_env_passes():
    report = check_env("gui-click")
    assert "expert" in report.checks and "snapshots" in report.checks and report.warnings == []


# ---------------------------------------------------------------------------- the MiniWoB source
@pytest.fixture()
def miniwob_env(browser_ok):
    env = make("gui-click", source="miniwob")
    yield env
    env.close()


def test_miniwob_screens_repeat_and_the_expert_clicks_the_target(miniwob_env):
    env = miniwob_env
    tasks = [env.task("heldout", i) for i in range(8)]
    shown = {}
    for task in tasks:
        obs = env.reset(task, 0)
        shown[task.index] = env.observation_images()
        assert image(env).size == (112, 112) and obs.splitlines()[0] != ""
        r = env.step(env.expert_action())
        assert r.success and r.reward == 3.0
    env.close()  # a fresh browser renders the same pixels
    for task in tasks[:3]:
        env.reset(task, 0)
        assert env.observation_images() == shown[task.index]
    env.reset(tasks[0], 0)
    assert env.step("click(0, 0, 111, 111)").success is False  # the guard holds on real pages too


def test_miniwob_source_options_and_check_env(browser_ok):
    with pytest.raises(UserError, match=r"unknown kind 'type' in kinds for source 'miniwob'; valid kinds: 'click'$"):
        make("gui-click", source="miniwob", kinds=["type"])
    report = check_env("gui-click", env_kwargs={"source": "miniwob", "miniwob_tasks": ["click-button", "click-link"]})
    assert "expert" in report.checks


@pytest.mark.parametrize("widgets", [(1, 1), (2, 3)])
def test_widgets_option_sets_how_many_widgets_a_screen_has(widgets):
    env = make("gui-click", widgets=list(widgets))
    counts = {len(env.task("train", i).data["widgets"]) for i in range(40)}
    assert counts <= set(range(widgets[0], widgets[1] + 1)) and len(counts) == widgets[1] - widgets[0] + 1
