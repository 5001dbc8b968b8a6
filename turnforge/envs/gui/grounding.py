"""GUI grounding rewards: UI-R1's composite reward with GUI-G1's box-size terms, as pure functions.

An answer is one action of a small grammar (``parse_action``): ``click(x, y)`` (a pixel of the
shown image), ``click(x1, y1, x2, y2)`` (a box, scored by its centre), ``type("text")`` or
``scroll(up|down)``. ``grounding_reward(action, expected, image_size, weights)`` scores it
against the action that solves the step (``ExpectedAction``) and returns a ``RewardBreakdown``::

    total = w.format * format + w.action_type * action_type + w.argument * argument

- ``format`` (UI-R1's R_F): 1 when the answer parses as one action, else 0 (``action=None``);
- ``action_type`` (UI-R1's R_T): 1 when its type is the expected one;
- ``argument`` (UI-R1's R_C for clicks), 0 unless the type matches:

  - a point click: ``hit``, 1 when the point lies in the target box (edge pixels included);
    with ``w.gaussian > 0``, ``(hit + w.gaussian * g) / (1 + w.gaussian)``, where ``g`` is
    GUI-G²'s Gaussian point reward ``exp(-((x - cx)^2 / (2 sx^2) + (y - cy)^2 / (2 sy^2)))``
    around the target's centre, ``sx = w.gaussian_sigma * box width`` and ``sy`` likewise
    (GUI-G²'s variance adapts to the element's size): a miss close to the target earns more
    than one across the screen, so a group whose clicks all miss still has an advantage signal;
  - a box click: ``(hit + w.iou * iou + w.box * box) / (1 + w.iou + w.box)``, GUI-G1's
    ``R_hit + alpha R_IoU + beta R_box`` with ``hit`` taken at the box's centre, ``iou`` the
    boxes' intersection over union and ``box`` GUI-G1's box-size term: the harmonic mean of
    ``1 - |c_pred - c_gt| / side`` over the four corner coordinates (``side`` = image width for
    x, height for y), as the authors' code computes it (``box_reward`` in Yuqi-Zhou/GUI-G1,
    ``grpo_rec.py``; alpha = 0.25, beta = 0.125 there and by default here);
  - ``type("text")``: 1 when the text equals the expected text exactly; ``scroll``: 1 when the
    direction is the expected one.

Boxes are inclusive integer pixel boxes: ``(x1, y1, x2, y2)`` holds pixel ``(x, y)`` when
``x1 <= x <= x2`` and ``y1 <= y <= y2``; its area is ``(x2 - x1 + 1) * (y2 - y1 + 1)``.

Departures from the papers:

- UI-R1's R_C scores click coordinates only; the text and scroll-direction checks are this
  module's, so that every action type has an argument term.
- GUI-G1 adds its terms to the hit reward unnormalised; here the box composite is divided by
  ``1 + alpha + beta``, so a box answer scores at most what a hitting point click scores (an
  exact box scores exactly that) and never pays more than a point for the same target.
- The guard: ``hit`` of a box answer counts only when the box's area is at most
  ``w.max_area_ratio`` (default 4) times the target's (``oversized`` otherwise). GUI-G1 relies on
  the IoU and box terms alone to keep box sizes honest; the hard cap is this module's, so that a
  box spanning the screen whose centre happens to fall on the target earns (almost) no argument
  reward.
  ``max_area_ratio=inf`` turns it off (GUI-G1 as published, up to the normalisation).
- GUI-G² (Tang et al. 2025) replaces the hit with its Gaussian point and coverage rewards; here
  the Gaussian point term is added to the hit (off by default, weight ``w.gaussian``) and its
  spread is a free multiple of the box size; its coverage term (for box answers) is not built.
- The format term has no ``<think>`` tags to check: an answer's format is the action grammar
  (an ``<answer>...</answer>`` tag around the action is accepted, as UI-R1's answers carry).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from turnforge.errors import UserError, choices

#: Action types of the grammar.
ACTION_TYPES = ("click", "type", "scroll")
#: Directions of ``scroll``.
DIRECTIONS = ("up", "down")
#: The grammar, as invalid-action observations quote it.
GRAMMAR = 'click(x, y) | click(x1, y1, x2, y2) | type("text") | scroll(up|down)'

_INT = r"\s*(\d{1,5})\s*"
_CLICK = re.compile(rf"^click\s*\({_INT},{_INT}\)$", re.IGNORECASE)
_BOX = re.compile(rf"^click\s*\({_INT},{_INT},{_INT},{_INT}\)$", re.IGNORECASE)
_TYPE = re.compile(r'^type\s*\(\s*"([^"\n]*)"\s*\)$', re.IGNORECASE)
_SCROLL = re.compile(r"^scroll\s*\(\s*(\w+)\s*\)$", re.IGNORECASE)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)


@dataclass(frozen=True)
class Box:
    """An inclusive integer pixel box: pixel ``(x, y)`` is inside when ``x1 <= x <= x2`` and ``y1 <= y <= y2``."""

    x1: int
    y1: int
    x2: int
    y2: int

    def __post_init__(self) -> None:
        if self.x2 < self.x1 or self.y2 < self.y1:
            raise ValueError(f"a box needs x1 <= x2 and y1 <= y2; got {self.as_tuple()}")

    @property
    def area(self) -> int:
        return (self.x2 - self.x1 + 1) * (self.y2 - self.y1 + 1)

    @property
    def centre(self) -> tuple[float, float]:
        return (self.x1 + self.x2) / 2, (self.y1 + self.y2) / 2

    def contains(self, x: float, y: float) -> bool:
        return self.x1 <= x <= self.x2 and self.y1 <= y <= self.y2

    def shifted(self, dx: int, dy: int) -> "Box":
        return Box(self.x1 + dx, self.y1 + dy, self.x2 + dx, self.y2 + dy)

    def as_tuple(self) -> tuple[int, int, int, int]:
        return self.x1, self.y1, self.x2, self.y2


@dataclass(frozen=True)
class GuiAction:
    """One parsed answer. ``point`` is where a click lands: its ``(x, y)``, or a box answer's centre."""

    kind: str  # "click", "type" or "scroll"
    point: tuple[float, float] | None = None  # click: the pixel clicked (a box answer: its centre)
    box: Box | None = None  # click(x1, y1, x2, y2): the box; None for a point click and the other types
    text: str = ""  # type: the text typed
    direction: str = ""  # scroll: "up" or "down"

    def render(self) -> str:
        """The action's canonical text (what ``parse_action`` reads back to this action)."""
        if self.kind == "click" and self.box is not None:
            return "click({}, {}, {}, {})".format(*self.box.as_tuple())
        if self.kind == "click":
            x, y = self.point  # type: ignore[misc]
            return f"click({int(x)}, {int(y)})"
        if self.kind == "type":
            return f'type("{self.text}")'
        return f"scroll({self.direction})"


