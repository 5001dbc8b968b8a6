"""``gui-click``: GUI grounding from screenshots, scored with UI-R1's reward and GUI-G1's guard.

Each observation is a screenshot (``observation_images()``: PNG bytes) and a short text: the
instruction and one line on how to answer. The agent answers with one action on its first line
(``turnforge.envs.gui.grounding.parse_action``): ``click(x, y)`` (a pixel of the shown image,
(0, 0) its top-left corner), ``click(x1, y1, x2, y2)`` (a box, scored by its centre with GUI-G1's
box-size guard), ``type("text")`` (into the focused field) or ``scroll(up|down)`` (one screen).

Sources (option ``source``):

- ``synthetic`` (default): screens drawn with PIL, ``size`` x ``size`` pixels (default 112): 3 to
  5 widgets (option ``widgets=[min, max]``; coloured buttons with short labels, text fields, checkboxes), each with its own
  colour and label, so the instruction names its target by both ('Click the red "OK" button.').
  Task kinds (option ``kinds``, default all): ``click`` (one turn: click the target), ``type``
  (click the field, then type the asked word) and ``scroll`` (the page is two screens tall and the
  target below the fold: ``scroll(down)``, then click it; a scroll bar shows there is more).
- ``miniwob``: screenshots of MiniWoB++ pages rendered by Chromium (``turnforge.envs.web``): the
  160 x 160 task area below the instruction, resized to ``size`` x ``size``; one-click tasks
  (``MINIWOB_TASKS``) whose target is the element the ``miniwob`` env's scripted expert clicks,
  its box read from the page (a seed whose target is covered at its centre, e.g. one button
  under the other in ``click-test-2``, moves on to the next seed). The page only provides the
  picture: clicks are scored against the box, not sent to the page. Kind ``click`` only.

A task is its content in ``task.data`` (the widgets with their boxes, the target, the kind, the
word; or the MiniWoB task and seed), drawn by a ``TaskGenerator`` and split by a hash of that
content (10% held out), so train and held-out screens never coincide; the same task gives the
same PNG bytes. Tasks from a JSONL file (``env.tasks``) carry the same fields.

Reward per step: ``grounding_reward`` of the answer against the action that solves the step
(UI-R1: format + action type + argument; see ``turnforge.envs.gui.grounding``; weights by the
``reward_weights`` option). A right action advances the episode (``success`` when the last one is
done: the final click in the target box, the word typed into the right field); any other valid
action (a click outside the target, a box larger than the guard allows, a wrong word or direction,
an action of the wrong type) ends it: terminated, not success. An unparsable answer is
``invalid_action=True`` with reward ``invalid_action_penalty`` (0.0: UI-R1 gives an answer without
the format nothing) and an observation quoting the grammar; it changes nothing.

Capabilities: ``expert_action`` (the target box's centre, the asked word, ``scroll(down)``),
``random_action`` (a uniformly random click on the image, or a random word or direction),
``snapshot``/``restore``, ``anchor_key``, ``observation_images``.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import random
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Mapping, Sequence

from turnforge.envs.base import Env
from turnforge.envs.gui.grounding import (
    GRAMMAR,
    Box,
    ExpectedAction,
    GroundingWeights,
    GuiAction,
    RewardBreakdown,
    grounding_reward,
    parse_action,
)
from turnforge.envs.tasks import TaskGenerator, content_key
from turnforge.errors import UserError, choices
from turnforge.types import EnvSnapshot, StepResult, Task

KINDS = ("click", "type", "scroll")
SOURCES = ("synthetic", "miniwob")
#: MiniWoB tasks solved by one click on one element (the ``miniwob`` env's expert names it).
MINIWOB_TASKS = ("click-button", "click-dialog", "click-dialog-2", "click-link", "click-test", "click-test-2")
#: Colour name -> (fill, text colour on it).
COLOURS = {
    "red": ("#d62828", "white"), "green": ("#2a9d3f", "white"), "blue": ("#1f5fd6", "white"),
    "yellow": ("#f2c318", "black"), "orange": ("#f07f13", "black"), "purple": ("#7b3fb5", "white"),
    "pink": ("#e85d9c", "black"), "gray": ("#8a8a8a", "white"), "brown": ("#8b5a2b", "white"),
    "black": ("#202020", "white"),
}
LABELS = {
    "button": ("OK", "Save", "Send", "Stop", "Next", "Back", "Quit", "Help", "Copy", "Edit", "Open", "Undo", "Play",
               "Home", "Menu", "Done", "Add", "Pay", "Buy", "Yes", "No", "Go"),
    "field": ("Name", "Email", "City", "Zip", "User", "Note", "Town", "Code"),
    "checkbox": ("Cats", "Dogs", "Tea", "Milk", "Rain", "Snow", "Jazz", "Rock", "Fish", "Bird", "Golf", "Chess"),
}
#: Words a ``type`` task asks for.
WORDS = ("cat", "dog", "sun", "sea", "map", "pen", "cup", "hat", "box", "key", "egg", "ice", "jam", "owl", "fox", "bee")
BACKGROUND = "#f4f4f4"
MINIWOB_AREA_TOP = 50  # MiniWoB's instruction bar (#query: 44 px + 2 x 3 px padding); the task area is below it
#: Seeds a MiniWoB capture tries, from the task's own on, for a page whose target is visible.
MINIWOB_TRIES = 20
#: JS: the element is what a click at its centre reaches (not covered by another), inside the task area.
_ON_TOP = """(el, areaTop) => { const r = el.getBoundingClientRect(); const x = r.left + r.width / 2, y = r.top + r.height / 2;
  const hit = document.elementFromPoint(x, y); return y >= areaTop && hit !== null && (hit === el || el.contains(hit)); }"""
ANSWER_LINE = 'Screenshot above; answer with click(x, y), click(x1, y1, x2, y2), type("text") or scroll(up|down).'


# ---------------------------------------------------------------------------- synthetic screens
def make_screen(rng: random.Random, kind: str, size: int, count: tuple[int, int] = (3, 5)) -> dict[str, Any]:
    """A synthetic task's content (JSON-able): ``size`` x ``size`` screens, a page one screen tall
    (two for ``scroll``), ``count[0]`` to ``count[1]`` (default 3 to 5) non-overlapping widgets with
    distinct colours and labels, the target's index and, for ``type``, the word to type."""
    s = size / 112
    page_height = 2 * size if kind == "scroll" else size
    right = size - (round(6 * s) if kind == "scroll" else 0)  # room for the scroll bar
    while True:  # a draw that cannot be laid out is redrawn (rare)
        n = rng.randint(*count)
        target_type = "field" if kind == "type" else rng.choice(("button", "button", "checkbox", "field"))
        types = [target_type] + [rng.choice(("button", "button", "checkbox", "field")) for _ in range(n - 1)]
        colours = rng.sample(sorted(COLOURS), n)
        pools = {t: rng.sample(LABELS[t], len(LABELS[t])) for t in LABELS}
        widgets = []
        for i, (wtype, colour) in enumerate(zip(types, colours)):
            label = pools[wtype].pop()
            w, h = _widget_size(wtype, label, s)
            if kind == "scroll":  # the target below the fold, the first two others above it
                top, bottom = (size, page_height) if i == 0 else ((0, size) if i <= 2 else rng.choice([(0, size), (size, page_height)]))
            else:
                top, bottom = 0, page_height
            box = _place(rng, w, h, right, top, bottom, [wd["box"] for wd in widgets], s)
            if box is None:
                break
            widgets.append({"type": wtype, "label": label, "colour": colour, "box": box})
        else:
            order = list(range(n))
            rng.shuffle(order)  # the target sits anywhere in the list
            data: dict[str, Any] = {"source": "synthetic", "kind": kind, "size": size, "page_height": page_height,
                                    "widgets": [widgets[i] for i in order], "target": order.index(0)}
            if kind == "type":
                data["word"] = rng.choice(WORDS)
            return data


