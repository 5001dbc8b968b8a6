"""OpenAI chat requests to prompt token ids, and sampled ids back to an assistant message.

Rendering is the model's own chat template (``apply_chat_template``) over the request's
messages, as any OpenAI-compatible server does, with two adaptations for templates that
lack a feature (both measured once per tokenizer, by rendering with and without it):

- tools the template cannot render go into the system prompt as text, with the call syntax of
  the tool-call format (``ToolCallFormat.schema_text``, as ``rollout.tools_in_system_prompt`` does);
- assistant ``tool_calls`` the template cannot render are written into the message content
  as the format renders them (``<tool_call>{json}</tool_call>`` for Hermes, the form the model
  is asked to emit).

Tool-call formats (``turnforge.envs.tool.formats``): the one the chat template shows (``auto``:
Hermes JSON, Qwen3-Coder XML, Llama 3 JSON, Mistral ``[TOOL_CALLS]``; Hermes for a template that
shows none) or the one named (``tool_format``). Assistant ``tool_calls`` go to a template that
renders them with their arguments as objects (templates iterate or ``tojson`` them), and a
sampled reply is parsed by the same format: its calls become ``tool_calls``; a reply whose call
does not parse keeps its whole text as the content, as sampled, and is counted by the gateway.

Images (a vision-language policy, ``turnforge.policy.vision``): ``image_url`` content parts with a
``data:image/...;base64,...`` URL (no fetching: the gateway reaches nothing) are written into the
message as the text of the image's processor block, which tokenizes back to exactly that block;
the request's images go with its prompt, in order. A text model answers them with a 400.

Token-exact history (``splice``): when the rendered prompt's text begins with the text of an
earlier call of the same rollout (its prompt and sampled completion, decoded), the prompt
is that call's exact token ids followed by the rest of the text, tokenized. The model then
sees the tokens it sampled, not a re-tokenization of their text (which can differ: a
model may sample ``Do`` + ``wn`` where the tokenizer writes ``Down``). Where the text
differs (a client that rewrote a message), nothing is spliced and the trace compiler counts
the split.

Reasoning templates (``turnforge.policy.thinking``): a response carries the thinking as
``reasoning_content`` and the answer as ``content``, as OpenAI-compatible reasoning servers do.
A client sends its history back without the thinking (the normal case; the template drops it
from earlier turns anyway), so an earlier call's text to match is its rendered prompt and its
completion as the template shows it later (``Thinking.kept``). What the splice puts in its
place follows ``rollout.history`` (``turnforge.rollout.history``): ``as_sampled``, the prompt
and completion ids as sampled, thinking included (the trace compiler then extends one sample);
``as_rendered``, the prompt ids and the kept completion ids (the template's rendering, the
sampled answer ids not re-tokenized; the trace compiler starts a new sample, counted as a
``rerendered`` split).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from turnforge.envs.base import InvalidAction
from turnforge.envs.tool.formats import AUTO, TOOL_FORMATS, ToolCall, ToolCallFormat, resolve
from turnforge.policy.thinking import Thinking
from turnforge.rollout.history import AsRendered, AsSampled

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request the gateway cannot serve: an OpenAI-style 400 with ``param`` named."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param, self.code = param, code


def _image(part: dict, where: str) -> bytes:
    """The bytes of an ``image_url`` part's ``data:`` URL."""
    import base64
    import binascii

    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
        raise RequestError(f"{where}.image_url.url: only data:image/...;base64,... URLs are supported (the gateway "
                           "fetches nothing)", f"{where}.image_url")
    try:
        return base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}.image_url.url: not valid base64", f"{where}.image_url") from None


