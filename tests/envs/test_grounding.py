"""GUI grounding reward: UI-R1's format + type + argument terms and GUI-G1's box terms, checked
against values computed by hand (target boxes inclusive of their edge pixels)."""

from __future__ import annotations

import math

import pytest

from turnforge.envs.gui.grounding import (
    Box,
    ExpectedAction,
    GroundingWeights,
    GuiAction,
    box_iou,
    box_size_reward,
    gaussian_point_reward,
    grounding_reward,
    parse_action,
)
from turnforge.errors import UserError

SIZE = (112, 112)
TARGET = Box(10, 20, 29, 29)  # 20 x 10 pixels: area 200
CLICK = ExpectedAction("click", box=TARGET)


def score(text: str, expected: ExpectedAction = CLICK, weights: GroundingWeights = GroundingWeights()):
    return grounding_reward(parse_action(text, *SIZE), expected, SIZE, weights)


def test_parse_reads_the_grammar_and_refuses_the_rest():
    assert parse_action("click(10, 20)", *SIZE) == GuiAction("click", point=(10.0, 20.0))
    assert parse_action(" Click ( 3,4 ).\nThe button is there.", *SIZE) == GuiAction("click", point=(3.0, 4.0))
    assert parse_action("click(1, 2, 5, 8)", *SIZE) == GuiAction("click", point=(3.0, 5.0), box=Box(1, 2, 5, 8))
    assert parse_action('type("cat")', *SIZE) == GuiAction("type", text="cat")
    assert parse_action("I will scroll. <answer>scroll(DOWN)</answer>", *SIZE) == GuiAction("scroll", direction="down")
    for bad, why in [("click(112, 0)", "off the image"), ("click(0, 112)", "off the image"), ("click(-1, 3)", "could not parse"),
                     ("click(5, 5, 4, 9)", "x1 <= x2"), ("scroll(left)", "up or down"), ('type("")', "needs some text"),
                     ("tap(1, 2)", "could not parse"), ("", "could not parse"), ("click(1.5, 2)", "could not parse")]:
        with pytest.raises(ValueError, match=why):
            parse_action(bad, *SIZE)
    for action in (GuiAction("click", point=(7.0, 9.0)), GuiAction("click", point=(3.0, 5.0), box=Box(1, 2, 5, 8)),
                   GuiAction("type", text="owl"), GuiAction("scroll", direction="up")):
        assert parse_action(action.render(), *SIZE) == action


def test_a_point_scores_one_per_term_inside_the_box_edges_included():
    for inside in ("click(10, 20)", "click(29, 29)", "click(10, 29)", "click(20, 25)"):
        r = score(inside)
        assert (r.format, r.action_type, r.hit, r.argument, r.total, r.correct) == (1.0, 1.0, 1.0, 1.0, 3.0, True)
        assert (r.iou, r.box, r.oversized) == (0.0, 0.0, False)  # the box terms are for box answers only
    for outside in ("click(30, 29)", "click(9, 25)", "click(20, 19)", "click(20, 30)"):
        r = score(outside)
        assert (r.format, r.action_type, r.hit, r.argument, r.total, r.correct) == (1.0, 1.0, 0.0, 0.0, 2.0, False)


def test_a_box_is_scored_by_its_centre_with_gui_g1_iou_and_box_terms():
    exact = score("click(10, 20, 29, 29)")
    assert (exact.hit, exact.iou, exact.box, exact.argument, exact.total, exact.correct) == (1.0, 1.0, 1.0, 1.0, 3.0, True)
    # centre (9.5, 20.5): half a pixel left of the target, a miss
    r = score("click(9, 20, 10, 21)")
    iou = 2 / (4 + 200 - 2)  # overlap: column 10, rows 20-21
    r_box = 4 / (112 / 111 + 112 / 112 + 112 / 93 + 112 / 104)  # 1 - |dx1|/W, 1 - |dy1|/H, 1 - |dx2|/W, 1 - |dy2|/H
    assert (r.hit, r.correct) == (0.0, False)
    assert r.iou == pytest.approx(iou) and r.box == pytest.approx(r_box)
    assert r.argument == pytest.approx((0.25 * iou + 0.125 * r_box) / 1.375)
    assert r.total == pytest.approx(2 + r.argument)
    # a hit with a loose box: (9, 19, 31, 31) is 23 x 13 = 299 px, under 4 x 200
    r = score("click(9, 19, 31, 31)")
    assert r.correct and r.argument == pytest.approx((1 + 0.25 * 200 / 299 + 0.125 * 4 / (112 / 111 * 2 + 112 / 110 * 2)) / 1.375)
    assert r.argument < 1.0  # never more than a hitting point


def test_a_screen_sized_box_on_the_target_gets_almost_no_argument_reward():
    centred = ExpectedAction("click", box=Box(46, 46, 65, 65))  # centre (55.5, 55.5), area 400
    huge = parse_action("click(0, 0, 111, 111)", *SIZE)  # the same centre, area 12544 = 31.4 x the target's
    iou, r_box = 400 / 12544, 66 / 112  # each corner 46 px off: 1 - 46/112 = 66/112 four times
    guarded = grounding_reward(huge, centred, SIZE)
    assert guarded.oversized and (guarded.hit, guarded.correct) == (0.0, False)
    assert guarded.argument == pytest.approx((0.25 * iou + 0.125 * r_box) / 1.375)  # 0.0594
    assert guarded.total == pytest.approx(2.0594, abs=1e-4)
    # without the guard (GUI-G1's terms alone) the hack would still collect the hit
    open_ = grounding_reward(huge, centred, SIZE, GroundingWeights(max_area_ratio=math.inf))
    assert open_.correct and open_.argument == pytest.approx((1 + 0.25 * iou + 0.125 * r_box) / 1.375)  # 0.7866


