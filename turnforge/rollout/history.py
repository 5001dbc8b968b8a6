"""History policies (``rollout.history``): what later prompts of an episode show of an action.

They differ only for reasoning templates that drop the thinking of earlier assistant messages
(``turnforge.policy.thinking``); for any other template both write the same prompts.

- ``as_sampled``: later prompts show every sampled token, thinking included. With
  ``rollout.context=full_history`` the episode is one growing sequence and one sample, exactly
  what the sampler saw. Departure from deployment: there the template shows earlier turns
  without their thinking, so from the second turn on the model is prompted differently than it
  was trained.
- ``as_rendered``: each turn's prompt is what the template renders for the conversation so far:
  earlier answers without their thinking (the ids after the last ``</think>``, never
  re-tokenized; ``Thinking.kept``). The prompt is then no extension of the previous turn's
  context, so each turn is its own sample (``Sample.turn_index``, as in ``window`` mode: credit
  assignment, anchors and the critic read it as a one-turn sample). The prompt's ids are written
  once per turn from the template's pieces; with ``rollout.prefix_cache`` only the part after the
  previous turn's generation prompt is prefilled again.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnforge.policy.model import ChatFormat
from turnforge.policy.thinking import drops_before


@dataclass(frozen=True)
class AsSampled:
    """Later prompts show the action's ids as sampled."""

    name: str = "as_sampled"
    help: str = "every sampled token, thinking included"
    per_turn: bool = False  # a growing context stays one sample

    def shown(self, ids: tuple[int, ...], chat: ChatFormat, role: str) -> tuple[int, ...]:
        return ids


@dataclass(frozen=True)
class AsRendered:
    """Later prompts show the action as the template renders it once a message of ``role``
    follows (its thinking dropped where the template drops it); one sample per turn."""

    name: str = "as_rendered"
    help: str = "the template's rendering, earlier thinking dropped; one sample per turn"
    per_turn: bool = True

    def shown(self, ids: tuple[int, ...], chat: ChatFormat, role: str) -> tuple[int, ...]:
        if chat.thinking is None or not drops_before(chat, role):
            return ids
        return chat.thinking.kept(ids, chat)


HISTORIES: dict[str, AsSampled | AsRendered] = {h.name: h for h in (AsSampled(), AsRendered())}
