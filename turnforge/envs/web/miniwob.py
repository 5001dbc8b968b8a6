"""``miniwob``: MiniWoB++ web tasks in a real headless Chromium, seen as text.

The task pages are those of the ``miniwob`` package (MiniWoB++ 1.1, MIT; loaded from
``file://``), each episode seeded (``Math.seedrandom``) so a task repeats exactly. The agent
reads the task's instruction and a compact list of the page's visible elements, each with a
ref it can act on::

    Select T3mIz and click Submit.
    [1] checkbox "jFAQNQ1"
    [4] checkbox "T3mIz" (checked)
    [5] button "Submit"

and answers with one action: ``click 4``, ``type 2 "agustina"`` (clears the field, then types
key by key), ``select 1 "Montenegro"`` (a list's option) or ``press Enter``. With ``fields=True``
the observation also lists the instruction's fields as MiniWoB++'s own extractors read them
(``miniwob.fields``: ``fields: 1 username="vanda" 2 password="iygs"``) and ``type 2 field 1``
types field 1's value: MiniWoB++'s ``FOCUS_ELEMENT_AND_TYPE_FIELD`` action, the action space of
workflow-guided exploration (Liu et al. 2018), for policies that cannot yet copy a word out of
the instruction; the free-text ``type`` stays. Clicks are
dispatched to the element (MiniWoB's own element click), typing and keys are real keyboard
events. The reward is MiniWoB's raw reward (+1 solved, -1 wrong, at the end): its default
reward decays with wall time, which a CPU model cannot meet, and the 10 s episode clock is
turned off; a malformed action or an unknown ref costs ``invalid_action_penalty`` and shows
why.

Tasks: ``tasks`` names the MiniWoB tasks drawn from (default ``DEFAULT_TASKS``: those with a
scripted expert; any other page of the package plays too, with its own reward); a task is
``{"task": name, "seed": n}``, split by content (10% held out). The expert reads the
instruction and the element list as an agent would (no page internals); an env with a task
outside ``DEFAULT_TASKS`` has no expert (no ``expert_action``: BC and ``check_env`` see an env
without one, and the checker plays random actions).
Snapshots are refused: a live page's JavaScript state cannot be copied (MC values, lookahead
and resuming mid-episode are not offered for this env). Timers a page waits on are turned off
where a task has one (``AFTER_START``: ``use-autocomplete``'s 300 ms menu delay); tasks built on
timers (``button-delay``, ``chase-circle``) are left out of the defaults.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from turnforge.envs.base import Env
from turnforge.envs.tasks import TaskGenerator
from turnforge.errors import UserError, choices
from turnforge.types import StepResult, Task

#: The tasks with a scripted expert (and the default task set).
DEFAULT_TASKS = (
    "click-button", "click-button-sequence", "click-checkboxes", "click-dialog", "click-dialog-2", "click-link",
    "click-option", "click-tab", "click-test", "click-test-2", "choose-list", "enter-password", "enter-text",
    "focus-text", "login-user", "use-autocomplete",
)
#: Page set-up after a task starts, per task: timers the page would wait on, turned off (a CPU
#: model's step takes longer than any of them, so they only make episodes depend on wall time).
AFTER_START = {"use-autocomplete": "$('#tags').autocomplete('option', 'delay', 0);"}
KEYS = ("Enter", "Tab", "Escape", "Backspace", "Space", "ArrowUp", "ArrowDown", "ArrowLeft", "ArrowRight")
_ACTION = re.compile(r'^\s*(?:(click|focus)\s+\[?(\d+)\]?|(type|select)\s+\[?(\d+)\]?\s+"(.*)"|press\s+(\w+)'
                     r'|type\s+\[?(\d+)\]?\s+field\s+(\d+))\s*$', re.IGNORECASE | re.DOTALL)
WIDTH, HEIGHT = 160, 210  # MiniWoB's task area (the page is laid out for it)
#: Starts an episode of the loaded task page on a seed (``% repr(seed)``); evaluates to whether it is ready.
START_EPISODE = "Math.seedrandom(%s); core.EPISODE_MAX_TIME = 1e9; core.startEpisodeReal(); WOB_TASK_READY"
_STATE = "[WOB_DONE_GLOBAL, WOB_RAW_REWARD_GLOBAL, WOB_REWARD_REASON]"
_SETTLE = "() => new Promise((done) => setTimeout(done, 0))"


@lru_cache(maxsize=1)
def html_dir() -> Path:
    """MiniWoB++'s task pages (the ``miniwob`` package), or one ``UserError`` line."""
    try:
        import miniwob
    except ImportError:
        raise UserError("env miniwob needs the `miniwob` package (MiniWoB++'s task pages): pip install -e '.[web]' "
                        "(`make setup` installs it)") from None
    return Path(miniwob.__file__).parent / "html" / "miniwob"


