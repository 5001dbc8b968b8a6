"""OpenAI Responses requests (``POST /v1/responses``) as chat requests, and sampled completions back
as Responses objects and their stream events.

A Responses request is translated into the chat-completions request it means, which the gateway
renders, samples and records exactly as one sent to ``/v1/chat/completions`` (the same chat
template, tool-call format, splices and ``CallRecord``); the answer's assistant message is then
written as Responses output items. So a rollout may mix both APIs, and the trace compiler sees
one kind of call.

The subset served, which is what agent frameworks use:

- ``input``: a string (one user message) or a list of items: messages (``role`` user, system,
  developer or assistant; ``content`` a string or ``input_text``/``output_text`` parts),
  ``function_call`` items (``call_id``, ``name``, ``arguments`` as a JSON string) and
  ``function_call_output`` items (``call_id``, ``output`` a string or ``input_text`` parts), which
  become an assistant message's ``tool_calls`` and ``tool`` messages; ``reasoning`` items are
  accepted and not rendered (the chat path drops a re-sent ``reasoning_content`` too: a reasoning
  template drops earlier thinking, and the splice puts the sampled thinking back under
  ``rollout.history=as_sampled``);
- ``instructions``: a system message before the conversation (not carried over a chain, as in
  OpenAI's API);
- ``tools`` of ``type`` function (flat: ``name``, ``description``, ``parameters``; ``strict`` is
  accepted, the arguments are as sampled), ``tool_choice`` auto or none, ``parallel_tool_calls``;
- ``previous_response_id``: a response this gateway stored (``store``, default true) for the same
  rollout (or, serving, one of the last ``SERVED_RESPONSES``): its input items and output items
  go before this request's input;
- ``temperature``, ``top_p`` and ``max_output_tokens`` (the chat path's ``max_tokens``), under
  the same sampling policy (``turnforge.gateway.sampling``);
- ``include`` ``message.output_text.logprobs`` (each sampled token's logprob on the text, as the
  chat path's ``logprobs=true``) and ``reasoning.encrypted_content`` (nothing is encrypted: the
  thinking is in the reasoning item's ``content``);
- ``stream``: the events of the whole answer (``stream_events``), sent once it is sampled (the
  batcher samples completions whole);
- hints the policy cannot follow are accepted and ignored: ``reasoning.effort``/``summary``,
  ``text.verbosity``, ``metadata``, ``user``, ``safety_identifier``, ``prompt_cache_key``,
  ``prompt_cache_retention``, ``service_tier``.

Anything else is a 400 naming the field (``RequestError``): built-in tools (web search, file
search, computer use, MCP, ...), image, file and audio inputs, item references, ``background``,
``conversation``, ``prompt``, ``truncation=auto``, ``max_tool_calls``, structured outputs
(``text.format`` other than text), another ``include``, and an unknown top-level field.

The output: a ``reasoning`` item for a reasoning template's thinking (its ``content`` a
``reasoning_text``), a ``message`` with one ``output_text`` (left out when the reply is only
tool calls), then a ``function_call`` item per parsed call; ``status`` completed, or incomplete
(``max_output_tokens``) when the completion hit its token limit; ``usage`` with input, output
and reasoning tokens.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from turnforge.gateway.render import RequestError

SERVED_RESPONSES = 4096  # stored responses a serving gateway (no rollout) keeps for chaining, the oldest dropped
INCLUDES = ("message.output_text.logprobs", "reasoning.encrypted_content")
IGNORED = ("model", "metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
           "service_tier", "parallel_tool_calls", "stream_options")
SERVED = ("input", "instructions", "tools", "tool_choice", "previous_response_id", "temperature", "top_p",
          "max_output_tokens", "store", "stream", "include", "reasoning", "text", "truncation", "background",
          "top_logprobs", "max_tool_calls", "conversation", "prompt")
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request, checked and translated (``translate``)."""

    chat: dict  # the chat-completions request it renders as (messages, tools, sampling settings)
    items: tuple[dict, ...]  # the conversation's input items: the chained responses' items, then this request's
    echo: dict  # the request's settings a response repeats (instructions, tools, tool_choice, ...)
    store: bool  # keep the response for a later previous_response_id
    stream: bool
    logprobs: bool  # include message.output_text.logprobs


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{key}={value!r} must be true or false", key)
    return value