def _widget_size(wtype: str, label: str, s: float) -> tuple[int, int]:
    """Width and height in pixels (from the label's length, not the font's metrics, so task
    content does not depend on the Pillow version)."""
    if wtype == "button":
        return max(round((8 + 7 * len(label)) * s), round(26 * s)), round(16 * s)
    if wtype == "field":
        return round(50 * s), round(16 * s)
    return round((13 + 7 * len(label)) * s), round(12 * s)


def _place(rng: random.Random, w: int, h: int, right: int, top: int, bottom: int, taken: Sequence[Sequence[int]],
           s: float) -> list[int] | None:
    """A box ``[x1, y1, x2, y2]`` (inclusive) of ``w`` x ``h`` inside ``[0, right) x [top, bottom)``
    with a margin, clear of ``taken`` by a gap; None after 100 tries."""
    margin, gap = round(2 * s), round(3 * s)
    if right - w - 2 * margin < 0 or bottom - top - h - 2 * margin < 0:
        return None
    for _ in range(100):
        x = rng.randint(margin, right - w - margin)
        y = rng.randint(top + margin, bottom - h - margin)
        box = [x, y, x + w - 1, y + h - 1]
        if all(box[0] > t[2] + gap or box[2] < t[0] - gap or box[1] > t[3] + gap or box[3] < t[1] - gap for t in taken):
            return box
    return None


