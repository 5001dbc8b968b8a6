"""Token bookkeeping of one episode under a context policy and explicit budgets.

Four context policies (``rollout.context``), one class each in ``CONTEXTS`` (``ContextPolicy``):

- ``full_history``: one growing sequence per episode (system, obs 1, action 1, obs 2,
  ...); the whole episode is one training sample.
- ``window``: each turn's prompt is the system prompt, the last ``history_window`` turns
  and the current observation; each turn is one training sample.
- ``summarize`` (SUPO, ReSum): a growing sequence, as ``full_history``, until the next
  observation would take it past ``rollout.summary_threshold`` tokens. Then the observation
  is held back, a user message asks for a summary (``rollout.summary_prompt``), and the
  policy writes one (its own sampled tokens; the expert's ``expert_summary`` text in
  demonstrations). That context, summary included, is one training sample (a *segment*),
  and the next segment starts from the system prompt and one user message: the first
  observation (the task; not with ``rollout.summary_keep_first=false``), the summary's ids
  copied (context there: loss mask 0, never re-tokenized) and the held-back observation. Each segment's prompt ids are exactly those
  the sampler saw; the trainer gives every segment its trajectory's advantages
  (``turnforge.train.credit``). At most ``rollout.max_summaries`` summaries per episode
  (``SummaryLimit``). Departures: ReSum's summaries come from a separate summary model, here
  the policy writes them (as in SUPO); by default the restarted context keeps the first
  observation (ReSum's query), not only the summary.

- ``fold`` (Context-Folding, FoldGRPO): a growing main context, as ``full_history``, in which the
  policy may open a sub-context with the meta-action ``branch(goal)`` and close it with
  ``return(message)`` (``FOLD_INSTRUCTIONS`` in the system prompt say how; the engine intercepts
  both: neither reaches the env). A branch starts from the system prompt, the first observation,
  the goal and the latest observation, and plays env turns in its own growing context; at
  ``return`` it is closed as its own sample and the main context goes on from the ``branch`` call
  with the message and the latest observation (copied: context there, never re-tokenized): the
  branch's turns are folded away. One sample per context: the main one is segment 0, each branch
  a segment whose parent is 0; every run of action tokens knows its env turn (``Sample.run_turns``)
  so step-level advantages land on the right tokens; trajectory-level ones broadcast. One level of
  branching (a ``branch`` inside a branch, or a ``return`` outside one, goes to the env as text), at
  most ``rollout.max_branches`` per episode. Departure: FoldGRPO's process rewards for
  in-scope/out-of-scope actions are not computed.

Reasoning templates (``turnforge.policy.thinking``): what later prompts show of an action follows
``rollout.history`` (``turnforge.rollout.history``): every sampled token (``as_sampled``), or the
template's rendering without earlier thinking (``as_rendered``: in ``full_history`` mode each turn
is then its own sample, ``turn_index`` set, as in ``window`` mode). An action may hold ids the engine
wrote (``act(forced=...)``: a thinking closed at ``rollout.thinking_budget``): context, loss mask 0,
so the action is two runs of action tokens, and a several-turn sample records ``run_turns``.

Episodic memory (``turnforge.rollout.episodic``): ``EpisodeContext.memory`` ids open the first
user message of every prompt of the episode (every window, every segment), as context.

Images (vision policies, ``turnforge.policy.vision``): an observation's images are written before
its text as the blocks the model's processor expands them into (context, loss mask 0); the
images of a prompt, in the order of their blocks, go with it to the sampler and with each sample
to the trainer (``Sample.images``). A window that drops a turn drops its images; the budget cuts
an observation's text, never an image block. ``summarize`` does not take images.

Invariants: the policy's generated ids are stored as sampled (never re-tokenized);
template, observation and marker tokens are context (loss mask 0). An observation that
would overflow ``max_context_tokens`` (prompt + ``max_new_tokens``) is cut by tokens
and gets a visible marker; in window mode older history turns are dropped first. Both
are counted. If not even an empty observation fits, the episode ends with truncation
reason ``context_budget``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from turnforge.config import RolloutConfig
from turnforge.envs.tool.formats import tool_format
from turnforge.errors import UserError
from turnforge.policy.model import ChatFormat
from turnforge.rollout.history import HISTORIES
from turnforge.types import Sample

#: What ``rollout.context=fold`` adds to the system prompt.
FOLD_INSTRUCTIONS = (
    "You may fold work away: answer branch(<goal>) to open a sub-task with a fresh context (the task, the goal and "
    "the latest observation), act in it, then answer return(<what you found>) to close it; the main context then "
    "shows only the goal and what you returned. One sub-task at a time."
)
_META = re.compile(r"^\s*(branch|return)\((.*)\)\s*$")


def fold_meta(text: str) -> tuple[str, str] | None:
    """``("branch", goal)`` or ``("return", message)`` when the first line of ``text`` is a fold
    meta-action, else None."""
    first = text.strip().split("\n", 1)[0] if text.strip() else ""
    found = _META.match(first)
    return (found.group(1), found.group(2).strip()) if found else None


class ContextOverflow(Exception):
    """Not even an empty observation fits the context budget."""


class SummaryLimit(Exception):
    """``summarize``: the episode needs more than ``rollout.max_summaries`` summaries."""


@dataclass
class _Action:
    ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None  # None: not sampled (expert demonstration)
    version: int
    close: tuple[int, ...]  # template ids after the action (e.g. "\n" after <|im_end|>)
    shown: tuple[int, ...] = ()  # what later prompts show of it, close included (``rollout.history``)
    retract: int = 0  # ids of the generation prompt's end that later prompts leave out before ``shown`` (see ``act``)


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
    the call syntax of format ``fmt`` (``turnforge.envs.tool.formats.TOOL_FORMATS``: Hermes-style,
    the format of most tool-trained templates, by default), for templates that cannot render tools."""
    return tool_format(fmt).schema_text(tools)


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
    # window mode: per turn (observation content ids, action, the observation's images)
    _turns: list[tuple[tuple[int, ...], _Action, tuple[bytes, ...]]] = field(default_factory=list)
    _obs_ids: tuple[int, ...] = ()
    _obs_images: tuple[bytes, ...] = ()
    _prompt: tuple[int, ...] = ()
    _prompt_images: tuple[bytes, ...] = ()
    _images: list[bytes] = field(default_factory=list)  # full-history buffers: the images of their blocks, in order
    #: the processor side of a vision policy (``turnforge.policy.vision.Vision``); None: text only
    vision: object | None = None
    samples: list[Sample] = field(default_factory=list)
    history_dropped: int = 0  # window turns dropped to fit the budget
    # summarize: the current segment lives in the full-history buffers
    summary_due: bool = False  # the prompt asks for a summary: ``summarize`` must come before ``act``
    summaries: int = 0  # summaries written so far
    _first_obs: tuple[int, ...] = ()  # the first observation's ids, atop every segment
    _held: tuple[int, ...] = ()  # the observation held back while a summary is written
    _actions: int = 0  # actions recorded so far (the episode's turn count)
    _segment_first_turn: int = 0
    #: episodic memory (``turnforge.rollout.episodic``): ids at the start of the first user message of every prompt
    memory: tuple[int, ...] = ()
    # fold: the current context's action runs' turns; the main context's buffers while a branch runs
    _runs: list[int] = field(default_factory=list)
    _main: tuple | None = None
    _last_obs: tuple[int, ...] = ()
    _branch_first_turn: int = 0
    branches: int = 0  # branches opened so far
    _branch_samples: list[Sample] = field(default_factory=list)
    _split_runs: bool = False  # an action of several runs (a forced thinking close): samples record run_turns
    policy: ContextPolicy = field(init=False)  # rollout.context's (CONTEXTS)
    history: Any = field(init=False)  # rollout.history's (turnforge.rollout.history.HISTORIES)

    def __post_init__(self) -> None:
        self.policy = CONTEXTS[self.cfg.context]
        self.history = HISTORIES[self.cfg.history]

    @property
    def in_branch(self) -> bool:
        """fold: a branch's context is the current one."""
        return self._main is not None

    # ------------------------------------------------------------ observations
    def observe(self, observation: str, images: tuple[bytes, ...] = ()) -> int:
        """Add the next observation (and the images shown with it); returns how many of its text
        tokens were cut (0 = none). Raises ``ContextOverflow`` if the prompt cannot fit at all."""
        if self.summary_due:
            raise RuntimeError("observe() while a summary is due: call summarize() first")
        content = self.chat.encode(observation)
        blocks: tuple[int, ...] = ()
        if images:
            if self.vision is None:
                raise ValueError("an observation with images needs a vision policy")
            if not self.policy.takes_images:
                raise ValueError(f"rollout.context={self.policy.name} does not take observations with images")
            blocks = tuple(i for png in images for i in self.vision.block(png))  # type: ignore[attr-defined]
        return self.policy.observe(self, content, blocks, images)

    def _fit(self, content: tuple[int, ...], fixed: int) -> tuple[tuple[int, ...], int]:
        room = self.cfg.max_context_tokens - self.cfg.max_new_tokens - fixed
        if len(content) <= room:
            return content, 0
        keep = room - len(self.marker_ids)
        if keep < 0:
            raise ContextOverflow
        return content[:keep] + self.marker_ids, len(content) - keep

    def append_observation(self, content: tuple[int, ...], blocks: tuple[int, ...] = (), images: tuple[bytes, ...] = ()
                      ) -> tuple[int, tuple[int, ...]]:
        """Append an observation message (its image blocks, then its text); (tokens cut, the text as written)."""
        memory: tuple[int, ...] = ()
        if not self._ids:
            head, tail = self.chat.start(self.spec.system, self.spec.tools, self.spec.examples, self.spec.observation_role)
            memory = self.memory
        else:
            head, tail = self.chat.turn(self.spec.observation_role)
        content, cut = self._fit(content, len(self._ids) + len(head) + len(memory) + len(blocks) + len(tail))
        self._context(head + memory + blocks + content + tail)
        self._images.extend(images)
        return cut, content

    def _context(self, ids: tuple[int, ...]) -> None:
        self._ids.extend(ids)
        self._mask.extend([0] * len(ids))
        self._logprobs.extend([float("nan")] * len(ids))
        self._versions.extend([-1] * len(ids))

    def summarize(self, ids: tuple[int, ...], logprobs: tuple[float, ...] | None, version: int) -> int:
        """``summarize``: record the summary the prompt asked for (``Summarize.summarize``)."""
        if not isinstance(self.policy, Summarize) or not self.summary_due:
            raise RuntimeError("summarize() without a summary due")
        return self.policy.summarize(self, ids, logprobs, version)

    def _segment(self, summary_tokens: int = 0) -> Sample:
        k = len(self.samples)
        return self._buffer_sample(segment_index=k, parent_segment=k - 1, first_turn=self._segment_first_turn,
                                   summary_tokens=summary_tokens, images=tuple(self._images))

    def _buffer_sample(self, **fields: Any) -> Sample:
        """The buffers (ids, loss mask, logprobs, versions) as one sample spanning several turns,
        with the memory block's span; ``fields`` are the rest of the ``Sample``'s fields."""
        return Sample(
            token_ids=np.asarray(self._ids, dtype=np.int64),
            loss_mask=np.asarray(self._mask, dtype=np.int8),
            logprobs=np.asarray(self._logprobs, dtype=np.float32),
            versions=np.asarray(self._versions, dtype=np.int32),
            trajectory_id=self.trajectory_id,
            turn_index=-1,
            **fields,
            **self._memory_span(),
        )

    def _memory_span(self) -> dict[str, int]:
        """``Sample.memory_start`` / ``memory_tokens``: the block follows the opening of the first
        user message in every prompt (window, full history, each segment)."""
        if not self.memory:
            return {}
        head, _ = self.chat.start(self.spec.system, self.spec.tools, self.spec.examples, self.spec.observation_role)
        return {"memory_start": len(head), "memory_tokens": len(self.memory)}

    # ------------------------------------------------------------ prompts and actions
    def prompt(self) -> tuple[int, ...]:
        """Ids the policy conditions on for the next action."""
        return self._prompt if self.policy.one_sample_per_turn else tuple(self._ids)

    def prompt_images(self) -> tuple[bytes, ...]:
        """The images whose blocks ``prompt()`` holds, in order."""
        return self._prompt_images if self.policy.one_sample_per_turn else tuple(self._images)

    def act(self, ids: tuple[int, ...], logprobs: tuple[float, ...] | None, version: int, meta: bool = False,
            forced: tuple[int, int] = (0, 0)) -> None:
        """Record the action ids (exactly as generated) and the template's closing ids. ``meta``:
        a fold meta-action (``branch``/``return``): no env turn (``branch()``/``fold_return()`` follow).
        ``forced``: the span [a, b) of ``ids`` written, not sampled (the close of a thinking cut at
        ``rollout.thinking_budget``): context, loss mask 0. Later prompts show the action as
        ``rollout.history`` says (``turnforge.rollout.history``)."""
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} action ids but {len(logprobs)} logprobs")
        if self.summary_due:
            raise RuntimeError("act() while a summary is due: call summarize() first")
        mask = np.ones(len(ids), np.int8)
        mask[forced[0]:forced[1]] = 0
        runs = int(np.count_nonzero(np.diff(np.concatenate([[0], mask, [0]])) == 1))
        self._runs.extend([self._actions] * runs)  # the env turn these runs act in (a meta-action: the turn it precedes)
        self._split_runs = self._split_runs or runs > 1
        if not meta:
            self._actions += 1
        history = self.history
        shown = history.shown(ids, self.chat, self.spec.observation_role)
        # The closing text minus what the ids already hold (e.g. a sampled <|im_end|>): decode
        # with special tokens kept so a sampled stop token is seen.
        close = self.chat.close_after(self.chat.tokenizer.decode(ids, skip_special_tokens=False))
        shown_close = close if shown == ids else self.chat.close_after(self.chat.tokenizer.decode(shown, skip_special_tokens=False))
        # a template whose generation prompt opens thinking renders an earlier answer whose thinking it
        # dropped right after the assistant header: the prompt's opening of the thinking goes too
        retract = len(self.chat.opened_ids) if shown != ids else 0
        action = _Action(ids, logprobs, version, close, shown + shown_close, retract)
        lp = np.asarray(logprobs if logprobs is not None else [float("nan")] * len(ids), dtype=np.float32)
        lp[mask == 0] = float("nan")
        ver = np.where(mask == 1, version if logprobs is not None else -1, -1).astype(np.int32)
        if not self.policy.one_sample_per_turn and not history.per_turn:
            self._ids.extend(ids)
            self._mask.extend(mask.tolist())
            self._logprobs.extend(lp.tolist())
            self._versions.extend(ver.tolist())
            self._context(action.close)
            return
        prompt = self.prompt()
        n = len(prompt)
        self.samples.append(
            Sample(
                token_ids=np.asarray(prompt + ids, dtype=np.int64),
                loss_mask=np.concatenate([np.zeros(n, np.int8), mask]),
                logprobs=np.concatenate([np.full(n, np.nan, np.float32), lp]),
                versions=np.concatenate([np.full(n, -1, np.int32), ver]),
                trajectory_id=self.trajectory_id,
                turn_index=self._actions - 1,
                images=self.prompt_images(),
                **self._memory_span(),
            )
        )
        if self.policy.one_sample_per_turn:
            self._turns.append((self._obs_ids, action, self._obs_images))
        else:  # as_rendered on a growing context: the next prompt shows the action as the template renders it
            for part in (self._ids, self._mask, self._logprobs, self._versions):
                del part[len(part) - action.retract:]
            self._context(action.shown)

    # ------------------------------------------------------------ fold
    def branch(self, goal: str) -> int:
        """``fold``: open a branch after ``act(..., meta=True)`` recorded a ``branch(goal)`` call (``Fold.branch``)."""
        if not isinstance(self.policy, Fold) or self.in_branch:
            raise RuntimeError("branch() needs rollout.context=fold and no open branch")
        return self.policy.branch(self, goal)

    def fold_return(self, message: str) -> int:
        """``fold``: close the open branch after ``act(..., meta=True)`` recorded a ``return(message)`` call."""
        if not isinstance(self.policy, Fold) or not self.in_branch:
            raise RuntimeError("fold_return() without an open branch")
        return self.policy.fold_return(self, message)

    def finish(self) -> list[Sample]:
        """All samples of the episode (call once, after the last action)."""
        return self.policy.finish(self)