def _text(content: Any, where: str, image_text=None, images: list[bytes] | None = None) -> str:
    """A message's content as text; ``image_url`` parts become ``image_text(bytes)`` (the image's
    block as text) and their bytes are appended to ``images`` (vision policies; else refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text, and images for a vision policy
        parts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind == "image_url" and image_text is not None and images is not None:
                png = _image(part, f"{where}.content[{i}]")
                parts.append(image_text(png, f"{where}.content[{i}]"))
                images.append(png)
                continue
            if not isinstance(part, dict) or kind != "text" or not isinstance(part.get("text"), str):
                supported = "text and image_url" if image_text is not None else "text (the model is text-only)"
                raise RequestError(f"{where}.content[{i}]: only {supported} parts are supported, got {kind!r}",
                                   f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string or a list of content parts", f"{where}.content")


def request_calls(tool_calls: list[dict], where: str) -> list[ToolCall]:
    """A request's OpenAI ``tool_calls`` as calls (arguments given as a JSON string or an object)."""
    out = []
    for i, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}.tool_calls[{i}] needs a function with a name", f"{where}.tool_calls")
        args = fn.get("arguments", "{}")
        try:
            args_obj = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            raise RequestError(f"{where}.tool_calls[{i}].function.arguments is not JSON", f"{where}.tool_calls") from None
        if not isinstance(args_obj, dict):
            raise RequestError(f"{where}.tool_calls[{i}].function.arguments must be a JSON object", f"{where}.tool_calls")
        out.append(ToolCall(fn["name"], args_obj))
    return out


def _template_calls(tool_calls: list[dict], calls: list[ToolCall]) -> list[dict]:
    """The request's ``tool_calls`` for the chat template: each as sent, its arguments an object."""
    return [{**call, "type": "function", "function": {**call["function"], "arguments": c.arguments}}
            for call, c in zip(tool_calls, calls)]


@dataclass
class Prior:
    """An earlier call of a rollout, for splicing: its exact ids and their text."""

    ids: tuple[int, ...]
    text: str


def decode(tokenizer, ids) -> str:
    """Text of ids, special tokens kept, no clean-up (so that a prompt's text renders back)."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


class Renderer:
    """Renders requests for one tokenizer (see the module docstring). ``chat``: the policy's
    ``ChatFormat`` (for its thinking markers); ``history``: the history policy of splices;
    ``tool_format``: a ``TOOL_FORMATS`` name, or ``auto`` for the one the chat template shows."""

    def __init__(self, tokenizer, vision=None, chat=None, history: AsSampled | AsRendered = AsSampled(),
                 tool_format: str = AUTO) -> None:
        self.tok, self.vision, self.history = tokenizer, vision, history
        self.chat = chat if chat is not None and chat.thinking is not None else None
        self.format: ToolCallFormat = resolve(tool_format, getattr(tokenizer, "chat_template", None))
        probe_tool = [{"type": "function", "function": {"name": "probe_fn", "description": "d",
                                                         "parameters": {"type": "object", "properties": {}}}}]
        user = [{"role": "user", "content": "hi"}]
        self.renders_tools = self._apply(user, probe_tool) != self._apply(user, None)
        call = {"id": "c", "type": "function", "function": {"name": "probe_fn", "arguments": {}}}
        with_call = user + [{"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            self.renders_tool_calls = "probe_fn" in self._apply(with_call, None, gen=False)
        except Exception:  # templates that choke on the key
            self.renders_tool_calls = False

    def _apply(self, messages, tools, gen: bool = True) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)

    def _image_text(self, png: bytes, where: str) -> str:
        from turnforge.errors import UserError

        try:
            return decode(self.tok, self.vision.block(png))
        except UserError as err:
            raise RequestError(f"{where}: {err}", where) from None

    def messages(self, messages: Any, tools: Any, images: list[bytes] | None = None) -> tuple[list[dict], list[dict] | None]:
        """The request's messages checked and adapted to the template, and the tools to pass it;
        the images of ``image_url`` parts are appended to ``images`` in order (vision policies)."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", "messages")
        if tools is not None and (not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools)):
            raise RequestError('tools must be a list of {"type": "function", "function": {"name": ...}}', "tools")
        out = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                role = m.get("role") if isinstance(m, dict) else None
                raise RequestError(f"{where}.role {role!r} is not one of {', '.join(ROLES)}", f"{where}.role")
            role = "system" if m["role"] == "developer" else m["role"]
            content = _text(m.get("content"), where, self._image_text if self.vision is not None else None, images)
            msg = {"role": role, "content": content}
            if role == "assistant" and m.get("tool_calls"):
                calls = request_calls(m["tool_calls"], where)
                if self.renders_tool_calls:
                    msg["tool_calls"] = _template_calls(m["tool_calls"], calls)
                else:
                    try:
                        msg["content"] = content + self.format.render(calls)
                    except ValueError as err:  # more calls than the format writes in one reply
                        raise RequestError(f"{where}.tool_calls: {err}", f"{where}.tool_calls") from None
            out.append(msg)
        if tools and not self.renders_tools:
            text = self.format.schema_text(tools)
            if out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
            else:
                out.insert(0, {"role": "system", "content": text})
            tools = None
        return out, (tools or None)

    def prior(self, text: str, prompt: tuple[int, ...], completion: tuple[int, ...]) -> Prior:
        """What a later call of the rollout may splice onto: a call whose rendered prompt was
        ``text`` (ids ``prompt``) and that sampled ``completion`` (see the module docstring)."""
        if self.chat is None:
            return Prior(prompt + completion, decode(self.tok, prompt + completion))
        kept = self.chat.thinking.kept(completion, self.chat)
        return Prior(prompt + self.history.shown(completion, self.chat, "user"), text + decode(self.tok, kept))

    def prompt(self, messages: Any, tools: Any, priors: list[Prior] = ()) -> tuple[tuple[int, ...], bool, tuple[bytes, ...], str]:
        """(prompt ids, spliced?, the images of its blocks, its rendered text) of a request, spliced
        onto the longest matching prior."""
        images: list[bytes] = []
        msgs, tools = self.messages(messages, tools, images)
        try:
            text = self._apply(msgs, tools)
        except Exception as err:  # jinja raise_exception: roles out of order, unsupported roles
            raise RequestError(f"the model's chat template cannot render these messages: {err}", "messages") from None
        best = max((p for p in priors if text.startswith(p.text)), key=lambda p: len(p.text), default=None)
        if best is not None:
            ids, spliced = best.ids + tuple(self.tok.encode(text[len(best.text):], add_special_tokens=False)), True
        else:
            ids, spliced = tuple(self.tok.encode(text, add_special_tokens=False)), False
        if self.vision is not None:
            per = sum(len(self.vision.block(png)) for png in images)
            written = sum(1 for i in ids if i == self.vision.image_token_id)
            blocks = sum(1 for png in images for i in self.vision.block(png) if i == self.vision.image_token_id)
            if written != blocks:
                raise RequestError(f"the messages hold {written} image tokens but their {len(images)} image_url parts "
                                   f"make {blocks} ({per} block tokens): do not write image tokens as text", "messages")
        return ids, spliced, tuple(images), text