@dataclass(frozen=True)
class ExpectedAction:
    """The action that solves the current step (what ``grounding_reward`` scores against)."""

    kind: str  # "click", "type" or "scroll"
    box: Box | None = None  # click: the target element's box, in the shown image's pixels
    text: str = ""  # type: the text to type
    direction: str = ""  # scroll: the direction to scroll

    def __post_init__(self) -> None:
        if self.kind not in ACTION_TYPES:
            raise ValueError(f"expected action kind must be one of {ACTION_TYPES}; got {self.kind!r}")
        if self.kind == "click" and self.box is None:
            raise ValueError("an expected click needs the target's box")


@dataclass(frozen=True)
class GroundingWeights:
    """Weights of the reward terms (the total is ``format*R_F + action_type*R_T + argument*R_C``)."""

    format: float = 1.0  # UI-R1 R_F: the answer parses as one action of the grammar
    action_type: float = 1.0  # UI-R1 R_T: the action's type is the expected one
    argument: float = 1.0  # UI-R1 R_C: the click hits the target (a box: the composite below), the text or direction is right
    iou: float = 0.25  # GUI-G1 alpha: weight of a box answer's IoU with the target inside the box composite
    box: float = 0.125  # GUI-G1 beta: weight of a box answer's box-size term R_box inside the box composite
    max_area_ratio: float = 4.0  # the guard: a box larger than this times the target's area gets no hit (inf: off)
    gaussian: float = 0.0  # GUI-G²: weight of the Gaussian point term beside the hit in a point click's argument (0: off)
    gaussian_sigma: float = 1.0  # GUI-G²: the Gaussian's standard deviation per axis, in target box widths / heights

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise UserError(f"reward weight {f.name} must be a number >= 0; got {value!r}")
        if self.gaussian_sigma <= 0:
            raise UserError(f"reward weight gaussian_sigma must be > 0; got {self.gaussian_sigma!r}")
        if self.max_area_ratio < 1:
            raise UserError(f"reward weight max_area_ratio must be >= 1 (a box the target's size always counts); "
                            f"got {self.max_area_ratio!r}")

    @classmethod
    def from_mapping(cls, values: dict | None) -> "GroundingWeights":
        """Weights from a mapping of field names (missing ones keep their defaults); an unknown
        name is one ``UserError`` line naming it and the valid names."""
        values = dict(values or {})
        valid = [f.name for f in fields(cls)]
        for key in values:
            if key not in valid:
                raise UserError(f"unknown reward weight {key!r}; valid weights: {choices(valid)}")
        return cls(**values)


