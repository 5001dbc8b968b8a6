"""Tool-calling envs: the agent calls typed Python functions in its chat template's format.

A tool is a plain, typed Python function (or bound method) with a Google-style docstring;
``transformers.utils.get_json_schema`` turns it into the JSON schema chat templates render
(``apply_chat_template(tools=...)``) and ``pydantic.validate_call`` checks the arguments of
each call against its type hints. An episode: the user message states the task; each agent
turn either calls tools or gives the final ``<answer>...</answer>``; each call's result comes
back as a message of role ``tool`` (``Env.observation_role``), in the context with loss mask 0.

Tool-call formats (``tool_call_format``): one of ``turnforge.envs.tool.formats.TOOL_FORMATS``,
``hermes`` by default (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more
per turn: Qwen2/2.5/3, Hermes and the tiny model's template); ``json`` (the whole assistant text
is one ``{"name": ..., "parameters": {...}}`` object), ``llama3_json``, ``qwen3_coder_xml``,
``mistral`` and ``mistral_v11`` follow their model families' templates. The env asks its format
to parse actions (with its tools' schemas, for formats whose text carries no types) and to say
what a call looks like; ``call_text`` writes a call in it (experts).

The generated text is parsed as is (never re-tokenized); a call that does not parse, names
an unknown tool or does not match its schema is an invalid action: the penalty, an
observation with the reason, counted, never an exception. A tool that runs and fails
(division by zero, a crashing program) is a normal observation; its output is cleaned
(control bytes escaped, invalid UTF-8 flagged) and cut to ``max_output_chars`` with a
marker. Events are counted in ``info`` (``n_tool_calls``, ``n_tool_errors``,
``n_output_truncated``, ``n_output_not_text``). Machinery faults (``SandboxError``) are
raised: the rollout records the episode as an infrastructure failure, not as reward 0.

Departure from chat APIs: the answer is text in a tag, not a "final" tool; tool-call ids
are not used (results follow their calls in order).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

from pydantic import ValidationError, validate_call
from transformers.utils import get_json_schema

from turnforge.envs.base import InvalidAction
from turnforge.envs.levels import LevelEnv, Outcome
from turnforge.envs.tool.formats import TOOL_FORMATS, ToolCall, ToolCallFormat, tool_format
from turnforge.errors import UserError, choices

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
TRUNCATED = "\n[output truncated: {n} more characters]"
TOOL_CALL_FORMATS = tuple(TOOL_FORMATS)  # the registered names (TOOL_FORMATS holds the objects)


@dataclass(frozen=True)
class Tool:
    """A callable tool: its name, JSON schema and argument-checking wrapper."""

    name: str
    schema: dict[str, Any]
    call: Callable[..., str]

    @classmethod
    def from_function(cls, fn: Callable[..., str]) -> "Tool":
        """Schema from the type hints and Google-style docstring of ``fn``; calls checked by pydantic."""
        schema = get_json_schema(fn)
        schema["function"].pop("return", None)  # chat templates show only name, description, parameters
        return cls(schema["function"]["name"], schema, validate_call(fn))


def parse_tool_calls(text: str, fmt: str = "hermes", tools: Sequence[dict] = ()) -> list[ToolCall]:
    """The tool calls in ``text`` written in format ``fmt`` ([] if it has none); ``InvalidAction`` if
    one is malformed. ``tools``: the schemas that type the values of formats without types (XML)."""
    found = TOOL_FORMATS.get(fmt)
    if found is None:
        raise ValueError(f"unknown tool_call_format {fmt!r}; valid formats: {choices(TOOL_FORMATS)}")
    return found.parse(text, tools)


def clean_output(text: str, limit: int) -> tuple[str, bool, bool]:
    """(text fit for a tool message, truncated?, not text?): control characters other than
    newline and tab are escaped as ``\\xNN``, replacement characters (from invalid UTF-8)
    flag the output as not text, and the result is cut to ``limit`` characters + a marker."""
    not_text = "\ufffd" in text
    if any(unicodedata.category(c) == "Cc" and c not in "\n\t" for c in text):
        not_text = True
        text = "".join(f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" and c not in "\n\t" else c for c in text)
    if len(text) > limit:
        return text[:limit] + TRUNCATED.format(n=len(text) - limit), True, not_text
    return text, False, not_text


class ToolEnv(LevelEnv):
    """Base of tool-calling envs. Subclasses give the tools (``tool_functions``), the task
    text of a level (``question``), the scoring of an answer (``score``) and an expert.

    State: the level, the calls made so far as ``(name, arguments JSON, result)`` and the
    last observation. ``max_tool_calls`` bounds the calls of an episode; more is an invalid
    action telling the agent to answer.
    """

    observation_role = "tool"
    #: A tool whose call ends the episode (e.g. ``submit``) instead of an ``<answer>`` tag;
    #: it is scored by ``score(level, "")`` and never counts against ``max_tool_calls``.
    final_tool: ClassVar[str | None] = None

    def __init__(self, *, tool_call_format: str = "hermes", max_tool_calls: int = 4, max_output_chars: int = 2000,
                 invalid_action_penalty: float = -0.1, max_steps: int = 10) -> None:
        super().__init__(invalid_action_penalty=invalid_action_penalty, max_steps=max_steps)
        self.format: ToolCallFormat = tool_format(tool_call_format)
        if max_tool_calls < 0 or max_output_chars < 1:
            raise UserError(f"max_tool_calls must be >= 0 and max_output_chars >= 1; got {max_tool_calls}, {max_output_chars}")
        self.tool_call_format, self.max_tool_calls, self.max_output_chars = tool_call_format, max_tool_calls, max_output_chars
        self._tools = {t.name: t for t in map(Tool.from_function, self.tool_functions())}

    # ------------------------------------------------------------------ subclass hooks
    def tool_functions(self) -> Sequence[Callable[..., str]]:
        """The typed functions the agent may call (bound methods are fine)."""
        raise NotImplementedError

    def question(self, level: Any) -> str:
        """The user message stating the task of ``level``."""
        raise NotImplementedError

    def score(self, level: Any, answer: str) -> tuple[float, bool]:
        """(reward, success) of the final ``answer`` text."""
        raise NotImplementedError

    # ------------------------------------------------------------------ Env hooks
    @property
    def tools(self) -> tuple[dict[str, Any], ...]:
        return tuple(t.schema for t in self._tools.values())

    @property
    def valid_actions_text(self) -> str:
        call = self.format.example
        if self.final_tool is not None:
            return f"a tool call {call} (tools: {', '.join(self._tools)}); call {self.final_tool} when done"
        return f"a tool call {call} (tools: {', '.join(self._tools)}) or the answer <answer>...</answer>"

    def call_text(self, name: str, arguments: dict[str, Any]) -> str:
        """One call of tool ``name`` as this env's format writes it (what an expert answers)."""
        return self.format.render([ToolCall(name, arguments)])

    def initial_state(self, level, rng):
        return {"level": level, "calls": (), "last": None}

    def render(self) -> str:
        last = self.state["last"]
        return self.question(self.state["level"]) if last is None else last

    def invalid_observation(self, reason: str) -> str:
        return f"Error: {reason}. Give {self.valid_actions_text}."

    def anchor_key(self) -> str:
        key = repr((self.level_key(self.state["level"]), self.state["calls"]))
        return hashlib.blake2b(key.encode(), digest_size=12).hexdigest()

    def final_answer(self, action_text: str) -> str | None:
        """The answer ``action_text`` gives (its last ``<answer>`` tag's text), None for a tool
        call, a malformed turn or an env that ends with ``final_tool``: what majority voting
        (``turnforge eval --best-of N --select vote``) compares across attempts."""
        if self.final_tool is not None:
            return None
        answers = _ANSWER.findall(action_text)
        return answers[-1].strip() if answers else None

    def parse_action(self, text: str) -> tuple[str, Any]:
        calls = self.format.parse(text, self.tools)
        if self.final_tool is not None and any(c.name == self.final_tool for c in calls):
            if len(calls) > 1:
                raise InvalidAction(f"call {self.final_tool} alone, after the other tools' results are back")
            return "answer", ""
        answers = _ANSWER.findall(text) if self.final_tool is None else []
        if calls and answers:
            raise InvalidAction("both tool calls and an answer in one turn; call tools, read their results, then answer")
        if answers:
            return "answer", answers[-1].strip()
        if not calls:
            raise InvalidAction("no tool call found" if self.final_tool else "no tool call and no answer found")
        for call in calls:
            if call.name not in self._tools:
                raise InvalidAction(f"unknown tool {call.name!r}; tools: {choices(self._tools)}")
        used = len(self.state["calls"])
        if used + len(calls) > self.max_tool_calls:
            raise InvalidAction(f"only {self.max_tool_calls - used} of {self.max_tool_calls} tool calls left; answer now")
        return "calls", calls

    def apply(self, action) -> Outcome:
        kind, payload = action
        if kind == "answer":
            reward, success = self.score(self.state["level"], payload)
            return Outcome(reward, terminated=True, success=success, info={"n_answers": 1})
        results, events = [], {"n_tool_calls": len(payload), "n_tool_errors": 0, "n_output_truncated": 0,
                               "n_output_not_text": 0}
        saved = copy.deepcopy(self.state)  # a later call's bad arguments undo the earlier calls' effects
        for call in payload:
            try:
                result, failed = self._run(call)
            except InvalidAction:
                self.state = saved
                raise
            text, truncated, not_text = clean_output(result, self.max_output_chars)
            events["n_tool_errors"] += failed
            events["n_output_truncated"] += truncated
            events["n_output_not_text"] += not_text
            results.append((call.name, json.dumps(call.arguments, sort_keys=True), text))
        self.state["calls"] = self.state["calls"] + tuple(results)
        self.state["last"] = "\n\n".join(r[2] for r in results) if len(results) == 1 else "\n\n".join(
            f"[{i + 1}] {name}: {text}" for i, (name, _, text) in enumerate(results))
        return Outcome(0.0, info=events)

    def _run(self, call: ToolCall) -> tuple[str, bool]:
        """(result text, whether the tool reported an error). Argument errors are invalid
        actions; other exceptions (the machinery failing) propagate."""
        try:
            result = self._tools[call.name].call(**call.arguments)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or call.name}: {e['msg']}" for e in err.errors())
            raise InvalidAction(f"bad arguments for {call.name}: {problems}") from None
        failed = isinstance(result, ToolError)
        return str(result), failed


class ToolError(str):
    """A tool's result that reports a failure of the agent's request (a crash of its program,
    a bad expression); a normal observation, counted in ``n_tool_errors``."""