@lru_cache(maxsize=8)
def _font(px: int):
    from PIL import ImageFont

    return ImageFont.load_default(size=px)


def draw_screen(data: Mapping[str, Any], offset: int, focused: bool, typed: str) -> bytes:
    """PNG bytes of a synthetic screen's view: the page scrolled down by ``offset`` pixels, the
    target field ``focused`` (a thicker border and a caret) and holding ``typed``."""
    from PIL import Image, ImageDraw

    size, page_height = data["size"], data["page_height"]
    s = size / 112
    page = Image.new("RGB", (size, page_height), BACKGROUND)
    draw = ImageDraw.Draw(page)
    font = _font(max(8, round(10 * s)))
    line = max(1, round(2 * s))
    for i, wd in enumerate(data["widgets"]):
        x1, y1, x2, y2 = wd["box"]
        fill, ink = COLOURS[wd["colour"]]
        cy = (y1 + y2 + 1) / 2
        if wd["type"] == "button":
            draw.rounded_rectangle((x1, y1, x2, y2), radius=max(1, round(3 * s)), fill=fill)
            draw.text(((x1 + x2 + 1) / 2, cy), wd["label"], fill=ink, font=font, anchor="mm")
        elif wd["type"] == "field":
            active = focused and i == data["target"]
            draw.rectangle((x1, y1, x2, y2), fill="white", outline=fill, width=line + (1 if active else 0))
            text = typed if (active and typed) else wd["label"]
            draw.text((x1 + round(4 * s), cy), text, fill="black" if active and typed else "#777777", font=font, anchor="lm")
            if active:
                caret = x1 + round(4 * s) + (font.getlength(typed) if typed else 0) + 1
                draw.line((caret, y1 + 3 * line, caret, y2 - 3 * line), fill="black", width=1)
        else:
            sq = round(10 * s)
            top = round(cy - sq / 2)
            draw.rectangle((x1, top, x1 + sq - 1, top + sq - 1), fill="white", outline=fill, width=line)
            draw.text((x1 + sq + round(3 * s), cy), wd["label"], fill="black", font=font, anchor="lm")
    view = page.crop((0, offset, size, offset + size))
    if page_height > size:  # a scroll bar: the thumb shows which part of the page is in view
        bar = ImageDraw.Draw(view)
        x0 = size - round(4 * s)
        bar.rectangle((x0, 0, size - 1, size - 1), fill="#dddddd")
        thumb = size * size // page_height
        y0 = offset * size // page_height
        bar.rectangle((x0, y0, size - 1, y0 + thumb - 1), fill="#999999")
    return _png(view)


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=6, optimize=False)
    return buf.getvalue()


