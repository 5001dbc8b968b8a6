"""Tool-call formats: how a model family writes tool calls in its assistant text, one class each
in one registry, ``TOOL_FORMATS``.

A format knows four things, and callers (the tool envs, the gateway, the prompt's schema text)
ask it instead of comparing names:

- ``detects(chat_template)``: whether a chat template's text shows this format (``detect`` asks
  every format; ``resolve("auto", template)`` takes the one found, else ``hermes``);
- ``render(calls)``: the assistant text a model of the family writes for ``calls``, character
  for character what its chat template renders for an assistant message with those
  ``tool_calls`` (so a call written back into a prompt is the text the model sampled);
- ``split(text, tools)``: (the text outside the calls, the calls) of sampled text, read as
  decoded, never re-tokenized; a call that does not parse raises ``InvalidAction`` with the
  reason (a tool env makes it an invalid action, counted; the gateway keeps the text as content
  and counts it): nothing is dropped. ``tools`` (OpenAI schemas) types the values of formats
  whose text carries no types (Qwen3-Coder's XML);
- ``schema_text(tools)``: the schemas and the call syntax as plain text, for templates that
  cannot render tools.

The formats:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more per turn,
  text around them allowed (Qwen2/2.5/3, Hermes, the tiny model's template);
- ``json``: the whole assistant text is one ``{"name": ..., "parameters": {...}}`` object (the
  generic JSON form; ``arguments`` is read too);
- ``llama3_json``: Llama 3.1/3.2's: ``{"name": ..., "parameters": {...}}`` as the whole message
  (several joined by ``; ``), optionally after ``<|python_tag|>``; after the tag, built-in tools
  as ``brave_search.call(query="...")`` and Python for ``code_interpreter``;
- ``qwen3_coder_xml``: Qwen3-Coder's ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n
  </parameter>\\n</function>\\n</tool_call>``: strings verbatim, objects and arrays as JSON, other
  values as Python writes them (the template's ``| string``); read back with the tool's schema
  types (a value whose type is unknown stays a string, as Qwen's own parser does);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral 7B v0.3, Mixtral
  8x22B, NeMo: tokenizers v3 to v7);
- ``mistral_v11``: ``[TOOL_CALLS]NAME[ARGS]{...}`` per call (tokenizer v11+: Mistral Small 3.2,
  Devstral, Magistral). Both Mistral formats read both forms.

``markers``: the special tokens of a format (``[TOOL_CALLS]``, ``<|python_tag|>``): text decoded
with special tokens skipped has lost them, so sampled ids must be decoded with them kept.

Adding a format: one ``ToolCallFormat`` subclass here, registered in ``TOOL_FORMATS``, with its
round-trip property test (tests/policy/test_tool_formats.py); envs, the gateway and
``model.tool_format`` then take its name.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping, Sequence

from turnforge.envs.base import InvalidAction
from turnforge.errors import UserError, choices

#: ``model.tool_format`` / ``Gateway(tool_format=...)``: the format the chat template shows, else hermes.
AUTO = "auto"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call."""

    name: str
    arguments: dict[str, Any]