@lru_cache(maxsize=1)
def dom_js() -> str:
    """The script that lists a page's elements (``page.evaluate(dom_js())``: the items ``render`` shows)."""
    return (Path(__file__).parent / "dom.js").read_text()


def available_tasks() -> list[str]:
    return sorted(p.stem for p in html_dir().glob("*.html"))


def render(utterance: str, items: Sequence[dict], fields: Sequence[tuple[str, str]] = ()) -> str:
    """The instruction, its ``fields`` (if any: ``fields: 1 key="value" ...``), then one line per
    element: ``[ref] kind "text"`` and its state."""
    lines = [utterance]
    if fields:
        lines.append("fields: " + " ".join(f'{k} {key}="{value}"' for k, (key, value) in enumerate(fields, 1)))
    for it in items:
        kind = it.get("type") if it["tag"] == "input" else it["tag"]
        kind = {"text": "textbox", "password": "password box"}.get(kind, kind)
        line = f"[{it['ref']}] {kind}"
        text = it.get("text") or it.get("title") or ""
        if text:
            line += f' "{text[:60]}"'
        if it["tag"] in ("input", "textarea") and "value" in it:
            line += f' value="{it["value"]}"' if it["value"] else (f" #{it['id']}" if it.get("id") else "")
        if it["tag"] == "select":
            line += f' value="{it["value"]}" options: ' + " | ".join(it.get("options", []))
        if it.get("checked"):
            line += " (checked)"
        if it.get("focused"):
            line += " (focused)"
        lines.append(line)
    return "\n".join(lines)