# ---------------------------------------------------------------- context policies
class ContextPolicy:
    """One ``rollout.context`` policy: how an episode's observations and actions become prompts and
    samples. ``EpisodeContext`` holds the buffers and asks its policy; the engine, the config rules
    and the viewer ask the policy's declarations instead of comparing names:

    - ``sample``: what one training sample holds (a turn, the episode, a segment, a context);
    - ``one_sample_per_turn``: each turn is its own prompt and sample (no growing context);
    - ``renders_history``: ``rollout.history=as_rendered`` and ``rollout.thinking_budget`` apply;
    - ``takes_images``: observations may carry images (vision policies);
    - ``values_per_turn``: samples are single turns or whole episodes, so a learned critic reads them;
    - ``system_note``: text the system prompt gets (explaining meta-actions), or None;
    - ``writes_summaries``: the policy writes summaries (``summarize``, ``EpisodeContext.summarize``);
    - ``meta_actions``: the policy's ``branch``/``return`` calls switch contexts (``fold``);
    - ``conflict(cfg)``: its own cross-key rules; ``env_conflict(cfg, env)``: what it needs of the
      env (checked at start); one line each, or None;
    - ``observe(ctx, content, blocks, images)`` and ``finish(ctx)``: its part of the bookkeeping.

    Adding one is one class here, registered in ``CONTEXTS``, plus its test (docs/guide.md).
    """

    name: ClassVar[str]
    help: ClassVar[str]
    sample: ClassVar[str]
    one_sample_per_turn: ClassVar[bool] = False
    renders_history: ClassVar[bool] = False
    takes_images: ClassVar[bool] = True
    values_per_turn: ClassVar[bool] = True
    system_note: ClassVar[str | None] = None
    writes_summaries: ClassVar[bool] = False
    meta_actions: ClassVar[bool] = False

    def conflict(self, cfg: Any) -> str | None:
        return None

    def env_conflict(self, cfg: Any, env: Any) -> str | None:
        return None

    def observe(self, ctx: EpisodeContext, content: tuple[int, ...], blocks: tuple[int, ...] = (),
                images: tuple[bytes, ...] = ()) -> int:
        """Write the observation (``content``: its text ids; ``blocks``: its images' ids); the text tokens cut."""
        return ctx.append_observation(content, blocks, images)[0]

    def finish(self, ctx: EpisodeContext) -> list[Sample]:
        """The episode's samples."""
        if not ctx.history.per_turn and any(ctx._mask):
            ctx.samples = [ctx._buffer_sample(images=tuple(ctx._images), run_turns=tuple(ctx._runs) if ctx._split_runs else ())]
        return ctx.samples