def instruction(data: Mapping[str, Any]) -> str:
    """The instruction of a synthetic task: its target named by colour and label."""
    wd = data["widgets"][data["target"]]
    if data["kind"] == "type":
        return f'Type "{data["word"]}" into the {wd["colour"]} "{wd["label"]}" field.'
    return f'Click the {wd["colour"]} "{wd["label"]}" {wd["type"]}.'


# ---------------------------------------------------------------------------- the env
@dataclass(frozen=True)
class Screen:
    """What an episode needs of its task: the target (page pixels), the kind, the instruction."""

    kind: str
    size: int
    page_height: int
    target: Box
    instruction: str
    word: str = ""
    png: bytes | None = None  # a captured screenshot (miniwob); None: drawn from the task data


@dataclass(frozen=True)
class _State:
    offset: int = 0  # pixels the page is scrolled down
    focused: bool = False  # the target field has focus (type tasks)
    typed: str = ""  # text typed into it


def _subset(option: str, what: str, given: str | Sequence[str], valid: Sequence[str], where: str = "") -> tuple[str, ...]:
    """``given`` (one name or several) checked against ``valid``: one ``UserError`` line for an unknown
    name or none at all."""
    names = tuple([given] if isinstance(given, str) else given)
    plural = "tasks" if what.endswith("task") else f"{what}s"
    for name in names:
        if name not in valid:
            raise UserError(f"env gui-click: unknown {what} {name!r} in {option}{where}; valid {plural}: {choices(valid)}")
    if not names:
        raise UserError(f"env gui-click: {option} is empty; valid {plural}: {choices(valid)}")
    return names


