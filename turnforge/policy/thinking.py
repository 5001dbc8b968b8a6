"""Reasoning templates: how a chat template treats the model's thinking, found by rendering.

The templates of today's open reasoning models (Qwen3, DeepSeek-R1 and their fine-tunes) let
the model think between ``<think>`` and ``</think>`` and then answer, and drop that thinking
from earlier assistant turns once a new user message follows: the rendering of a conversation
is then not a prefix of the rendering of the same conversation one message later. ``detect``
renders a few conversations once, when the ``ChatFormat`` is built, and returns a
``Thinking`` that says what the template keeps of an earlier assistant message (everything, or
what follows the last ``</think>``, with or without its leading newlines). Any other rewrite of
an earlier turn is refused by ``ChatFormat`` with one line that names it.

Token level: the markers must be single tokens of the tokenizer (they are in Qwen3's and
DeepSeek-R1's), so sampled ids split at the close marker's id without decoding. What the
template keeps of an earlier answer is the sampled ids after the last close marker, minus the
leading tokens that are only newlines when the template strips them; a first kept token that
merges newlines with text (rare) is the one place where a piece of sampled text is encoded
again: the template's rendering of that history has no token boundary there.

Two history policies use this (``rollout.history``, ``turnforge.rollout.context``): *as sampled*
keeps every sampled token in the context, *as the template renders* writes each prompt as the
template renders the conversation so far (``Thinking.kept``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from turnforge.errors import UserError
from turnforge.types import THINKING_MARKERS

if TYPE_CHECKING:
    from turnforge.policy.model import ChatFormat

SEPARATOR = "\n\n"  # what reasoning templates put between the close marker and the answer


@dataclass(frozen=True)
class Thinking:
    """The thinking markers of a template and what it keeps of an earlier assistant message."""

    open: str
    close: str
    open_id: int
    close_id: int
    drops: bool  # earlier assistant messages lose everything up to their last close marker
    lstrip: bool  # ... and the newlines right after it
    prompt_opens: bool  # the generation prompt ends inside an open thinking block (DeepSeek-R1's newer templates)
    forced_close: tuple[int, ...]  # ids written after a thinking cut at the budget: the close marker and SEPARATOR

    def split(self, ids) -> int:
        """Index in ``ids`` where the answer starts: after the last close marker; 0 when there is
        none and thinking was not open (the model answered directly); ``len(ids)`` when the
        thinking never closed."""
        ids = list(ids)
        if self.close_id in ids:
            return len(ids) - ids[::-1].index(self.close_id)
        return len(ids) if self.prompt_opens or self.open_id in ids else 0

    def kept(self, ids: tuple[int, ...], chat: ChatFormat) -> tuple[int, ...]:
        """The ids of an earlier assistant message as the template renders it after a later user
        message: all of ``ids`` for a template that keeps thinking, else those after the last close
        marker (all of them when there is none, as the templates do), newlines stripped at the
        token level (see the module docstring)."""
        if not self.drops or self.close_id not in ids:
            return ids
        rest = list(ids[self.split(ids):])
        if self.lstrip:
            while rest and set(chat.tokenizer.decode([rest[0]])) <= {"\n"}:
                rest.pop(0)
            if rest:
                first = chat.tokenizer.decode([rest[0]])
                if first.startswith("\n"):  # newlines merged with text: no token boundary to cut at
                    rest[:1] = chat.encode(first.lstrip("\n"))
        return tuple(rest)


def detect(chat: ChatFormat) -> Thinking | None:
    """The thinking behaviour of ``chat``'s template, found by rendering, or None when its source
    names no thinking marker. Raises ``UserError`` for markers that are not
    single tokens and for a template that rewrites an earlier thinking message other than by
    dropping its thinking."""
    source = chat.tokenizer.chat_template
    source = source if isinstance(source, str) else str(source)
    pair = next(((o, c) for o, c in THINKING_MARKERS if c in source), None)
    if pair is None:
        return None
    open_, close = pair
    ids = {m: chat._template(m) for m in pair}
    if any(len(v) != 1 for v in ids.values()):
        raise UserError(f"chat template of {chat._name!r} uses {open_!r}...{close!r} but the tokenizer does not have them "
                        "as single tokens; add them (tokenizer.add_tokens) so thinking can be told from the answer")
    u, follow = {"role": "user", "content": "u"}, {"role": "user", "content": "v"}

    def earlier(content: str) -> str:
        return chat._render([u, {"role": "assistant", "content": content}, follow], True)

    thought = f"{open_}\nT\n{close}{SEPARATOR}A"
    shown = earlier(thought)
    if shown == earlier("A"):
        drops, lstrip = True, True
    elif shown == earlier(SEPARATOR + "A"):
        drops, lstrip = True, False
    elif thought in shown:
        drops, lstrip = False, False
    else:
        plain = earlier("A")
        start = len(os.path.commonprefix([shown, plain]))
        end = len(os.path.commonprefix([shown[::-1], plain[::-1]]))
        raise UserError(
            f"chat template of {chat._name!r} rewrites an earlier assistant message {thought!r} as "
            f"{shown[start:len(shown) - end]!r} (not by dropping its thinking); turnforge supports templates that keep "
            "earlier turns or drop their thinking"
        )
    prompt = chat._render([u], True)
    after = prompt.rstrip()
    prompt_opens = after.endswith(open_)
    return Thinking(open_, close, ids[open_][0], ids[close][0], drops, lstrip, prompt_opens,
                    chat._template(close + SEPARATOR))


@lru_cache(maxsize=64)
def drops_before(chat: ChatFormat, role: str) -> bool:
    """Whether the template drops an earlier assistant message's thinking when the next message is
    of ``role`` ("user", or "tool": Qwen3 keeps thinking before tool results until the next user
    message). Found by rendering; False for a template without thinking."""
    t = chat.thinking
    if t is None or not t.drops:
        return False
    u, follow = {"role": "user", "content": "u"}, {"role": role, "content": "v"}
    shown = chat._render([u, {"role": "assistant", "content": f"{t.open}\nT\n{t.close}{SEPARATOR}A"}, follow], True)
    return "\nT\n" not in shown


def strip_final(text: str, thinking: Thinking | None) -> str:
    """``text`` (a rendering that ends in an assistant message) without the thinking block a
    thinking-dropping template writes into a final assistant message (e.g. Qwen3's empty
    ``<think>\\n\\n</think>\\n\\n``): what the same message looks like once a user message follows."""
    if thinking is None or not thinking.drops:
        return text
    a = text.rfind(thinking.open)
    b = text.rfind(thinking.close)
    if a < 0 or b < a:
        return text
    rest = text[b + len(thinking.close):]
    return text[:a] + (rest.lstrip("\n") if thinking.lstrip else rest)