class FullHistory(ContextPolicy):
    """One growing sequence per episode (system, obs 1, action 1, obs 2, ...); the whole episode is
    one sample (one per turn under ``rollout.history=as_rendered``)."""

    name, help, sample = "full_history", "one sample per episode", "episode"
    renders_history = True


class Window(ContextPolicy):
    """Each turn's prompt is the system prompt, the last ``rollout.history_window`` turns and the
    current observation; each turn is one sample. Older turns are dropped first to fit the budget."""

    name, help, sample = "window", "one sample per turn, prompt = last turns", "turn"
    one_sample_per_turn = True
    renders_history = True

    def env_conflict(self, cfg, env):
        if env.observation_role != "user" and cfg.rollout.history_window == 0:
            return (f"env {env.env_id!r} answers with {env.observation_role} messages, so with rollout.context=window and "
                    "rollout.history_window=0 the policy would never see the task again; use rollout.context=full_history "
                    "or rollout.history_window >= 1")
        return None

    def prompt_ids(self, ctx: EpisodeContext, turns, content: tuple[int, ...]) -> tuple[int, ...]:
        """The window's first observation goes in the first user message (a tool result as
        first message would be an orphan), later ones in messages of the observation role."""
        head, tail = ctx.chat.start(ctx.spec.system, ctx.spec.tools, ctx.spec.examples, ctx.spec.observation_role)
        later_head, later_tail = ctx.chat.turn(ctx.spec.observation_role)
        out: list[int] = list(head) + list(ctx.memory)
        for i, (obs, act, _) in enumerate(turns):
            if i > 0:
                out.extend(later_head)
            out.extend(obs)
            out.extend(tail if i == 0 else later_tail)
            del out[len(out) - act.retract:]
            out.extend(act.shown)
        out.extend(later_head if turns else ())
        out.extend(content)
        out.extend(tail if not turns else later_tail)
        return tuple(out)

    def observe(self, ctx: EpisodeContext, content, blocks=(), images=()) -> int:
        k = ctx.cfg.history_window
        turns = ctx._turns[-k:] if k > 0 else []
        while True:
            fixed = len(self.prompt_ids(ctx, turns, blocks))
            room = ctx.cfg.max_context_tokens - ctx.cfg.max_new_tokens - fixed
            if len(content) <= room or not turns:
                break
            turns = turns[1:]
            ctx.history_dropped += 1
        content, cut = ctx._fit(content, fixed)
        ctx._obs_ids, ctx._obs_images = blocks + content, images
        ctx._prompt = self.prompt_ids(ctx, turns, ctx._obs_ids)
        ctx._prompt_images = tuple(png for t in turns for png in t[2]) + images
        return cut

    def finish(self, ctx: EpisodeContext) -> list[Sample]:
        return ctx.samples


