"""A thinking budget per turn (``rollout.thinking_budget``), as reasoning servers enforce one.

A turn is sampled in at most two calls to the actor. The first samples up to ``budget`` tokens.
A row that stopped is done. A row whose thinking is still open (no ``</think>`` yet) gets the
close marker and the separator written after its sampled ids (``Thinking.forced_close``: context,
loss mask 0, never trained) and a second call samples its answer, up to ``answer_tokens``
(``rollout.max_new_tokens``). A row that closed its thinking (or never opened one) and has not
stopped goes on with its answer in the second call, up to ``answer_tokens`` answer tokens in all;
an answer already longer is cut there (as ``max_new_tokens`` cuts a generation). Rows of the
second call are grouped by what they have left (one call shares ``max_new_tokens``).

An answer ends before a thinking marker it samples (a model that opens its thinking again after
``</think>``): its ids are cut there, as a stop string cuts them, and the turn counts as cut
(``Generation.stopped`` false). So thinking never passes ``budget`` tokens, the answer (what follows
the one ``</think>``) never passes ``answer_tokens``, and the answer holds no marker. The second
call of an episode's turn draws from its own seed (``ActorInput.part``) with ``rollout.noise=episode``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from turnforge.policy.generate import Generation
from turnforge.policy.thinking import Thinking
from turnforge.rollout.actors import Actor, ActorInput

NO_FORCE = (0, 0)


def think_then_answer(actor: Actor, inputs: Sequence[ActorInput], thinking: Thinking, budget: int,
                      answer_tokens: int) -> list[tuple[Generation | str, tuple[int, int]]]:
    """Per input: the action (a ``Generation`` of thinking, any forced close, and answer; or a text
    actor's text) and the span [a, b) of its ids that was written, not sampled (``(0, 0)``: none)."""
    first = actor.act([replace(x, max_new_tokens=budget) for x in inputs])
    out: list[tuple[Generation | str, tuple[int, int]]] = []
    later: dict[int, list[tuple[int, tuple[int, ...], tuple[float, ...], tuple[int, int]]]] = {}
    for i, g in enumerate(first):
        if not isinstance(g, Generation):
            out.append((g, NO_FORCE))
            continue
        cut = _answer_ends_at_a_marker(g, thinking)
        if g.stopped or cut is not g:  # done: stopped, or its answer opened a thinking again
            out.append((cut, NO_FORCE))
            continue
        ids, lps = tuple(g.ids), tuple(g.logprobs)
        start = thinking.split(ids)
        if start == len(ids) and (thinking.prompt_opens or thinking.open_id in ids):  # the budget ran out in thinking
            forced = (len(ids), len(ids) + len(thinking.forced_close))
            ids, lps, left = ids + thinking.forced_close, lps + (float("nan"),) * len(thinking.forced_close), answer_tokens
        else:
            forced, left = NO_FORCE, answer_tokens - (len(ids) - start)
            if left <= 0:
                out.append((Generation(ids[:start + answer_tokens], lps[:start + answer_tokens], False), NO_FORCE))
                continue
        out.append((g, forced))  # replaced once its answer is sampled
        later.setdefault(left, []).append((i, ids, lps, forced))
    for left, rows in later.items():
        inputs2 = [replace(inputs[i], prompt=tuple(inputs[i].prompt or ()) + ids, max_new_tokens=left, part="answer")
                   for i, ids, _, _ in rows]
        for (i, ids, lps, forced), g in zip(rows, actor.act(inputs2)):
            assert isinstance(g, Generation)
            out[i] = (Generation(ids + tuple(g.ids), lps + tuple(g.logprobs), g.stopped), forced)
    return [(_answer_ends_at_a_marker(g, thinking) if isinstance(g, Generation) else g, forced) for g, forced in out]


def _answer_ends_at_a_marker(g: Generation, thinking: Thinking) -> Generation:
    """``g`` cut before the first thinking marker of its answer: the ids after its first ``</think>``
    (the forced one included), or all of them when it did not open a thinking (see the module docstring)."""
    ids = g.ids
    if thinking.close_id in ids:
        start = ids.index(thinking.close_id) + 1
    elif thinking.prompt_opens or (len(ids) > 0 and ids[0] == thinking.open_id):
        return g  # a thinking never closed: no answer to police
    else:
        start = 0
    cut = next((k for k in range(start, len(ids)) if ids[k] in (thinking.open_id, thinking.close_id)), None)
    return g if cut is None else Generation(ids[:cut], g.logprobs[:cut], False)
