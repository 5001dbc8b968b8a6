"""What the gateway recorded for one rollout, and the compiler from those calls to training samples.

A rollout's calls are compiled in order. A call whose prompt tokens begin with everything
the current sample holds (earlier prompts and sampled completions, exactly) extends it:
the new prompt tokens join as context (loss mask 0) and the completion as actions (loss
mask 1, with the sampling logprobs and policy version). Any other call starts a new sample,
and the split is recorded with its reason:

- ``rerendered``: the prompt agrees with the sample up to some token and then differs, and
  the difference lies in or right after tokens the model sampled (the agent's re-sent
  history rendered to other tokens: a template that strips reasoning, a client that
  reformats a message or a tool call);
- ``branch``: the prompt is a prefix of the sample (the agent retried a call, or went back
  to an earlier point of its conversation);
- ``new_context``: the prompt departs from the sample before its first sampled token (the
  agent started another conversation: a sub-agent, a summariser, a rewritten system prompt).

Nothing is re-tokenized and nothing is dropped: every sampled token of every call is in
exactly one sample, with its logprob, and every split is counted (``CompiledTrace.splits``).
The samples are the rollout's segments in call order (``segment_index`` 0, 1, ...; each one's
``parent_segment`` the sample before it): an agent that compacts its own history (asks the
model for a summary, then restarts its conversation from it) trains every context it used,
the summary where the model wrote it and as context where the agent re-sent it, the same
shape as ``rollout.context=summarize`` gives env episodes; the trainer broadcasts the
rollout's advantage to all of them.

Several policies (``agent.policies``): each call was sampled by the adapter its request named
(``CallRecord.policy``), and each policy's calls compile on their own, in call order: a call
extends only an earlier sample of its own policy, never another's (their ids may agree, their
weights do not). Every sample names its policy; segments are numbered over the rollout, policy
by policy in the order each first spoke, and each policy's first sample has no parent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from turnforge.types import Sample

if TYPE_CHECKING:
    from turnforge.gateway.sampling import Override

SPLIT_REASONS = ("rerendered", "branch", "new_context")


@dataclass(frozen=True)
class CallRecord:
    """One chat-completion call as the gateway served it."""

    index: int  # order of the call within its rollout
    prompt_ids: tuple[int, ...]  # exactly what the model was conditioned on
    completion_ids: tuple[int, ...]  # exactly what it sampled (the stop token included when one was sampled)
    logprobs: tuple[float, ...]  # sampling logprob of each completion id
    version: int  # policy version that sampled it
    temperature: float
    finish_reason: str  # "stop" | "length" | "tool_calls"
    images: tuple[bytes, ...] = field(default=(), repr=False)  # the images of the prompt's blocks, in order
    overrides: tuple[Override, ...] = ()  # the request's sampling settings it was not sampled with (gateway.sampling)
    forced: tuple[int, int] = (0, 0)  # [a, b) of completion_ids the gateway wrote, not sampled (a thinking closed at
    #   its budget): context, loss mask 0, no logprob
    policy: str = ""  # the adapter that sampled it (agent.policies), "" for the one policy


@dataclass(frozen=True)
class Split:
    """A call that could not extend the sample before it."""

    call_index: int
    reason: str  # one of SPLIT_REASONS
    position: int  # first prompt token that differs from the previous sample (its length if shorter)
    expected: tuple[int, ...]  # up to 8 ids the previous sample has from ``position``
    got: tuple[int, ...]  # up to 8 ids the prompt has from ``position``


@dataclass(frozen=True)
class CompiledTrace:
    samples: tuple[Sample, ...]
    splits: tuple[Split, ...]

    def count(self, reason: str) -> int:
        return sum(s.reason == reason for s in self.splits)


class _Builder:
    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.images: tuple[bytes, ...] = ()

    def add(self, ids, sampled: bool, logprobs=(), version: int = -1) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += list(logprobs) if sampled else [float("nan")] * len(ids)
        self.versions += [version if sampled else -1] * len(ids)

    def sample(self, trajectory_id: str, turn_index: int, segment_index: int, parent: int, policy: str) -> Sample:
        return Sample(
            token_ids=np.asarray(self.ids, dtype=np.int64), loss_mask=np.asarray(self.mask, dtype=np.int8),
            logprobs=np.asarray(self.logprobs, dtype=np.float32), versions=np.asarray(self.versions, dtype=np.int32),
            trajectory_id=trajectory_id, turn_index=turn_index, segment_index=segment_index,
            parent_segment=parent, images=self.images, policy=policy,
        )


def compile_trace(calls: list[CallRecord], trajectory_id: str) -> CompiledTrace:
    """Samples and splits of one rollout's calls (see the module docstring). Samples that
    span several calls have ``turn_index`` -1; a sample of one call has that call's index."""
    samples: list[Sample] = []
    splits: list[Split] = []
    ordered = sorted(calls, key=lambda c: c.index)
    for policy in dict.fromkeys(c.policy for c in ordered):
        _compile([c for c in ordered if c.policy == policy], trajectory_id, policy, samples, splits)
    return CompiledTrace(tuple(samples), tuple(sorted(splits, key=lambda sp: sp.call_index)))


def _compile(calls: list[CallRecord], trajectory_id: str, policy: str, samples: list[Sample], splits: list[Split]) -> None:
    """One policy's calls (in order) as samples appended to ``samples``, their splits to ``splits``."""
    first_segment = len(samples)
    cur: _Builder | None = None
    first_call = cur_calls = 0

    def close(b: _Builder) -> Sample:
        return b.sample(trajectory_id, first_call if cur_calls == 1 else -1, len(samples),
                        len(samples) - 1 if len(samples) > first_segment else -1, policy)

    for call in calls:
        if len(call.completion_ids) != len(call.logprobs):
            raise ValueError(f"call {call.index}: {len(call.completion_ids)} completion ids but {len(call.logprobs)} logprobs")
        prompt = list(call.prompt_ids)
        # equal ids may hold other images: the prompt extends the sample only if its images do too
        if cur is not None and prompt[:len(cur.ids)] == cur.ids and call.images[:len(cur.images)] == cur.images:
            cur.add(prompt[len(cur.ids):], False)
            cur.images = call.images
        else:
            if cur is not None:
                pos = next((i for i, (a, b) in enumerate(zip(cur.ids, prompt)) if a != b), min(len(cur.ids), len(prompt)))
                first_sampled = cur.mask.index(1) if 1 in cur.mask else len(cur.ids)
                if pos < first_sampled:
                    reason = "new_context"
                else:
                    reason = "branch" if pos == len(prompt) else "rerendered"
                splits.append(Split(call.index, reason, pos, tuple(cur.ids[pos:pos + 8]), tuple(prompt[pos:pos + 8])))
                samples.append(close(cur))
            cur, first_call, cur_calls = _Builder(), call.index, 0
            cur.add(prompt, False)
            cur.images = call.images
        ids, lps, (a, b) = list(call.completion_ids), list(call.logprobs), call.forced
        cur.add(ids[:a], True, lps[:a], call.version)
        cur.add(ids[a:b], False)
        cur.add(ids[b:], True, lps[b:], call.version)
        cur_calls += 1
    if cur is not None:
        samples.append(close(cur))