@dataclass(frozen=True)
class RewardBreakdown:
    """The terms of one answer's reward (see the module docstring) and whether it solves the step."""

    format: float  # 1.0 when the answer parsed as an action, else 0.0
    action_type: float  # 1.0 when the action's type is the expected one
    hit: float  # 1.0 when the click point (a box's centre) is in the target box and the box is not oversized
    iou: float  # a box answer's IoU with the target box (0.0 for every other answer)
    box: float  # a box answer's GUI-G1 R_box (0.0 for every other answer)
    argument: float  # the argument term in [0, 1] (R_C; the box composite for a box answer)
    oversized: bool  # a box answer larger than max_area_ratio times the target's area
    correct: bool  # the action does what the expected one does: right type, and a hit / the same text / direction
    total: float  # format * w.format + action_type * w.action_type + argument * w.argument


def parse_action(text: str, width: int, height: int) -> GuiAction:
    """The action of an answer's first non-empty line (or of its last ``<answer>...</answer>``
    tag; a trailing period is ignored), on an image of ``width`` x ``height`` pixels; raises
    ``ValueError`` saying what is wrong (not the grammar, a coordinate off the image, a box whose
    corners are swapped)."""
    tagged = _ANSWER_TAG.findall(text)
    body = tagged[-1] if tagged else text
    lines = [line.strip() for line in body.strip().splitlines() if line.strip()]
    line = lines[0].removesuffix(".").strip() if lines else ""
    if m := _CLICK.match(line):
        x, y = int(m.group(1)), int(m.group(2))
        _on_image(x, y, width, height)
        return GuiAction("click", point=(float(x), float(y)))
    if m := _BOX.match(line):
        x1, y1, x2, y2 = (int(g) for g in m.groups())
        _on_image(x1, y1, width, height)
        _on_image(x2, y2, width, height)
        if x2 < x1 or y2 < y1:
            raise ValueError(f"a box is click(x1, y1, x2, y2) with x1 <= x2 and y1 <= y2 (top-left, then bottom-right); "
                             f"got ({x1}, {y1}, {x2}, {y2})")
        box = Box(x1, y1, x2, y2)
        return GuiAction("click", point=box.centre, box=box)
    if m := _TYPE.match(line):
        if not m.group(1):
            raise ValueError('type("text") needs some text')
        return GuiAction("type", text=m.group(1))
    if m := _SCROLL.match(line):
        direction = m.group(1).lower()
        if direction not in DIRECTIONS:
            raise ValueError(f"scroll takes up or down, not {m.group(1)!r}")
        return GuiAction("scroll", direction=direction)
    shown = repr(line) if len(line) <= 40 else repr(line[:37] + "...")
    raise ValueError(f"could not parse {shown} as an action; actions: {GRAMMAR}")