def parse_action(text: str) -> tuple[str, int | None, str]:
    """``(verb, ref, argument)`` of an action text's first line (a chat model may explain itself
    on the next; a trailing period is ignored), or ``ValueError`` saying what is wrong.
    ``type N field K`` is ``("type_field", N, "K")`` (the env resolves the field)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    m = _ACTION.match(lines[0].rstrip().removesuffix(".")) if lines else None
    if m is None:
        raise ValueError('actions: click N | type N "text" | type N field K | select N "option" | press KEY')
    if m.group(7):
        return "type_field", int(m.group(7)), m.group(8)
    if m.group(1):
        return "click", int(m.group(2)), ""
    if m.group(3):
        return m.group(3).lower(), int(m.group(4)), m.group(5)
    key = next((k for k in KEYS if k.lower() == m.group(6).lower()), None)
    if key is None:
        raise ValueError(f"unknown key {m.group(6)!r}; keys: {', '.join(KEYS)}")
    return "press", None, key


class MiniWoBEnv(Env):
    """See the module docstring."""

    observation_role = "user"

    def __init__(self, tasks: Sequence[str] = DEFAULT_TASKS, invalid_action_penalty: float = -0.1,
                 fields: bool = False) -> None:
        from turnforge.envs.web.browser import chromium_path, require_playwright

        if isinstance(tasks, str):
            tasks = [tasks]
        valid = available_tasks()
        for name in tasks:
            if name not in valid:
                raise UserError(f"unknown MiniWoB task {name!r}; valid tasks: {choices(valid)}")
        if not tasks:
            raise UserError(f"env miniwob needs at least one task; valid tasks: {choices(valid)}")
        require_playwright()
        chromium_path()  # missing Chromium: one line now, before any episode
        self.task_names = tuple(tasks)
        self.invalid_action_penalty = float(invalid_action_penalty)
        if not isinstance(fields, bool):
            raise UserError(f"miniwob: fields must be true or false; got {fields!r}")
        self.fields = fields
        if set(self.task_names) <= set(DEFAULT_TASKS):  # the expert: only where every task has a scripted one
            self.expert_action = self._expert_action
        names = self.task_names
        self.tasks = TaskGenerator(lambda rng: {"task": rng.choice(names), "seed": rng.randrange(2**31)})
        typing = 'type N "text", type N field K (the task\'s field K)' if self.fields else 'type N "text"'
        self.instructions = ("You operate a web page. Each message gives the task"
                             + (", its fields" if self.fields else "") + " and the page's elements as "
                             f'[ref] kind "text". Answer with one action: click N, {typing}, select N "option" '
                             f"or press KEY ({', '.join(KEYS)}).")
        self._browser = None
        self._task: str | None = None
        self._items: list[dict] = []
        self._utterance = ""
        self._fields: tuple[tuple[str, str], ...] = ()  # the instruction's fields (fields=True)
        self._clicked: list[str] = []  # texts of the elements clicked this episode (the expert's memory)
        self.done = True

    # ------------------------------------------------------------------ browser
    def _call(self, fn):
        """``fn(page)`` on the browser's thread (the browser starts with the first episode)."""
        if self._browser is None:
            from turnforge.envs.web.browser import Browser

            self._browser = Browser(WIDTH, HEIGHT)
        return self._browser.call(fn)

    def task_label(self, task: Task) -> str:
        """The MiniWoB task a task is an episode of (evaluations report success per label)."""
        return str((task.data or {}).get("task", ""))

    def close(self) -> None:
        if self._browser is not None:
            self._browser.close()
            self._browser = None

    def _observe(self) -> str:
        self._items = self._call(lambda page: page.evaluate(dom_js()))
        return render(self._utterance, self._items, self._fields)

    # ------------------------------------------------------------------ the contract
    def reset(self, task: Task, seed: int) -> str:
        data = task.data or {}
        name = data.get("task")
        if name not in self.task_names:
            raise ValueError(f"miniwob: task {task} names no task of this env ({', '.join(self.task_names)})")
        url, start = (html_dir() / f"{name}.html").as_uri(), START_EPISODE % repr(f"{task.split}-{data['seed']}")
        after = AFTER_START.get(name)

        def load(page) -> tuple[bool, str]:
            page.goto(url)  # a fresh page: nothing carries over between episodes
            ready = page.evaluate(start)
            if after:
                page.evaluate(after)
            return ready, page.evaluate("core.getUtterance()")

        ready, self._utterance = self._call(load)
        if not ready:
            raise RuntimeError(f"miniwob: task {name!r} did not become ready")
        self._task, self._clicked, self.done = name, [], False
        self._fields = task_fields(name, self._utterance) if self.fields else ()
        return self._observe()

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("miniwob: step() after the episode ended; call reset() first")
        try:
            verb, ref, arg = parse_action(action)
            self._act(verb, ref, arg)
        except ValueError as err:
            return StepResult(f"Invalid action: {err}.\n{self._observe()}", self.invalid_action_penalty, False, False,
                              invalid_action=True)
        done, raw, _reason = self._call(lambda page: page.evaluate(_STATE))
        if done:
            self.done = True
            reward = float(raw)
            return StepResult("Episode over: " + ("solved." if reward > 0 else "wrong."), reward, True, False,
                              success=reward > 0, info={"raw_reward": reward})
        return StepResult(self._observe(), 0.0, False, False)

    def _act(self, verb: str, ref: int | None, arg: str) -> None:
        """Check the action against the page as last shown, then do it (``ValueError``: invalid)."""
        item: dict = {}
        if verb == "type_field":
            k = int(arg)
            if not 1 <= k <= len(self._fields):
                have = f"fields 1..{len(self._fields)}" if self._fields else "no fields" + ("" if self.fields else " (fields=false)")
                raise ValueError(f"no field {k}; this task has {have}")
            verb, arg = "type", self._fields[k - 1][1]
        if ref is not None:
            item = next((it for it in self._items if it["ref"] == ref), {})
            if not item:
                raise ValueError(f"no element [{ref}] on the page")
        if verb == "type" and (item["tag"] not in ("input", "textarea") or item.get("type") in ("checkbox", "radio")):
            raise ValueError(f"[{ref}] is a {item.get('type', item['tag'])}, not a text field")
        if verb == "select" and item["tag"] != "select":
            raise ValueError(f"[{ref}] is not a list")
        if verb == "select" and arg not in item.get("options", []):
            raise ValueError(f"[{ref}] has no option {arg!r}")
        if verb == "click":
            self._clicked.append(item.get("text") or item.get("title") or "")
        selector = f'[data-tf-ref="{ref}"]'

        def act(page) -> bool:
            handle = page.query_selector(selector) if ref is not None else None
            if ref is not None and handle is None:
                return False  # gone since the page was shown
            if verb == "click":
                handle.evaluate("el => { el.click(); el.focus(); }")
            elif verb == "type":
                handle.evaluate("el => { el.click(); el.focus(); el.value = ''; }")
                page.keyboard.type(arg)
            elif verb == "select":
                handle.select_option(label=arg)
            else:
                page.keyboard.press(arg)
            page.evaluate(_SETTLE)  # what the action queued for the next turn of the event loop runs first
            return True

        if not self._call(act):
            raise ValueError(f"element [{ref}] is no longer on the page")

    def random_action(self, rng) -> str:
        """A uniformly random action on the current page: click one of its elements, or type a
        word from the instruction into one of its text fields, or select one of a list's options."""
        moves = [f"click {it['ref']}" for it in self._items]
        words = re.findall(r"[\w#]+", self._utterance) or ["x"]
        for it in self._items:
            if it["tag"] in ("input", "textarea") and it.get("type") not in ("checkbox", "radio"):
                moves.append(f'type {it["ref"]} "{rng.choice(words)}"')
                if self._fields:
                    moves.append(f'type {it["ref"]} field {rng.randrange(len(self._fields)) + 1}')
            if it["tag"] == "select" and it.get("options"):
                moves.append(f'select {it["ref"]} "{rng.choice(it["options"])}"')
        return rng.choice(moves) if moves else "press Enter"

    # ------------------------------------------------------------------ the expert
    def _expert_action(self) -> str:
        """The scripted expert's next action for the current page (see ``expert``); installed as
        ``expert_action`` when every task of the env has one."""
        assert self._task is not None, "miniwob: expert_action() before reset()"
        return by_field(expert(self._task, self._utterance, self._items, self._clicked), self._fields)