class Summarize(ContextPolicy):
    """SUPO / ReSum: a growing context that, past ``rollout.summary_threshold`` tokens, the policy
    summarizes; it restarts from the task, the summary and the latest observation. One sample per
    segment (see the module docstring)."""

    name, sample = "summarize", "segment"
    help = ("a growing context that, past rollout.summary_threshold tokens, the policy summarizes and that restarts "
            "from the task, its summary and the latest observation: one sample per segment")
    takes_images = False
    values_per_turn = False
    writes_summaries = True

    def conflict(self, cfg):
        r = cfg.rollout
        if r.summary_at + r.summary_max_tokens > r.max_context_tokens:
            return (f"rollout.summary_threshold={r.summary_at} plus rollout.summary_max_tokens={r.summary_max_tokens} is "
                    f"above rollout.max_context_tokens={r.max_context_tokens}: a summary would not fit; set "
                    f"rollout.summary_threshold to at most {r.max_context_tokens - r.summary_max_tokens} (less the summary "
                    "request's tokens)")
        return None

    def observe(self, ctx: EpisodeContext, content, blocks=(), images=()) -> int:
        if not ctx._ids:
            cut, ctx._first_obs = ctx.append_observation(content)
            return cut
        head, tail = ctx.chat.turn(ctx.spec.observation_role)
        grown = len(ctx._ids) + len(head) + len(content) + len(tail) + ctx.cfg.max_new_tokens
        if grown <= ctx.cfg.summary_at or ctx._actions == ctx._segment_first_turn:
            return ctx.append_observation(content)[0]  # fits, or a fresh segment: no summary of nothing
        if ctx.summaries >= ctx.cfg.max_summaries:
            raise SummaryLimit
        ask = summary_request(ctx.chat, ctx.cfg)
        if len(ctx._ids) + len(ask) + ctx.cfg.summary_max_tokens > ctx.cfg.max_context_tokens:
            raise ContextOverflow
        ctx._context(ask)
        ctx._held, ctx.summary_due = content, True
        return 0

    def summarize(self, ctx: EpisodeContext, ids: tuple[int, ...], logprobs: tuple[float, ...] | None, version: int) -> int:
        """Record the summary (ids exactly as generated; ``logprobs`` None for a written one),
        close the segment as a sample and start the next from the system prompt, the first
        observation, the summary and the held-back observation. Returns the tokens cut from
        that observation; raises ``ContextOverflow`` when the new segment cannot fit."""
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} summary ids but {len(logprobs)} logprobs")
        train = ctx.cfg.summary_loss == "train"
        sampled = logprobs is not None and train
        ctx._ids.extend(ids)
        ctx._mask.extend([int(train)] * len(ids))
        ctx._logprobs.extend(list(logprobs) if sampled else [float("nan")] * len(ids))  # type: ignore[arg-type]
        ctx._versions.extend([version if sampled else -1] * len(ids))
        ctx.samples.append(ctx._segment(summary_tokens=len(ids)))
        ctx.summaries += 1
        ctx.summary_due = False
        body = list(ids)
        special = set(ctx.chat.tokenizer.all_special_ids)
        while body and body[-1] in special:  # a sampled stop token ends the summary, not the message
            body.pop()
        ctx._ids, ctx._mask, ctx._logprobs, ctx._versions = [], [], [], []
        ctx._segment_first_turn = ctx._actions
        first = ctx._first_obs + ctx.chat.encode("\n\n") if ctx.cfg.summary_keep_first else ()
        content = (ctx.memory + first + ctx.chat.encode("Your summary so far:\n") + tuple(body)
                   + ctx.chat.encode("\n\nNow:\n") + ctx._held)
        head, tail = ctx.chat.start(ctx.spec.system, ctx.spec.tools, ctx.spec.examples, ctx.spec.observation_role)
        fixed = len(head) + len(tail) + len(content) - len(ctx._held)
        held, cut = ctx._fit(ctx._held, fixed)
        ctx._context(head + content[: len(content) - len(ctx._held)] + held + tail)
        ctx._held = ()
        return cut

    def finish(self, ctx: EpisodeContext) -> list[Sample]:
        if ctx._actions > ctx._segment_first_turn:  # the last segment, when it holds an action
            ctx.samples.append(ctx._segment())
            ctx._segment_first_turn = ctx._actions
        return ctx.samples