def split_reasoning(text: str, thinking: Thinking | None) -> tuple[str | None, str]:
    """(reasoning, answer) of sampled ``text``: the thinking between the markers (None for a
    template without them, or a completion that did not think) and what follows the last close
    marker, its leading newlines stripped (as the templates do); a thinking never closed is all
    reasoning, with an empty answer."""
    if thinking is None:
        return None, text
    if thinking.close in text:
        head, _, answer = text.rpartition(thinking.close)
        return head.split(thinking.open, 1)[-1].strip("\n"), answer.lstrip("\n")
    if thinking.prompt_opens or text.lstrip().startswith(thinking.open):
        return text.split(thinking.open, 1)[-1].strip("\n"), ""
    return None, text


def assistant_message(text: str, finish_reason: str, thinking: Thinking | None = None,
                      fmt: ToolCallFormat = TOOL_FORMATS["hermes"], tools: list | None = None
                      ) -> tuple[dict, str, str | None]:
    """The OpenAI assistant message of sampled ``text`` (stop token removed), the finish reason,
    and why its tool call did not parse (None when it parsed or has none): a reasoning template's
    thinking goes in ``reasoning_content`` (``split_reasoning``); the calls that ``fmt`` reads in
    the answer (typed by the request's ``tools``, for formats without types) become ``tool_calls``
    and the rest is the content; a reply whose call does not parse keeps its text, as sampled."""
    reasoning, text = split_reasoning(text, thinking)
    extra = {} if reasoning is None else {"reasoning_content": reasoning}
    try:
        content, calls = fmt.split(text, tools or ())
    except InvalidAction as err:
        return {"role": "assistant", "content": text, **extra}, finish_reason, str(err)
    if not calls:
        return {"role": "assistant", "content": text, **extra}, finish_reason, None
    tool_calls = [{"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
                   "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]
    return {"role": "assistant", "content": content or None, **extra, "tool_calls": tool_calls}, "tool_calls", None