def task_fields(task: str, utterance: str) -> tuple[tuple[str, str], ...]:
    """The instruction's fields by MiniWoB++'s own extractor for ``task`` (``miniwob.fields``);
    the fields without a value (an extractor's optional group) are left out."""
    from miniwob.fields import get_field_extractor

    return tuple((str(k), str(v)) for k, v in get_field_extractor(task)(utterance) if v)


def by_field(action: str, fields: Sequence[tuple[str, str]]) -> str:
    """``action`` with a typed text that is one of ``fields``' values written as ``type N field K``
    (the first field with that value); any other action unchanged."""
    m = re.fullmatch(r'type (\d+) "(.*)"', action, re.DOTALL)
    values = [v for _, v in fields]
    if m is None or m.group(2) not in values:
        return action
    return f"type {m.group(1)} field {values.index(m.group(2)) + 1}"


def _quoted(utterance: str) -> list[str]:
    return re.findall(r'"([^"]*)"', utterance)


def _find(items: Sequence[dict], *, tag: str | None = None, text: str | None = None, type_: str | None = None,
          id_: str | None = None) -> dict:
    for it in items:
        if ((tag is None or it["tag"] == tag) and (text is None or (it.get("text") or it.get("title") or "") == text)
                and (type_ is None or it.get("type") == type_) and (id_ is None or it.get("id") == id_)):
            return it
    raise LookupError(f"no element with tag={tag} text={text} type={type_} id={id_}")


