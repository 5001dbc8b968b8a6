"""Token bookkeeping of one episode under a context policy and explicit budgets.

Two context policies:

- ``full_history``: one growing sequence per episode (system, obs 1, action 1, obs 2,
  ...); the whole episode is one training sample.
- ``window``: each turn's prompt is the system prompt, the last ``history_window`` turns
  and the current observation; each turn is one training sample.

Invariants: the policy's generated ids are stored as sampled (never re-tokenized);
template, observation and marker tokens are context (loss mask 0). An observation that
would overflow ``max_context_tokens`` (prompt + ``max_new_tokens``) is cut by tokens
and gets a visible marker; in window mode older history turns are dropped first. Both
are counted. If not even an empty observation fits, the episode ends with truncation
reason ``context_budget``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from turnforge.config import RolloutConfig
from turnforge.errors import UserError
from turnforge.policy.model import ChatFormat
from turnforge.types import Sample


class ContextOverflow(Exception):
    """Not even an empty observation fits the context budget."""


@dataclass
class _Action:
    ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None  # None: not sampled (expert demonstration)
    version: int
    close: tuple[int, ...]  # template ids after the action (e.g. "\n" after <|im_end|>)


@dataclass(frozen=True)
class PromptSpec:
    """What an env puts around its observations: the system prompt, the tools the template
    renders into it, and the chat role of observations after the first."""

    system: str | None = None
    tools: str = ""  # JSON list of tool schemas ("" = none): hashable, and sent as is to Ray workers
    observation_role: str = "user"
    examples: tuple[tuple[str, str], ...] = ()  # (observation, answer) turns before the first observation

    @classmethod
    def of(cls, env, include_instructions: bool, example_turns: int = 0, tools_in_system_prompt: bool = False
           ) -> "PromptSpec":
        """The spec of ``env``; without ``include_instructions`` neither its instructions nor
        its tool schemas are shown (the policy must have learned them). ``example_turns``:
        that many turns of the env's expert on train task 0 come before the first observation,
        with the roles a live episode has (few-shot prompting). ``tools_in_system_prompt``: the tool
        schemas are written into the system prompt as text (``tools_text``) instead of going
        through the template's ``tools`` argument, for templates that cannot render tools."""
        examples = expert_examples(env, example_turns)
        if not include_instructions:
            return cls(None, "", env.observation_role, examples)
        if env.tools and tools_in_system_prompt:
            return cls(f"{env.instructions}\n\n{tools_text(env)}", "", env.observation_role, examples)
        tools = json.dumps(list(env.tools)) if env.tools else ""
        return cls(env.instructions, tools, env.observation_role, examples)


def tools_text(env) -> str:
    """A tool env's schemas as plain text (``schemas_text`` with its ``tool_call_format``)."""
    return schemas_text(env.tools, getattr(env, "tool_call_format", "hermes"))


def schemas_text(tools, fmt: str = "hermes") -> str:
    """Tool schemas (OpenAI ``{"type": "function", "function": ...}`` dicts) as plain text with
    the call syntax of ``fmt`` (Hermes-style, the format of most tool-trained templates, or
    JSON), for templates that cannot render tools."""
    if fmt == "json":
        how = 'call one by answering only {"name": <tool name>, "parameters": {<arguments>}}'
    else:
        how = 'call one with <tool_call>{"name": <tool name>, "arguments": {<arguments>}}</tool_call>'
    schemas = "\n".join(json.dumps(t, separators=(", ", ": ")) for t in tools)
    return f"You may use these tools; {how}.\n{schemas}"


def expert_examples(env, turns: int) -> tuple[tuple[str, str], ...]:
    """``turns`` (observation, expert action) pairs of the env's expert on train task 0 (() for 0).
    They are expert labels shown in every prompt; ``turns`` of them are counted as expert queries."""
    if turns == 0:
        return ()
    if not callable(getattr(env, "expert_action", None)):
        raise UserError(f"rollout.example_turns={turns} needs env {env.env_id!r} to implement expert_action() "
                        "(the worked turns are the expert's); set rollout.example_turns=0")
    obs = env.reset(env.task("train", 0), 0)
    pairs = []
    for _ in range(turns):
        action = env.expert_action()
        pairs.append((obs, action))
        result = env.step(action)
        if result.terminated or result.truncated:
            break
        obs = result.observation
    return tuple(pairs)