def test_the_area_guard_holds_at_exactly_k_times_the_target():
    target = ExpectedAction("click", box=Box(50, 50, 59, 59))  # 10 x 10
    assert grounding_reward(parse_action("click(45, 45, 64, 64)", *SIZE), target, SIZE).correct  # 20 x 20 = 4 x 100
    over = grounding_reward(parse_action("click(44, 45, 64, 64)", *SIZE), target, SIZE)  # 21 x 20 = 420
    assert over.oversized and not over.correct
    assert grounding_reward(parse_action("click(44, 45, 64, 64)", *SIZE), target, SIZE,
                            GroundingWeights(max_area_ratio=4.2)).correct


def test_wrong_types_texts_and_directions():
    r = score('type("cat")')  # a click was due
    assert (r.format, r.action_type, r.argument, r.total, r.correct) == (1.0, 0.0, 0.0, 1.0, False)
    word = ExpectedAction("type", text="cat")
    assert score('type("cat")', word).total == 3.0 and score('type("cat")', word).correct
    assert (score('type("Cat")', word).total, score('type("Cat")', word).correct) == (2.0, False)  # exact text only
    assert score("click(20, 25)", word).total == 1.0
    down = ExpectedAction("scroll", direction="down")
    assert (score("scroll(down)", down).total, score("scroll(up)", down).total, score("scroll(up)", down).correct) == (3.0, 2.0, False)


def test_an_unparsable_answer_gets_nothing():
    r = grounding_reward(None, CLICK, SIZE)
    assert (r.format, r.action_type, r.hit, r.argument, r.total, r.correct) == (0.0, 0.0, 0.0, 0.0, 0.0, False)


def test_weights_scale_each_term():
    w = GroundingWeights(format=0.5, action_type=0.25, argument=2.0)
    assert score("click(20, 25)", weights=w).total == pytest.approx(2.75)
    assert score("click(0, 0)", weights=w).total == pytest.approx(0.75)
    assert score('type("x")', weights=w).total == pytest.approx(0.5)
    # no IoU or box weight: a box answer's argument is its guarded hit alone
    plain = GroundingWeights(iou=0.0, box=0.0)
    assert score("click(9, 19, 31, 31)", weights=plain).argument == 1.0
    assert GroundingWeights.from_mapping({"format": 0.5, "max_area_ratio": 2}) == GroundingWeights(format=0.5, max_area_ratio=2)
    with pytest.raises(UserError, match=r"^unknown reward weight 'hit'; valid weights: 'action_type', 'argument', 'box', "
                                        r"'format', 'gaussian', 'gaussian_sigma', 'iou', 'max_area_ratio'$"):
        GroundingWeights.from_mapping({"hit": 1.0})
    with pytest.raises(UserError, match="format must be a number >= 0; got -1"):
        GroundingWeights(format=-1)
    with pytest.raises(UserError, match="max_area_ratio must be >= 1"):
        GroundingWeights(max_area_ratio=0.5)
    with pytest.raises(UserError, match="gaussian_sigma must be > 0; got 0"):
        GroundingWeights(gaussian_sigma=0)


def test_gui_g2_gaussian_point_term_by_hand():
    # TARGET is 20 x 10 px, centre (19.5, 24.5); sigma 1 box: sx = 20, sy = 10
    assert gaussian_point_reward((19.5, 24.5), TARGET, 1.0) == 1.0
    assert gaussian_point_reward((39.5, 24.5), TARGET, 1.0) == pytest.approx(math.exp(-0.5))  # one sx right
    assert gaussian_point_reward((19.5, 4.5), TARGET, 1.0) == pytest.approx(math.exp(-2.0))  # two sy up
    assert gaussian_point_reward((39.5, 34.5), TARGET, 2.0) == pytest.approx(math.exp(-(400 / 1600 + 100 / 400) / 2))
    w = GroundingWeights(gaussian=1.0, gaussian_sigma=1.0)
    near, far, inside = score("click(39, 24)", weights=w), score("click(100, 100)", weights=w), score("click(20, 25)", weights=w)
    # a miss keeps hit 0 and correct False; its argument is half its Gaussian term: (0 + 1 * g) / 2
    assert (near.hit, near.correct) == (0.0, False)
    assert near.argument == pytest.approx(math.exp(-(19.5 ** 2 / 800 + 0.5 ** 2 / 200)) / 2)
    assert far.argument < 1e-6 < near.argument
    # inside: (1 + g) / 2 with g = exp(-(0.5^2 / 800 + 0.5^2 / 200))
    assert inside.argument == pytest.approx((1 + math.exp(-(0.25 / 800 + 0.25 / 200))) / 2) and inside.correct
    assert score("click(10, 20, 29, 29)", weights=w).argument == 1.0  # box answers keep GUI-G1's composite


def test_iou_and_box_size_by_hand():
    assert box_iou(Box(0, 0, 9, 9), Box(5, 0, 14, 9)) == pytest.approx(50 / 150)
    assert box_iou(Box(0, 0, 9, 9), Box(10, 0, 19, 9)) == 0.0  # touching edges do not overlap
    assert box_size_reward(Box(0, 0, 9, 9), Box(0, 0, 9, 9), 100, 50) == 1.0
    # x1 and x2 10 px off on a 100 px width: 0.9 each; y1 and y2 exact: 1.0 each
    assert box_size_reward(Box(10, 0, 19, 9), Box(0, 0, 9, 9), 100, 50) == pytest.approx(4 / (2 / 0.9 + 2))
    assert Box(10, 20, 29, 29).area == 200 and Box(3, 3, 3, 3).area == 1
    with pytest.raises(ValueError):
        Box(5, 0, 4, 0)