def _check_fields(body: dict) -> None:
    """Refuse an unknown field, or a served field set to what the gateway does not do."""
    for key in body:
        if key not in SERVED and key not in IGNORED:
            raise RequestError(f"{key}: not a Responses field this gateway serves (turnforge.gateway.responses lists "
                               "the subset)", key, "unsupported_parameter")
    refused = {"background": lambda v: v is not False, "conversation": lambda v: True, "prompt": lambda v: True,
               "max_tool_calls": lambda v: True, "truncation": lambda v: v != "disabled"}
    why = {"background": "background responses are not served; send background=false",
           "conversation": "conversations are not served; chain responses with previous_response_id",
           "prompt": "stored prompt templates are not served; send the input",
           "max_tool_calls": "a limit on tool calls is not enforced; leave it out",
           "truncation": "the gateway never drops input items (a prompt over the context budget is a 400); "
                         "send truncation='disabled'"}
    for key, bad in refused.items():
        if body.get(key) is not None and bad(body[key]):
            raise RequestError(f"{key}={body[key]!r}: {why[key]}", key, "unsupported_parameter")
    if body.get("top_logprobs") not in (None, 0):
        raise RequestError("top_logprobs is not supported (include=['message.output_text.logprobs'] gives each "
                           "sampled token's)", "top_logprobs", "unsupported_parameter")
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or (fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text")):
            raise RequestError("text.format: only {'type': 'text'} is supported (no structured outputs)", "text.format",
                               "unsupported_parameter")
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise RequestError("reasoning must be an object ({'effort': ..., 'summary': ...})", "reasoning")
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list):
            raise RequestError("include must be a list", "include")
        for value in include:
            if value not in INCLUDES:
                raise RequestError(f"include {value!r} is not served; only {', '.join(INCLUDES)}", "include",
                                   "unsupported_parameter")


def _tools(tools: Any) -> list[dict] | None:
    """The request's function tools as chat tools."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise RequestError(f"tools[{i}].type={kind!r}: only function tools are served (no built-in tools: the "
                               "gateway runs no tool; the agent does)", f"tools[{i}].type", "unsupported_parameter")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise RequestError(f"tools[{i}] needs a name", f"tools[{i}].name")
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"tools[{i}].parameters must be a JSON schema object", f"tools[{i}].parameters")
        fn = {"name": t["name"], "description": t.get("description") or "",
              "parameters": params if params is not None else {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": fn})
    return out or None


def _part_text(content: Any, where: str) -> str:
    """The text of a message's or a tool output's content: a string or text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of input_text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}].type={kind!r}: only text parts (input_text, output_text) are served (no "
                               "image, file or audio inputs)", f"{where}[{j}].type", "unsupported_parameter")
        texts.append(part["text"])
    return "".join(texts)