@dataclass
class EpisodeContext:
    """Builds prompts and samples for one episode."""

    chat: ChatFormat
    cfg: RolloutConfig
    spec: PromptSpec
    marker_ids: tuple[int, ...]
    trajectory_id: str
    # full-history buffers (token-level, grow by appending)
    _ids: list[int] = field(default_factory=list)
    _mask: list[int] = field(default_factory=list)
    _logprobs: list[float] = field(default_factory=list)
    _versions: list[int] = field(default_factory=list)
    # window mode: per turn (observation content ids, action)
    _turns: list[tuple[tuple[int, ...], _Action]] = field(default_factory=list)
    _obs_ids: tuple[int, ...] = ()
    _prompt: tuple[int, ...] = ()
    samples: list[Sample] = field(default_factory=list)
    history_dropped: int = 0  # window turns dropped to fit the budget

    # ------------------------------------------------------------ observations
    def observe(self, observation: str) -> int:
        """Add the next observation; returns how many of its tokens were cut (0 = none).
        Raises ``ContextOverflow`` if the prompt cannot fit at all."""
        content = self.chat.encode(observation)
        if self.cfg.context == "full_history":
            return self._observe_full(content)
        return self._observe_window(content)

    def _fit(self, content: tuple[int, ...], fixed: int) -> tuple[tuple[int, ...], int]:
        room = self.cfg.max_context_tokens - self.cfg.max_new_tokens - fixed
        if len(content) <= room:
            return content, 0
        keep = room - len(self.marker_ids)
        if keep < 0:
            raise ContextOverflow
        return content[:keep] + self.marker_ids, len(content) - keep

    def _observe_full(self, content: tuple[int, ...]) -> int:
        if not self._ids:
            head, tail = self.chat.start(self.spec.system, self.spec.tools, self.spec.examples, self.spec.observation_role)
        else:
            head, tail = self.chat.turn(self.spec.observation_role)
        content, cut = self._fit(content, len(self._ids) + len(head) + len(tail))
        piece = head + content + tail
        self._ids.extend(piece)
        self._mask.extend([0] * len(piece))
        self._logprobs.extend([float("nan")] * len(piece))
        self._versions.extend([-1] * len(piece))
        return cut

    def _window_prompt(self, turns, content: tuple[int, ...]) -> tuple[int, ...]:
        """The window's first observation goes in the first user message (a tool result as
        first message would be an orphan), later ones in messages of the observation role."""
        head, tail = self.chat.start(self.spec.system, self.spec.tools, self.spec.examples, self.spec.observation_role)
        later_head, later_tail = self.chat.turn(self.spec.observation_role)
        out: list[int] = list(head)
        for i, (obs, act) in enumerate(turns):
            if i > 0:
                out.extend(later_head)
            out.extend(obs)
            out.extend(tail if i == 0 else later_tail)
            out.extend(act.ids)
            out.extend(act.close)
        out.extend(later_head if turns else ())
        out.extend(content)
        out.extend(tail if not turns else later_tail)
        return tuple(out)

    def _observe_window(self, content: tuple[int, ...]) -> int:
        k = self.cfg.history_window
        turns = self._turns[-k:] if k > 0 else []
        while True:
            fixed = len(self._window_prompt(turns, ()))
            room = self.cfg.max_context_tokens - self.cfg.max_new_tokens - fixed
            if len(content) <= room or not turns:
                break
            turns = turns[1:]
            self.history_dropped += 1
        content, cut = self._fit(content, fixed)
        self._obs_ids = content
        self._prompt = self._window_prompt(turns, content)
        return cut

    # ------------------------------------------------------------ prompts and actions
    def prompt(self) -> tuple[int, ...]:
        """Ids the policy conditions on for the next action."""
        return tuple(self._ids) if self.cfg.context == "full_history" else self._prompt

    def act(self, ids: tuple[int, ...], logprobs: tuple[float, ...] | None, version: int) -> None:
        """Record the action ids (exactly as generated) and the template's closing ids."""
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} action ids but {len(logprobs)} logprobs")
        # The closing text minus what the ids already hold (e.g. a sampled <|im_end|>): decode
        # with special tokens kept so a sampled stop token is seen.
        close = self.chat.close_after(self.chat.tokenizer.decode(ids, skip_special_tokens=False))
        action = _Action(ids, logprobs, version, close)
        lp = list(logprobs) if logprobs is not None else [float("nan")] * len(ids)
        ver = version if logprobs is not None else -1
        if self.cfg.context == "full_history":
            self._ids.extend(ids)
            self._mask.extend([1] * len(ids))
            self._logprobs.extend(lp)
            self._versions.extend([ver] * len(ids))
            self._ids.extend(action.close)
            self._mask.extend([0] * len(action.close))
            self._logprobs.extend([float("nan")] * len(action.close))
            self._versions.extend([-1] * len(action.close))
        else:
            prompt = self._prompt
            n = len(prompt)
            self.samples.append(
                Sample(
                    token_ids=np.asarray(prompt + ids, dtype=np.int64),
                    loss_mask=np.concatenate([np.zeros(n, np.int8), np.ones(len(ids), np.int8)]),
                    logprobs=np.asarray([float("nan")] * n + lp, dtype=np.float32),
                    versions=np.asarray([-1] * n + [ver] * len(ids), dtype=np.int32),
                    trajectory_id=self.trajectory_id,
                    turn_index=len(self._turns),
                )
            )
            self._turns.append((self._obs_ids, action))

    def finish(self) -> list[Sample]:
        """All samples of the episode (call once, after the last action)."""
        if self.cfg.context == "full_history" and any(self._mask):
            self.samples = [
                Sample(
                    token_ids=np.asarray(self._ids, dtype=np.int64),
                    loss_mask=np.asarray(self._mask, dtype=np.int8),
                    logprobs=np.asarray(self._logprobs, dtype=np.float32),
                    versions=np.asarray(self._versions, dtype=np.int32),
                    trajectory_id=self.trajectory_id,
                    turn_index=-1,
                )
            ]
        return self.samples