def _on_image(x: int, y: int, width: int, height: int) -> None:
    if not (0 <= x < width and 0 <= y < height):
        raise ValueError(f"({x}, {y}) is off the image: x must be in 0..{width - 1} and y in 0..{height - 1}")


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two inclusive pixel boxes."""
    iw = min(a.x2, b.x2) - max(a.x1, b.x1) + 1
    ih = min(a.y2, b.y2) - max(a.y1, b.y1) + 1
    inter = max(iw, 0) * max(ih, 0)
    return inter / (a.area + b.area - inter)


def box_size_reward(pred: Box, target: Box, width: int, height: int) -> float:
    """GUI-G1's R_box: the harmonic mean of ``1 - |pred_c - target_c| / side`` over the four
    coordinates ``c`` (``side`` = ``width`` for x1, x2 and ``height`` for y1, y2); 0 when a
    coordinate is a full side or more away. 1 for the target box itself."""
    scores = (1 - abs(pred.x1 - target.x1) / width, 1 - abs(pred.y1 - target.y1) / height,
              1 - abs(pred.x2 - target.x2) / width, 1 - abs(pred.y2 - target.y2) / height)
    if min(scores) <= 0:
        return 0.0
    return 4 / sum(1 / s for s in scores)


def gaussian_point_reward(point: tuple[float, float], target: Box, sigma: float) -> float:
    """GUI-G²'s Gaussian point reward: ``exp(-(dx^2 / (2 sx^2) + dy^2 / (2 sy^2)))`` of the point's
    offset from the target's centre, ``sx = sigma * width`` and ``sy = sigma * height`` of the box
    (1 at the centre)."""
    (cx, cy), (x, y) = target.centre, point
    sx = sigma * (target.x2 - target.x1 + 1)
    sy = sigma * (target.y2 - target.y1 + 1)
    return math.exp(-((x - cx) ** 2 / (2 * sx * sx) + (y - cy) ** 2 / (2 * sy * sy)))


def grounding_reward(action: GuiAction | None, expected: ExpectedAction, image_size: tuple[int, int],
                     weights: GroundingWeights = GroundingWeights()) -> RewardBreakdown:
    """Score ``action`` (None: the answer did not parse) against ``expected`` on an image of
    ``image_size = (width, height)`` pixels (see the module docstring for the formula)."""
    if action is None:
        return RewardBreakdown(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, False, False, 0.0)
    type_ok = action.kind == expected.kind
    hit = iou = box = argument = 0.0
    oversized = correct = False
    if type_ok and expected.kind == "click":
        target = expected.box
        assert target is not None and action.point is not None
        inside = target.contains(*action.point)
        if action.box is None:
            hit = float(inside)
            argument = hit
            if weights.gaussian > 0:
                g = gaussian_point_reward(action.point, target, weights.gaussian_sigma)
                argument = (hit + weights.gaussian * g) / (1 + weights.gaussian)
        else:
            oversized = action.box.area > weights.max_area_ratio * target.area
            hit = float(inside and not oversized)
            iou = box_iou(action.box, target)
            box = box_size_reward(action.box, target, *image_size)
            argument = (hit + weights.iou * iou + weights.box * box) / (1 + weights.iou + weights.box)
        correct = hit == 1.0
    elif type_ok and expected.kind == "type":
        correct = action.text == expected.text
        argument = float(correct)
    elif type_ok:
        correct = action.direction == expected.direction
        argument = float(correct)
    type_term = float(type_ok)
    total = weights.format * 1.0 + weights.action_type * type_term + weights.argument * argument
    return RewardBreakdown(1.0, type_term, hit, iou, box, argument, oversized, correct, total)


__all__ = [
    "ACTION_TYPES",
    "Box",
    "DIRECTIONS",
    "ExpectedAction",
    "GRAMMAR",
    "GroundingWeights",
    "GuiAction",
    "RewardBreakdown",
    "box_iou",
    "box_size_reward",
    "gaussian_point_reward",
    "grounding_reward",
    "parse_action",
]