def _items(value: Any) -> list[dict]:
    """A request's ``input`` as a list of items."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
        raise RequestError("input must be a string or a list of input items (objects)", "input")
    return value


def _messages(items: tuple[dict, ...], first: int) -> list[dict]:
    """Chat messages of the conversation's items; an item's position in errors is its index in this
    request's ``input`` (``first``: how many items the chained responses hold)."""
    out: list[dict] = []
    for k, item in enumerate(items):
        where = f"input[{k - first}]" if k >= first else "previous_response_id"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise RequestError(f"{where}.role {role!r} is not one of {', '.join(ROLES)}", f"{where}.role")
            out.append({"role": role, "content": _part_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(key), str) for key in ("call_id", "name", "arguments")):
                raise RequestError(f"{where}: a function_call item needs call_id, name and arguments (strings)", where)
            try:
                args = json.loads(item["arguments"])
            except json.JSONDecodeError:
                raise RequestError(f"{where}.arguments is not JSON", f"{where}.arguments") from None
            if not isinstance(args, dict):
                raise RequestError(f"{where}.arguments must be a JSON object", f"{where}.arguments")
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":  # the calls of one reply: one assistant message
                out[-1]["tool_calls"] = [*out[-1].get("tool_calls", []), call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{where}: a function_call_output item needs a call_id", f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _part_text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # not rendered (the module docstring)
        else:
            raise RequestError(f"{where}.type={kind!r}: only message, function_call, function_call_output and reasoning "
                               "items are served", f"{where}.type", "unsupported_parameter")
    return out


def translate(body: dict, stored: Mapping[str, tuple[dict, ...]]) -> ResponsesRequest:
    """The chat request a Responses ``body`` means (see the module docstring); ``stored``: the
    conversation items of the responses it may chain onto, by id. ``RequestError`` names the field."""
    _check_fields(body)
    prev = body.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or prev not in stored):
        raise RequestError(f"previous response {prev!r} not found (a response of this rollout, stored: store=true)",
                           "previous_response_id", "previous_response_not_found")
    if body.get("input") is None and prev is None:
        raise RequestError("input is required", "input")
    earlier = stored[prev] if prev is not None else ()
    items = earlier + tuple(_items(body["input"]) if body.get("input") is not None else ())
    messages = _messages(items, len(earlier))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("instructions must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    if not messages:
        raise RequestError("input holds no message to answer", "input")
    cap = body.get("max_output_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise RequestError(f"max_output_tokens={cap!r} must be a positive integer", "max_output_tokens")
    logprobs = "message.output_text.logprobs" in (body.get("include") or ())
    chat = {"messages": messages, "tools": _tools(body.get("tools")), "tool_choice": body.get("tool_choice"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "max_tokens": cap, "logprobs": logprobs}
    echo = {"instructions": instructions, "max_output_tokens": cap, "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": prev,
            "reasoning": {"effort": None, "summary": None, **(body.get("reasoning") or {})},
            "text": {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "truncation": "disabled", "user": body.get("user")}
    return ResponsesRequest(chat, items, echo, _flag(body, "store", True), _flag(body, "stream", False), logprobs)


def output_items(message: dict, finish: str, logprobs: list[dict] | None = None) -> list[dict]:
    """The Responses output items of the gateway's chat assistant ``message`` (``render.assistant_message``)."""
    status = "incomplete" if finish == "length" else "completed"
    out = []
    if message.get("reasoning_content") is not None:
        out.append({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}], "encrypted_content": None})
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        text = {"type": "output_text", "text": message.get("content") or "", "annotations": []}
        if logprobs is not None:
            text["logprobs"] = logprobs
        out.append({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": status,
                    "content": [text]})
    for c in calls:
        out.append({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": c["id"],
                    "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"})
    return out


def response(req: ResponsesRequest, output: list[dict], finish: str, *, model: str, temperature: float,
             input_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict:
    """The Responses object of a sampled answer (its ``output`` from ``output_items``)."""
    incomplete = finish == "length"
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": model, "output": output, "store": req.store, "temperature": temperature, "top_p": 1.0,
        **req.echo,
        "usage": {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                  "total_tokens": input_tokens + output_tokens},
    }


def stream_events(resp: dict) -> list[dict]:
    """The server-sent events of a finished response, as OpenAI streams one: created, in_progress;
    per output item added, its content (one delta each) and done; then completed, or incomplete."""
    events: list[dict] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    start = {**resp, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    emit("response.created", response=start)
    emit("response.in_progress", response=start)
    for k, item in enumerate(resp["output"]):
        at = {"item_id": item["id"], "output_index": k}
        if item["type"] == "message":
            emit("response.output_item.added", output_index=k, item={**item, "status": "in_progress", "content": []})
            part = item["content"][0]
            emit("response.content_part.added", **at, content_index=0, part={**part, "text": ""})
            emit("response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=part.get("logprobs", []))
            emit("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=part.get("logprobs", []))
            emit("response.content_part.done", **at, content_index=0, part=part)
        elif item["type"] == "function_call":
            emit("response.output_item.added", output_index=k, item={**item, "status": "in_progress", "arguments": ""})
            emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            emit("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
        else:  # reasoning
            emit("response.output_item.added", output_index=k, item={**item, "status": "in_progress", "content": []})
            text = item["content"][0]["text"]
            emit("response.reasoning_text.delta", **at, content_index=0, delta=text)
            emit("response.reasoning_text.done", **at, content_index=0, text=text)
        emit("response.output_item.done", output_index=k, item=item)
    emit("response.incomplete" if resp["status"] == "incomplete" else "response.completed", response=resp)
    return events


def sse(events: list[dict], done: bool = False) -> Iterator[str]:
    """``events`` as server-sent events (``event:`` the type, when it has one), and ``data: [DONE]``
    after them when ``done`` (the chat stream's end)."""
    for e in events:
        head = f"event: {e['type']}\n" if "type" in e else ""
        yield f"{head}data: {json.dumps(e)}\n\n"
    if done:
        yield "data: [DONE]\n\n"