def call_of(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall:
    """The call a decoded JSON object states: a string ``name`` and an object of arguments under
    the first of ``args_keys`` present (a JSON string holding an object is decoded, as some models
    write it); ``InvalidAction`` naming what is wrong otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise InvalidAction('a tool call must be a JSON object with a string "name" and an "arguments" object')
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise InvalidAction(f'the "arguments" of {obj["name"]!r} are a string that is not a JSON object') from None
    if not isinstance(args, dict):
        raise InvalidAction(f'the "arguments" of {obj["name"]!r} must be a JSON object')
    return ToolCall(obj["name"], args)


def decode_call(body: str) -> ToolCall:
    """The call of one JSON object's text."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        raise InvalidAction(f"tool call is not valid JSON ({err.msg} at character {err.pos})") from None
    return call_of(obj)


class ToolCallFormat:
    """One tool-call format (see the module docstring). Subclasses set the class attributes and
    implement ``render`` and ``split``; ``detects`` is False for a format no template announces."""

    name: ClassVar[str]
    help: ClassVar[str]  # a few words for ``turnforge keys``
    example: ClassVar[str]  # one call's syntax, quoted in invalid-action observations
    how: ClassVar[str]  # the schema text's instruction: "call one with ..."
    markers: ClassVar[tuple[str, ...]] = ()  # special tokens the format's text needs kept when decoding

    def detects(self, chat_template: str) -> bool:
        return False

    def render(self, calls: Sequence[ToolCall]) -> str:
        raise NotImplementedError

    def split(self, text: str, tools: Sequence[Mapping] = ()) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def parse(self, text: str, tools: Sequence[Mapping] = ()) -> list[ToolCall]:
        """The calls in ``text`` ([] for none); ``InvalidAction`` if one is malformed."""
        return self.split(text, tools)[1]

    def schema_text(self, tools: Iterable[Mapping]) -> str:
        schemas = "\n".join(json.dumps(t, separators=(", ", ": ")) for t in tools)
        return f"You may use these tools; {self.how}.\n{schemas}"


def _tagged_blocks(text: str, pattern: re.Pattern, open_tag: str, close_tag: str, fix: str) -> list[str]:
    bodies = pattern.findall(text)
    if text.count(open_tag) != len(bodies) or text.count(close_tag) != len(bodies):
        raise InvalidAction(f"unbalanced {open_tag} tags: write {fix}")
    return bodies


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class Hermes(ToolCallFormat):
    name = "hermes"
    help = "<tool_call>{json}</tool_call> blocks: Qwen2/2.5/3, Hermes, the tiny model"
    example = '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    how = 'call one with <tool_call>{"name": <tool name>, "arguments": {<arguments>}}</tool_call>'

    def detects(self, chat_template: str) -> bool:
        return "<tool_call>" in chat_template and "<function=" not in chat_template

    def render(self, calls: Sequence[ToolCall]) -> str:
        return "".join("<tool_call>" + json.dumps({"name": c.name, "arguments": c.arguments}) + "</tool_call>"
                       for c in calls)

    def split(self, text: str, tools: Sequence[Mapping] = ()) -> tuple[str, list[ToolCall]]:
        bodies = _tagged_blocks(text, _TOOL_CALL, "<tool_call>", "</tool_call>", "<tool_call>{json}</tool_call>")
        return _TOOL_CALL.sub("", text).strip(), [decode_call(b.strip()) for b in bodies]


class Json(ToolCallFormat):
    name = "json"
    help = 'the whole reply is one {"name": ..., "parameters": {...}} object'
    example = '{"name": ..., "parameters": {...}}'
    how = 'call one by answering only {"name": <tool name>, "parameters": {<arguments>}}'

    def render(self, calls: Sequence[ToolCall]) -> str:
        if len(calls) != 1:
            raise ValueError(f"the json format writes one call per reply, got {len(calls)}")
        return json.dumps({"name": calls[0].name, "parameters": calls[0].arguments})

    def split(self, text: str, tools: Sequence[Mapping] = ()) -> tuple[str, list[ToolCall]]:
        stripped = text.strip()
        return ("", [decode_call(stripped)]) if stripped.startswith("{") else (text, [])


PYTHON_TAG = "<|python_tag|>"
_BUILTIN = re.compile(r"([A-Za-z_]\w*)\.call\(", re.ASCII)


def _literal_call(text: str) -> ToolCall:
    """``name.call(k="v", ...)`` (Llama's built-in tools) as a call; literal keyword arguments only."""
    try:
        node = ast.parse(text, mode="eval").body
        ok = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "call"
              and isinstance(node.func.value, ast.Name) and not node.args and all(k.arg for k in node.keywords))
        if ok:
            return ToolCall(node.func.value.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords})
    except (SyntaxError, ValueError, TypeError, RecursionError):
        pass
    raise InvalidAction('a built-in tool call must read name.call(argument="value", ...) with literal values')