class Fold(ContextPolicy):
    """Context-Folding (FoldGRPO): a growing main context in which the policy opens sub-contexts with
    ``branch(goal)`` and folds them with ``return(message)``; one sample per context."""

    name, sample = "fold", "context"
    help = ("a growing context in which the policy opens sub-contexts with branch(goal) and folds them with "
            "return(message): one sample per context")
    values_per_turn = False
    system_note = FOLD_INSTRUCTIONS
    meta_actions = True

    def conflict(self, cfg):
        if not cfg.rollout.include_instructions:
            return ("rollout.context=fold explains branch(goal) and return(message) in the system prompt; set "
                    "rollout.include_instructions=true")
        return None

    def env_conflict(self, cfg, env):
        if env.tools:
            return (f"env {env.env_id!r} takes tool calls, so branch(goal) and return(message) cannot be told from its "
                    "actions; rollout.context=fold needs an env with text actions (use rollout.context=summarize)")
        return None

    def observe(self, ctx, content, blocks=(), images=()):
        first = not ctx._ids and not ctx.in_branch
        cut, ctx._last_obs = ctx.append_observation(content)
        if first:
            ctx._first_obs = ctx._last_obs
        return cut

    def branch(self, ctx: EpisodeContext, goal: str) -> int:
        """After ``act(..., meta=True)`` recorded a ``branch(goal)`` call in the main context,
        open the branch's context: the system prompt, the first observation, the goal and the latest
        observation. Returns the tokens cut from that observation; ``ContextOverflow`` when it cannot fit."""
        ctx._main = (ctx._ids, ctx._mask, ctx._logprobs, ctx._versions, ctx._runs)
        ctx._ids, ctx._mask, ctx._logprobs, ctx._versions, ctx._runs = [], [], [], [], []
        ctx.branches += 1
        ctx._branch_first_turn = ctx._actions
        head, tail = ctx.chat.start(ctx.spec.system, ctx.spec.tools, ctx.spec.examples, ctx.spec.observation_role)
        lead = ctx.memory + ctx._first_obs + ctx.chat.encode(f"\n\nSub-task: {goal}\n\nNow:\n")
        last, cut = ctx._fit(ctx._last_obs, len(head) + len(lead) + len(tail))
        ctx._context(head + lead + last + tail)
        return cut

    def fold_return(self, ctx: EpisodeContext, message: str) -> int:
        """After ``act(..., meta=True)`` recorded a ``return(message)`` call in the branch, close
        the branch as a sample and go on in the main context with the message and the latest
        observation. Returns the tokens cut from that observation; ``ContextOverflow`` when it cannot fit."""
        self._close_branch(ctx)
        head, tail = ctx.chat.turn(ctx.spec.observation_role)
        lead = ctx.chat.encode(f"Sub-task returned: {message}\n\nNow:\n")
        last, cut = ctx._fit(ctx._last_obs, len(ctx._ids) + len(head) + len(lead) + len(tail))
        ctx._context(head + lead + last + tail)
        return cut

    def _close_branch(self, ctx: EpisodeContext) -> None:
        """The branch's context as a sample (segment 1, 2, ... with parent 0); the main context's buffers back."""
        assert ctx._main is not None
        if any(ctx._mask):
            ctx._branch_samples.append(self._fold_sample(ctx, len(ctx._branch_samples) + 1, 0, ctx._branch_first_turn))
        ctx._ids, ctx._mask, ctx._logprobs, ctx._versions, ctx._runs = ctx._main
        ctx._main = None

    def _fold_sample(self, ctx: EpisodeContext, index: int, parent: int, first_turn: int) -> Sample:
        return ctx._buffer_sample(segment_index=index, parent_segment=parent, first_turn=first_turn,
                                   run_turns=tuple(ctx._runs))

    def finish(self, ctx: EpisodeContext) -> list[Sample]:
        if ctx.in_branch:  # the episode ended inside a branch
            self._close_branch(ctx)
        if any(ctx._mask):
            ctx.samples = [self._fold_sample(ctx, 0, -1, 0), *ctx._branch_samples]
        return ctx.samples