class GuiClickEnv(Env):
    """See the module docstring."""

    has_images = True
    observation_role = "user"

    def __init__(self, size: int = 112, kinds: Sequence[str] | None = None, source: str = "synthetic",
                 miniwob_tasks: Sequence[str] = MINIWOB_TASKS, reward_weights: Mapping[str, float] | None = None,
                 widgets: Sequence[int] = (3, 5),
                 invalid_action_penalty: float = 0.0) -> None:
        if source not in SOURCES:
            raise UserError(f"env gui-click: unknown source {source!r}; valid sources: {choices(SOURCES)}")
        if isinstance(size, bool) or not isinstance(size, int) or not 64 <= size <= 1024:
            raise UserError(f"env gui-click: size must be an integer from 64 to 1024 (pixels); got {size!r}")
        valid_kinds = KINDS if source == "synthetic" else ("click",)
        kinds = _subset("kinds", "kind", valid_kinds if kinds is None else kinds, valid_kinds, f" for source {source!r}")
        miniwob_tasks = _subset("miniwob_tasks", "miniwob task", miniwob_tasks, MINIWOB_TASKS)
        if source == "miniwob":
            from turnforge.envs.web.browser import chromium_path, require_playwright
            from turnforge.envs.web.miniwob import html_dir

            html_dir()
            require_playwright()
            chromium_path()  # missing Chromium: one line now, before any episode
        if (len(widgets) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in widgets)
                or not 1 <= widgets[0] <= widgets[1] <= 5):
            raise UserError(f"env gui-click: widgets must be [min, max] with 1 <= min <= max <= 5 (widgets per synthetic "
                            f"screen); got {list(widgets)!r}")
        self.widget_range = (int(widgets[0]), int(widgets[1]))
        self.size, self.kinds, self.source, self.miniwob_tasks = size, kinds, source, miniwob_tasks
        self.weights = GroundingWeights.from_mapping(dict(reward_weights or {}))
        self.invalid_action_penalty = float(invalid_action_penalty)
        self.tasks = TaskGenerator(self._draw_task)
        self.instructions = (
            f"You operate a graphical user interface from screenshots. Each message shows a screenshot ({size} x {size} "
            f"pixels; x runs from 0 at the left edge to {size - 1} at the right, y from 0 at the top to {size - 1} at the "
            "bottom) and an instruction. Answer with one action on the first line: click(x, y) clicks pixel (x, y); "
            "click(x1, y1, x2, y2) clicks the centre of the box with top-left corner (x1, y1) and bottom-right corner "
            '(x2, y2); type("text") types into the field that has focus (click it first); scroll(up) or scroll(down) '
            "scrolls the page by one screen. A wrong action ends the episode."
        )
        self._browser = None
        self._captures: OrderedDict[tuple, Screen] = OrderedDict()
        self._pngs: OrderedDict[tuple, bytes] = OrderedDict()
        self._task: Task | None = None
        self._data: Mapping[str, Any] = {}
        self._key = ""
        self._screen: Screen | None = None
        self._state = _State()
        self.done = True

    def _draw_task(self, rng: random.Random) -> dict[str, Any]:
        if self.source == "miniwob":
            return {"source": "miniwob", "task": rng.choice(self.miniwob_tasks), "seed": rng.randrange(2**31),
                    "size": self.size}
        return make_screen(rng, rng.choice(self.kinds), self.size, self.widget_range)

    # ------------------------------------------------------------------ the contract
    def reset(self, task: Task, seed: int) -> str:
        """Start ``task`` (``seed`` is unused: the env has no randomness of its own)."""
        data = task.data or {}
        self._screen = self._screen_of(data, task)
        self._task, self._data, self._key = task, data, content_key(data)
        self._state, self.done = _State(), False
        return self._observation()

    def step(self, action: str) -> StepResult:
        if self.done or self._screen is None:
            raise RuntimeError("gui-click: step() after the episode ended; call reset() first")
        screen, state = self._screen, self._state
        try:
            parsed = parse_action(action, screen.size, screen.size)
        except ValueError as err:
            observation = f"Invalid action: {err}. Valid actions: {GRAMMAR}.\n{self._observation()}"
            return StepResult(observation, self.invalid_action_penalty, False, False, invalid_action=True)
        expected = self._expected()
        score = grounding_reward(parsed, expected, (screen.size, screen.size), self.weights)
        info = {"reward_format": score.format, "reward_type": score.action_type, "reward_argument": score.argument}
        if not score.correct:
            self.done = True
            return StepResult(f"Wrong action: {_why(parsed, expected, score, self.weights)}. Episode over.", score.total,
                              True, False, info=info)
        if parsed.kind == "scroll":
            self._state = replace(state, offset=screen.size)
        elif parsed.kind == "click" and screen.kind == "type":
            self._state = replace(state, focused=True)
        else:  # the final click, or the word typed
            self._state = replace(state, typed=parsed.text)
            self.done = True
            return StepResult("Done: the task is solved.", score.total, True, False, success=True, info=info)
        return StepResult(self._observation(), score.total, False, False, info=info)

    def _observation(self) -> str:
        assert self._screen is not None
        status = ""
        if self._state.focused:
            status = "The field has focus.\n"
        elif self._state.offset:
            status = "Scrolled down one screen.\n"
        return f"{self._screen.instruction}\n{status}{ANSWER_LINE}"

    def _expected(self) -> ExpectedAction:
        """The action that solves the current step, in the shown image's pixels."""
        screen, state = self._screen, self._state
        assert screen is not None
        if screen.kind == "scroll" and state.offset == 0:
            return ExpectedAction("scroll", direction="down")
        if screen.kind == "type" and state.focused:
            return ExpectedAction("type", text=screen.word)
        return ExpectedAction("click", box=screen.target.shifted(0, -state.offset))

    def observation_images(self) -> tuple[bytes, ...]:
        """The screenshot shown with the latest observation (PNG bytes); () before any reset."""
        if self._screen is None:
            return ()
        if self._screen.png is not None:
            return (self._screen.png,)
        key = (self._key, self._state)
        png = self._pngs.get(key)
        if png is None:
            png = draw_screen(self._data, self._state.offset, self._state.focused, self._state.typed)
            self._pngs[key] = png
            if len(self._pngs) > 64:
                self._pngs.popitem(last=False)
        return (png,)

    # ------------------------------------------------------------------ tasks
    def _screen_of(self, data: Mapping[str, Any], task: Task) -> Screen:
        source = data.get("source")
        if source == "miniwob":
            return self._capture(data)
        if source != "synthetic":
            raise ValueError(f"gui-click: task {task.task_id} has source {source!r}; valid sources: {choices(SOURCES)}")
        try:
            kind, size, page_height = data["kind"], int(data["size"]), int(data["page_height"])
            target = Box(*data["widgets"][data["target"]]["box"])
            text = instruction(data)
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise ValueError(f"gui-click: task {task.task_id} is not a synthetic screen ({type(err).__name__}: {err})") from None
        if kind not in KINDS or not (0 <= target.x1 and target.x2 < size and 0 <= target.y1 and target.y2 < page_height):
            raise ValueError(f"gui-click: task {task.task_id} has kind {kind!r} or a target off its page")
        return Screen(kind, size, page_height, target, text, data.get("word", ""))

    def _capture(self, data: Mapping[str, Any]) -> Screen:
        """The MiniWoB page of ``data`` (task, seed) in Chromium: the task area's screenshot,
        resized to ``size`` x ``size``, and the box of the element the scripted expert clicks."""
        name, seed, size = data["task"], int(data["seed"]), int(data["size"])
        key = (name, seed, size)
        if key in self._captures:
            self._captures.move_to_end(key)
            return self._captures[key]
        if name not in MINIWOB_TASKS:
            raise ValueError(f"gui-click: {name!r} is not a one-click MiniWoB task ({', '.join(MINIWOB_TASKS)})")
        # the miniwob env's page set-up and expert, reused as they are
        from turnforge.envs.web.miniwob import AFTER_START, HEIGHT, START_EPISODE, WIDTH, dom_js, expert, html_dir

        url, after = (html_dir() / f"{name}.html").as_uri(), AFTER_START.get(name)

        def shoot(page) -> tuple[bytes, dict, str]:
            for k in range(MINIWOB_TRIES):  # a page whose target is hidden moves on to the next seed
                page.goto(url)
                if not page.evaluate(START_EPISODE % repr(str((seed + k) % 2**31))):
                    raise RuntimeError(f"gui-click: MiniWoB task {name!r} did not become ready")
                if after:
                    page.evaluate(after)
                utterance = page.evaluate("core.getUtterance()")
                ref = int(expert(name, utterance, page.evaluate(dom_js()), []).split()[1])
                handle = page.query_selector(f'[data-tf-ref="{ref}"]')
                if handle.evaluate(_ON_TOP, MINIWOB_AREA_TOP):
                    clip = {"x": 0, "y": MINIWOB_AREA_TOP, "width": WIDTH, "height": HEIGHT - MINIWOB_AREA_TOP}
                    return page.screenshot(clip=clip), handle.bounding_box(), utterance
            raise RuntimeError(f"gui-click: MiniWoB {name!r} hides its target on seeds {seed} to {seed + MINIWOB_TRIES - 1}")

        if self._browser is None:
            from turnforge.envs.web.browser import Browser

            self._browser = Browser(WIDTH, HEIGHT)
        raw, rect, utterance = self._browser.call(shoot)
        from PIL import Image

        with Image.open(io.BytesIO(raw)) as shot:
            side = shot.size[0]
            png = _png(shot.convert("RGB").resize((size, size), Image.Resampling.BILINEAR))
        scale = size / side
        x1, x2 = math.floor(rect["x"] * scale), math.ceil((rect["x"] + rect["width"]) * scale) - 1
        top = rect["y"] - MINIWOB_AREA_TOP
        y1, y2 = math.floor(top * scale), math.ceil((top + rect["height"]) * scale) - 1
        x1, y1, x2, y2 = max(x1, 0), max(y1, 0), min(x2, size - 1), min(y2, size - 1)
        if x2 < x1 or y2 < y1:
            raise RuntimeError(f"gui-click: the target of MiniWoB {name!r} (seed {seed}) lies outside the task area")
        screen = Screen("click", size, size, Box(x1, y1, x2, y2), utterance, png=png)
        self._captures[key] = screen
        if len(self._captures) > 256:
            self._captures.popitem(last=False)
        return screen

    def close(self) -> None:
        if self._browser is not None:
            self._browser.close()
            self._browser = None

    # ------------------------------------------------------------------ capabilities
    def expert_action(self) -> str:
        """The action that solves the current step: the target box's centre, the word, scroll(down)."""
        assert self._screen is not None, "gui-click: expert_action() before reset()"
        expected = self._expected()
        if expected.kind == "click":
            box = expected.box
            assert box is not None
            return GuiAction("click", point=((box.x1 + box.x2) // 2, (box.y1 + box.y2) // 2)).render()
        return GuiAction(expected.kind, text=expected.text, direction=expected.direction).render()

    def random_action(self, rng: random.Random) -> str:
        """A uniformly random action type of this env's kinds (clicks only for ``kinds=["click"]``),
        then uniform arguments: a pixel of the image, a word of ``WORDS``, a direction."""
        assert self._screen is not None, "gui-click: random_action() before reset()"
        verbs = ["click"] + [k for k in ("type", "scroll") if k in self.kinds]
        verb = rng.choice(verbs)
        if verb == "type":
            return f'type("{rng.choice(WORDS)}")'
        if verb == "scroll":
            return f"scroll({rng.choice(('up', 'down'))})"
        return f"click({rng.randrange(self._screen.size)}, {rng.randrange(self._screen.size)})"

    def snapshot(self) -> EnvSnapshot:
        """The episode's task and state (plain data: it pickles)."""
        return EnvSnapshot(self.env_id, (self._task, self._state, self.done))

    def restore(self, snapshot: EnvSnapshot) -> str:
        """Return to a snapshot's state (in this env or another of the same id); returns its observation."""
        if not isinstance(snapshot, EnvSnapshot) or snapshot.env_id != self.env_id:
            raise TypeError(f"{self.env_id}: restore() needs an EnvSnapshot taken from this env id")
        task, state, done = snapshot.payload
        self.reset(task, 0)
        self._state, self.done = state, done
        return self._observation()

    def task_label(self, task: Task) -> str:
        """The task's kind (click, type, scroll) or, for MiniWoB screens, its MiniWoB task (per-label evaluation)."""
        data = task.data or {}
        return str(data.get("task") if data.get("source") == "miniwob" else data.get("kind", ""))

    def anchor_key(self) -> str:
        """The task's content and the episode's state (scroll offset, focus, typed text)."""
        text = json.dumps([self._key, self._state.offset, self._state.focused, self._state.typed])
        return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _why(action: GuiAction, expected: ExpectedAction, score: RewardBreakdown, weights: GroundingWeights) -> str:
    """Why a valid action was wrong (one clause)."""
    if action.kind != expected.kind:
        return f"a {action.kind} action, where a {expected.kind} action was due"
    if action.kind == "click" and score.oversized:
        return f"the box is more than {weights.max_area_ratio:g} times the target's area"
    if action.kind == "click":
        x, y = action.point  # type: ignore[misc]
        return f"the click at ({x:g}, {y:g}) missed the target"
    if action.kind == "type":
        return f'typed "{action.text}", not the asked text'
    return f"scrolled {action.direction}"


__all__ = ["GuiClickEnv", "KINDS", "MINIWOB_TASKS", "SOURCES", "draw_screen", "instruction", "make_screen"]