class Llama3Json(ToolCallFormat):
    """Llama 3.1/3.2 (Meta's templates): custom tools as JSON, built-ins after ``<|python_tag|>``."""

    name = "llama3_json"
    help = 'Llama 3.1/3.2: {"name": ..., "parameters": {...}}, built-ins after <|python_tag|>'
    example = '{"name": ..., "parameters": {...}}'
    how = 'call one by answering only {"name": <tool name>, "parameters": {<arguments>}}'
    markers = (PYTHON_TAG,)
    builtins: ClassVar[tuple[str, ...]] = ("brave_search", "wolfram_alpha")  # written name.call(...)
    code_tool: ClassVar[str] = "code_interpreter"  # written as the code itself after the tag

    def detects(self, chat_template: str) -> bool:
        return '"parameters"' in chat_template and "<|start_header_id|>" in chat_template

    def render(self, calls: Sequence[ToolCall]) -> str:
        def one(c: ToolCall) -> str:
            if c.name == self.code_tool and set(c.arguments) == {"code"}:
                return PYTHON_TAG + str(c.arguments["code"])
            if c.name in self.builtins:
                args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in c.arguments.items())
                return f"{PYTHON_TAG}{c.name}.call({args})"
            return '{"name": ' + json.dumps(c.name, ensure_ascii=False) + ', "parameters": ' + \
                json.dumps(c.arguments, ensure_ascii=False) + "}"
        return "; ".join(one(c) for c in calls)

    def split(self, text: str, tools: Sequence[Mapping] = ()) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        tagged = body.startswith(PYTHON_TAG)
        body = body.removeprefix(PYTHON_TAG).lstrip()
        if body.startswith("{"):
            return "", self._json_calls(body)
        if not tagged:
            return text, []
        if _BUILTIN.match(body):
            return "", [_literal_call(body.rstrip())]
        return "", [ToolCall(self.code_tool, {"code": body.rstrip()})]

    @staticmethod
    def _json_calls(body: str) -> list[ToolCall]:
        decoder, calls = json.JSONDecoder(), []
        while True:
            try:
                obj, end = decoder.raw_decode(body)
            except json.JSONDecodeError as err:
                raise InvalidAction(f"tool call is not valid JSON ({err.msg} at character {err.pos})") from None
            calls.append(call_of(obj, ("parameters", "arguments")))
            body = body[end:].strip()
            if not body:
                return calls
            if not body.startswith(";"):
                raise InvalidAction(f"text after the JSON tool call ({body[:30]!r}); answer only with the call, "
                                    "or several separated by '; '")
            body = body[1:].lstrip()


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_INTEGER = re.compile(r"[+-]?\d+")