#: Every context policy by its ``rollout.context`` name.
CONTEXTS: dict[str, ContextPolicy] = {cls.name: cls() for cls in (Window, FullHistory, Summarize, Fold)}


def summary_request(chat: ChatFormat, cfg: RolloutConfig) -> tuple[int, ...]:
    """The ids of the user message that asks for a summary (``rollout.summary_prompt``)."""
    head, tail = chat.turn("user")
    return head + chat.encode(cfg.summary_prompt) + tail


def check_summary_budget(chat: ChatFormat, cfg: RolloutConfig) -> None:
    """``summarize``: raise ``UserError`` unless a segment at the threshold, the summary request
    and a whole summary fit ``rollout.max_context_tokens`` in this model's tokens."""
    if not isinstance(CONTEXTS[cfg.context], Summarize):
        return
    ask = len(summary_request(chat, cfg))
    need = cfg.summary_at + ask + cfg.summary_max_tokens
    if need > cfg.max_context_tokens:
        raise UserError(
            f"rollout.summary_threshold={cfg.summary_at}: a segment at the threshold, the summary request ({ask} tokens "
            f"of rollout.summary_prompt in this model's template) and rollout.summary_max_tokens={cfg.summary_max_tokens} "
            f"need {need} tokens, above rollout.max_context_tokens={cfg.max_context_tokens}; set rollout.summary_threshold "
            f"to at most {cfg.max_context_tokens - ask - cfg.summary_max_tokens} or shorten rollout.summary_prompt"
        )


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
    if any(x.summary_tokens or x.images or x.run_turns for x in trajectory.samples):
        return None  # its summaries were written for the contexts it was shown; images are not re-rendered
    actions: list[tuple[np.ndarray, np.ndarray, int]] = []
    for x in sorted(trajectory.samples, key=lambda x: x.turn_index):
        segs = action_segments(x)
        if x.turn_index >= 0 and len(segs) > 1:
            return None  # a thinking closed at the budget: its forced close is not re-rendered
        actions.extend(segs)
    if len(actions) != len(observations):
        return None
    ctx = EpisodeContext(chat, cfg, spec, marker_ids, trajectory.trajectory_id)
    for obs, (ids, logprobs, version) in zip(observations, actions):
        try:
            ctx.observe(obs)
        except (ContextOverflow, SummaryLimit):
            return None
        if ctx.summary_due:  # the summaries were written for the contexts shown; not re-rendered
            return None
        sampled = version >= 0
        ctx.act(tuple(int(i) for i in ids), tuple(float(v) for v in logprobs) if sampled else None, version)
    return ctx.finish()