def action_segments(sample: Sample) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """The actions written into ``sample``, in order: (ids, logprobs, version) of each maximal
    run of loss-mask-1 tokens."""
    mask = sample.loss_mask.astype(bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [(sample.token_ids[a:b], sample.logprobs[a:b], int(sample.versions[a])) for a, b in zip(edges[::2], edges[1::2])]


def rerender(trajectory, observations: list[str], chat: ChatFormat, cfg: RolloutConfig, spec: PromptSpec,
             marker_ids: tuple[int, ...]) -> list[Sample] | None:
    """The samples ``trajectory`` would have had with ``observations`` (one per turn) in place
    of the ones it was shown: same action ids, sampling logprobs and versions, contexts written
    afresh (e.g. a guided episode with its hints stripped), cut to the budget as the engine
    would. None when a context does not fit at all."""
    actions: list[tuple[np.ndarray, np.ndarray, int]] = []
    for x in sorted(trajectory.samples, key=lambda x: x.turn_index):
        segs = action_segments(x)
        actions.extend(segs if x.turn_index < 0 else segs[-1:])
    if len(actions) != len(observations):
        return None
    ctx = EpisodeContext(chat, cfg, spec, marker_ids, trajectory.trajectory_id)
    for obs, (ids, logprobs, version) in zip(observations, actions):
        try:
            ctx.observe(obs)
        except ContextOverflow:
            return None
        sampled = version >= 0
        ctx.act(tuple(int(i) for i in ids), tuple(float(v) for v in logprobs) if sampled else None, version)
    return ctx.finish()