def _xml_value(value: Any) -> str:
    """A value as Qwen3-Coder's template writes it: strings verbatim, objects and arrays as JSON
    (``tojson``), anything else as Python's ``str`` (jinja's ``| string``: ``True``, ``None``, ``1.5``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _typed(raw: str, schema: Mapping | None) -> Any:
    """``raw`` as the JSON-schema ``type`` of ``schema`` says (a value that does not read as that
    type, or of unknown type, stays the string: the tool's own argument check names the problem)."""
    kinds = schema.get("type") if isinstance(schema, Mapping) else None
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if not kinds or "string" in kinds:
        return raw
    text = raw.strip()
    for kind in kinds:
        if kind == "integer" and _INTEGER.fullmatch(text):
            return int(text)
        if kind == "number":
            if _INTEGER.fullmatch(text):
                return int(text)
            try:
                return float(text)
            except ValueError:
                pass
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind == "null" and text in ("null", "None"):
            return None
        if kind in ("object", "array"):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                try:
                    return ast.literal_eval(text)
                except (SyntaxError, ValueError, TypeError, RecursionError):
                    pass
    return raw


def _parameter_schemas(tools: Sequence[Mapping]) -> dict[str, Mapping]:
    out: dict[str, Mapping] = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            props = (fn.get("parameters") or {}).get("properties") if isinstance(fn.get("parameters"), Mapping) else None
            out[fn["name"]] = props if isinstance(props, Mapping) else {}
    return out


class Qwen3CoderXml(ToolCallFormat):
    """Qwen3-Coder's XML calls (its chat template; Qwen's ``qwen3coder_tool_parser`` reads them the same way)."""

    name = "qwen3_coder_xml"
    help = "Qwen3-Coder: <tool_call><function=NAME><parameter=ARG>VALUE</parameter></function></tool_call>"
    example = "<tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n</tool_call>"
    how = ("call one with <tool_call>\n<function=<tool name>>\n<parameter=<argument name>>\n<value>\n</parameter>\n"
           "</function>\n</tool_call>")

    def detects(self, chat_template: str) -> bool:
        return "<function=" in chat_template and "<parameter=" in chat_template

    def render(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(
            f"<tool_call>\n<function={c.name}>\n"
            + "".join(f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in c.arguments.items())
            + "</function>\n</tool_call>" for c in calls)

    def split(self, text: str, tools: Sequence[Mapping] = ()) -> tuple[str, list[ToolCall]]:
        fix = "<tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n</tool_call>"
        bodies = _tagged_blocks(text, _TOOL_CALL, "<tool_call>", "</tool_call>", fix)
        schemas = _parameter_schemas(tools)
        return _TOOL_CALL.sub("", text).strip(), [self._call(b, schemas) for b in bodies]

    @staticmethod
    def _call(body: str, schemas: dict[str, Mapping]) -> ToolCall:
        found = _XML_FUNCTION.fullmatch(body)
        if not found:
            raise InvalidAction("a tool call must hold one <function=NAME>...</function> block")
        name, inner = found.group(1).strip(), found.group(2)
        args: dict[str, Any] = {}
        at = 0
        for p in _XML_PARAMETER.finditer(inner):
            if inner[at:p.start()].strip():
                raise InvalidAction(f"text {inner[at:p.start()].strip()[:30]!r} between the parameters of {name!r}")
            key = p.group(1).strip()
            if key in args:
                raise InvalidAction(f"parameter {key!r} of {name!r} given twice")
            raw = p.group(2).removeprefix("\n").removesuffix("\n")
            args[key] = _typed(raw, schemas.get(name, {}).get(key))
            at = p.end()
        if inner[at:].strip():
            raise InvalidAction(f"unclosed or stray text in the parameters of {name!r}: write "
                                "<parameter=ARGUMENT>\nVALUE\n</parameter>")
        return ToolCall(name, args)


TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def _mistral_split(text: str) -> tuple[str, list[ToolCall]]:
    """Both Mistral forms: after each ``[TOOL_CALLS]`` a JSON list of calls (v3-v7) or
    ``NAME[ARGS]{...}`` / ``NAME[CALL_ID]ID[ARGS]{...}`` (v11+); nothing may follow the calls."""
    if TOOL_CALLS not in text:
        return text, []
    content, *segments = text.split(TOOL_CALLS)
    calls: list[ToolCall] = []
    for seg in segments:
        body = seg.strip()
        if body.startswith("["):
            try:
                items, end = json.JSONDecoder().raw_decode(body)
            except json.JSONDecodeError as err:
                raise InvalidAction(f"the tool calls are not a valid JSON list ({err.msg} at character {err.pos})") from None
            if not isinstance(items, list) or not items:
                raise InvalidAction("write [TOOL_CALLS] followed by a JSON list of calls")
            if body[end:].strip():
                raise InvalidAction(f"text after the tool calls ({body[end:].strip()[:30]!r})")
            calls += [call_of(item, ("arguments",)) for item in items]
            continue
        if ARGS not in body:
            raise InvalidAction("write [TOOL_CALLS] followed by a JSON list of calls, or NAME[ARGS]{arguments}")
        name, _, raw = body.partition(ARGS)
        name = name.partition(CALL_ID)[0].strip()
        if not name:
            raise InvalidAction("a tool call has no name before [ARGS]")
        try:
            args, end = json.JSONDecoder().raw_decode(raw.strip())
        except json.JSONDecodeError as err:
            raise InvalidAction(f"the arguments of {name!r} are not valid JSON ({err.msg} at character {err.pos})") from None
        if not isinstance(args, dict):
            raise InvalidAction(f"the arguments of {name!r} must be a JSON object")
        if raw.strip()[end:].strip():
            raise InvalidAction(f"text after the arguments of {name!r} ({raw.strip()[end:].strip()[:30]!r})")
        calls.append(ToolCall(name, args))
    return content.strip(), calls


class Mistral(ToolCallFormat):
    """Mistral's tokenizers v3 to v7 (``mistral_common`` writes ``[TOOL_CALLS]`` and the list as ``json.dumps``)."""

    name = "mistral"
    help = 'Mistral tokenizers v3-v7: [TOOL_CALLS][{"name": ..., "arguments": {...}}]'
    example = '[TOOL_CALLS][{"name": ..., "arguments": {...}}]'
    how = 'call tools by answering only [TOOL_CALLS][{"name": <tool name>, "arguments": {<arguments>}}, ...]'
    markers = (TOOL_CALLS,)

    def detects(self, chat_template: str) -> bool:
        return TOOL_CALLS in chat_template and ARGS not in chat_template

    def render(self, calls: Sequence[ToolCall]) -> str:
        return TOOL_CALLS + json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls], ensure_ascii=False)

    def split(self, text: str, tools: Sequence[Mapping] = ()) -> tuple[str, list[ToolCall]]:
        return _mistral_split(text)