def _click_text(items: Sequence[dict], text: str, tag: str | None = None) -> str:
    return f"click {_find(items, tag=tag, text=text)['ref']}"


def _fill_then(items: Sequence[dict], fields: Sequence[tuple[dict, str]], then: str) -> str:
    for item, value in fields:
        if item.get("value", "") != value:
            return f'type {item["ref"]} "{value}"'
    return then


def expert(task: str, utterance: str, items: Sequence[dict], clicked: Sequence[str]) -> str:
    """The next action that solves ``task`` from this page: the instruction parsed as a person
    would, the target found in the element list (``clicked``: what the episode clicked so far)."""
    q = _quoted(utterance)
    submit = next((it for it in items if it["tag"] == "button" and it.get("text", "").lower() in ("submit", "login")), None)
    if task in ("click-button", "click-link", "click-dialog-2") and q:
        label = q[0]
        if task == "click-dialog-2" and label == "x":
            return f"click {_find(items, tag='button', text='Close')['ref']}"
        return _click_text(items, label, "link" if task == "click-link" else "button")
    if task == "click-dialog":
        return f"click {_find(items, tag='button', text='Close')['ref']}"
    if task in ("click-test", "focus-text"):
        target = next(it for it in items if it["tag"] in (("button",) if task == "click-test" else ("input", "textarea")))
        return f"click {target['ref']}"
    if task in ("click-test-2", "click-button-sequence"):
        words = re.findall(r"button (\w+)", utterance)
        todo = [w for w in words if w not in clicked] or words[-1:]
        return _click_text(items, todo[0], "button")
    if task == "click-tab":
        return _click_text(items, re.search(r"(Tab #\d+)", utterance).group(1), "a")  # type: ignore[union-attr]
    if task in ("click-checkboxes", "click-option"):
        body = re.search(r"Select (.*?) and click Submit", utterance)
        words = [] if body is None or body.group(1) == "nothing" else [w.strip() for w in re.split(r",\s*", body.group(1)) if w.strip()]
        kind = "checkbox" if task == "click-checkboxes" else "radio"
        for it in items:
            if it.get("type") == kind and bool(it.get("checked")) != (it.get("text") in words):
                return f"click {it['ref']}"
        return f"click {submit['ref']}"  # type: ignore[index]
    if task == "choose-list":
        option = re.search(r"Select (.*) from the list", utterance).group(1)  # type: ignore[union-attr]
        lst = _find(items, tag="select")
        return f'select {lst["ref"]} "{option}"' if lst.get("value") != option else f"click {submit['ref']}"  # type: ignore[index]
    if task == "enter-text":
        return _fill_then(items, [(_find(items, tag="input", type_="text"), q[0])], f"click {submit['ref']}")  # type: ignore[index]
    if task == "enter-password":
        fields = [(it, q[0]) for it in items if it.get("type") == "password"]
        return _fill_then(items, fields, f"click {submit['ref']}")  # type: ignore[index]
    if task == "login-user":
        fields = [(_find(items, id_="username"), q[0]), (_find(items, id_="password"), q[1])]
        return _fill_then(items, fields, f"click {submit['ref']}")  # type: ignore[index]
    if task == "use-autocomplete":
        start, end = q[0], (q[1] if len(q) > 1 else "")
        box = _find(items, tag="input", id_="tags")
        value = box.get("value", "")
        if value.startswith(start) and value.endswith(end):
            return f"click {submit['ref']}"  # type: ignore[index]
        for it in items:
            if it["tag"] == "option" and it["text"].startswith(start) and it["text"].endswith(end):
                return f"click {it['ref']}"
        return f'type {box["ref"]} "{start}"'
    raise NotImplementedError(f"miniwob: no scripted expert for task {task!r} (experts: {', '.join(DEFAULT_TASKS)})")


__all__ = ["DEFAULT_TASKS", "MiniWoBEnv", "by_field", "expert", "parse_action", "render", "task_fields"]