class MistralV11(Mistral):
    """Mistral's tokenizer v11+ (``mistral_common``: ``[TOOL_CALLS]`` name ``[ARGS]`` ``json.dumps(arguments)``)."""

    name = "mistral_v11"
    help = "Mistral tokenizers v11+: [TOOL_CALLS]NAME[ARGS]{...} per call"
    example = "[TOOL_CALLS]NAME[ARGS]{...}"
    how = "call tools by answering only [TOOL_CALLS]<tool name>[ARGS]{<arguments>} for each call"
    markers = (TOOL_CALLS, ARGS)

    def detects(self, chat_template: str) -> bool:
        return TOOL_CALLS in chat_template and ARGS in chat_template

    def render(self, calls: Sequence[ToolCall]) -> str:
        return "".join(f"{TOOL_CALLS}{c.name}{ARGS}{json.dumps(c.arguments, ensure_ascii=False)}" for c in calls)


TOOL_FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (
    Hermes(), Json(), Llama3Json(), Qwen3CoderXml(), Mistral(), MistralV11())}


def tool_format(name: str, key: str = "tool_call_format") -> ToolCallFormat:
    """The registered format ``name``; a ``UserError`` naming ``key`` and the valid formats otherwise."""
    found = TOOL_FORMATS.get(name) if isinstance(name, str) else None
    if found is None:
        raise UserError(f"unknown {key} {name!r}; valid formats: {choices(TOOL_FORMATS)}")
    return found


def detect(chat_template: str | None) -> str | None:
    """The name of the format a chat template's text shows (the first registered that detects it), or None."""
    text = chat_template or ""
    return next((name for name, f in TOOL_FORMATS.items() if f.detects(text)), None)


def resolve(name: str, chat_template: str | dict | None, key: str = "model.tool_format") -> ToolCallFormat:
    """``name``'s format; ``"auto"``: the one ``chat_template`` shows, else hermes (what a
    template without tool calls is asked to write: the schema text says so)."""
    if name == AUTO:
        text = "\n".join(chat_template.values()) if isinstance(chat_template, dict) else chat_template
        return TOOL_FORMATS[detect(text) or "hermes"]
    return tool_format(name, key)
