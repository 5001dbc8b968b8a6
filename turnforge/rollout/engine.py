"""The rollout engine: every episode in turnforge is played here.

Two entry points over one core:

- ``RolloutEngine.play(requests, actor)``: play a list of episode requests (optionally from
  env snapshots, optionally keeping a snapshot before every action) and return when all are
  done. Evaluation, demonstrations, value pretraining and Monte-Carlo rollouts use it.
- ``GroupStream`` (``turnforge.rollout.groups``): hand the trainer whole groups of G episodes,
  lock-step or from a background rollout thread with bounded staleness. RL uses it. It drives
  the engine through its public episode API: ``launch``, ``round``, ``trajectory``,
  ``abandon``, ``free_envs``, ``running`` and ``lock``.

The core: each episode is a small state machine, *awaiting an env result* or *awaiting an
action*, on one env slot of an env backend (``turnforge.envpool``: this process, worker
processes or Ray actors; the same ``EnvHost`` answers in each). A scheduling round collects
env results (observations go into the episode's token context, ``EpisodeContext``), asks
each actor for the actions of the episodes that await one, in one batched call per actor,
and sends those actions to the backend at once. A finished episode frees its slot at once.

Determinism: in lock-step rounds the engine acts only when no env request is in flight,
on all waiting episodes in admission order, so a policy's batches, and with them every
sampled token, are the same on every backend and for any worker timing. ``play`` admits
requests in waves of the backend's size (``backend.num_envs``), each played to the end.

Budgets: an episode ends at its turn budget (``max_turns``, ``truncation_reason='max_turns'``),
when nothing more fits the context (``'context_budget'``), when a ``summarize`` context needs
more than ``rollout.max_summaries`` summaries (``'summary_limit'``) or when the env ends it.
A summary a ``summarize`` context asks for is one more batched actor call in the round,
before the actions (``ActorInput.summary``); it never reaches the env. Observations
cut to fit, history turns dropped and generations cut at ``max_new_tokens`` are counted
(``RolloutStats``). An env that raises ends its episode as an infrastructure failure
(``Trajectory.infra_failure``), never a reward of 0; the other episodes go on. A failed reset
or restore gives such a trajectory too, with no turns and no samples, so every request
returns one trajectory and every failure is counted (``turnforge.train.run_dir.failures``
decides whether a stage may go on).

Reasoning templates (``turnforge.policy.thinking``): the env gets the answer part of an action only
(after the last ``</think>``); with ``rollout.thinking_budget`` a turn is sampled in up to two calls
(``turnforge.rollout.budget``); thinking and answer tokens and the turns cut at the budget are counted.

Episodic memory (``engine.memory``, ``turnforge.rollout.episodic``): at an episode's first
observation the engine recalls the memory's most similar past successes and writes their block
into the episode's context (``EpisodeContext.memory``); the trainer adds to the memory between
rounds, never while episodes run.

``Engine`` is what the trainer asks of an engine; the gateway's ``AgentEngine``
(``turnforge.gateway.agents``: agent programs instead of envs) has the same shape.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

from turnforge.config import RolloutConfig, TrainConfig
from turnforge.dist import ranked_play, world
from turnforge.envpool import EnvBackend, InlineEnvs, PoolStats, make_backend
from turnforge.envpool.host import AfterState, EnvResult, Probe
from turnforge.envs.base import Env, capabilities, close_env
from turnforge.envs.registry import build_env
from turnforge.envs.tool.formats import TOOL_FORMATS
from turnforge.errors import UserError
from turnforge.policy.generate import Generation
from turnforge.policy.model import Policy
from turnforge.rollout.actors import Actor, ActorInput, PolicyActor
from turnforge.rollout.budget import NO_FORCE, think_then_answer
from turnforge.rollout.context import (
    CONTEXTS,
    ContextOverflow,
    EpisodeContext,
    PromptSpec,
    SummaryLimit,
    check_summary_budget,
    fold_meta,
)
from turnforge.rollout.episodic import EpisodicMemory
from turnforge.types import THINKING_MARKERS, EnvSnapshot, Task, Trajectory, Turn


@dataclass(frozen=True)
class EpisodeRequest:
    """One episode to play: which task, which env seed, which group.

    With ``start`` the env is restored to that snapshot (``env_seed`` is then only a label:
    the snapshot carries the env's RNG, unless ``reseed`` gives the env's dynamics a fresh
    seed) and the episode plays on from there; its context starts there, so the policy does
    not see the turns played before it. ``max_turns`` overrides ``RolloutConfig.max_turns``
    (e.g. the turns left of a budget). ``first_actions`` are played before the actor acts
    (written as demonstration tokens), e.g. the action whose value a Monte-Carlo estimate is for.
    """

    task: Task
    env_seed: int
    group_id: str
    trajectory_id: str
    start: EnvSnapshot | None = None
    max_turns: int | None = None
    reseed: int | None = None
    first_actions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"EpisodeRequest.max_turns must be >= 1 or None; got {self.max_turns}")
        if self.reseed is not None and self.start is None:
            raise ValueError("EpisodeRequest.reseed applies to episodes started from a snapshot (start=...)")


@dataclass(frozen=True)
class RolloutStats:
    """Counters of a set of episodes (budget events are counted, never silent)."""

    episodes: int
    turns: int
    obs_truncations: int  # observations cut by the context budget
    context_overflows: int  # episodes ended because nothing more fit
    generation_truncations: int  # turns that hit max_new_tokens before a stop token
    history_dropped: int  # window turns dropped to fit the budget
    infra_failures: int
    generated_tokens: int  # action tokens (sampled, or written for a text actor)
    summaries: int = 0  # summaries written (rollout.context=summarize)
    summary_tokens: int = 0  # their tokens
    summary_limits: int = 0  # episodes ended by rollout.max_summaries
    memory_recalls: int = 0  # episodes shown past successes (episodic memory)
    memory_tokens: int = 0  # their memory blocks' tokens, once per episode
    thinking_tokens: int = 0  # sampled tokens of generated actions before their answer (reasoning templates)
    answer_tokens: int = 0  # sampled tokens of generated actions from the answer on (all of them without thinking)
    thinking_cuts: int = 0  # turns whose thinking reached rollout.thinking_budget and was closed by the engine


@dataclass
class EngineStats:
    """Counters since the engine started."""

    admitted_episodes: int = 0
    finished_episodes: int = 0
    infra_failures: int = 0
    resumed_steps: int = 0
    turns: int = 0
    generated_tokens: int = 0
    generation_calls: int = 0
    generation_seconds: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)  # episodes per generation call (the last 200)


class EngineEnv(Protocol):
    """What every engine's ``env`` offers the trainer: an id and tasks by split and index (an
    ``Env`` for the rollout engine, ``AgentTasks`` for agent runs)."""

    env_id: str
    action_names: tuple[str, ...]

    def task(self, split: str, index: int) -> Task: ...


class Engine(Protocol):
    """What the training stages ask of an engine: ``RolloutEngine``, or the gateway's
    ``AgentEngine`` for agent programs. Stages that need env states (demonstrations, the
    flywheel, Monte-Carlo values, group streams) need a ``RolloutEngine``."""

    env: EngineEnv
    cfg: RolloutConfig

    def play(self, requests: Sequence[EpisodeRequest], actor: Actor, *, keep_snapshots: bool = False,
             on_wave: Callable[[int], None] | None = None,
             on_progress: Callable[[int], None] | None = None) -> tuple[list[Trajectory], RolloutStats]:
        """Play ``requests`` to the end with ``actor``: one trajectory per request, in order, and
        counters; ``on_progress(n)`` is told how many of them have finished, as they finish."""
        ...

    def pool_stats(self) -> PoolStats | None:
        """Counters of the env worker pool, or None when there is none."""
        ...

    def close(self) -> None: ...


@dataclass
class Episode:
    """One episode on the engine (``RolloutEngine.launch``). Callers read ``request``,
    ``done``, ``awaiting_action`` (its env has no request in flight) and ``min_version``;
    the engine alone writes them."""

    request: EpisodeRequest
    actor: Actor
    seq: int  # admission order: lock-step rounds act in this order; env workers step the oldest first
    slot: int  # env id in the backend
    ctx: EpisodeContext | None  # None when no token context is kept (text actors only)
    keep_snapshots: bool
    observation: str = ""
    after: AfterState = AfterState()  # read off the env in the state the next action is taken in
    turns: list[Turn] = field(default_factory=list)
    snapshots: list[EnvSnapshot] = field(default_factory=list)
    # the turn being played: (action text, generation hit max_new_tokens, observation tokens cut)
    pending: tuple[str, bool, int] | None = None
    cut: int = 0  # observation tokens cut from the current observation
    awaiting_action: bool = False
    ret: float = 0.0
    success: bool = False
    terminated: bool = False
    truncated: bool = False
    reason: str | None = None
    failure: str | None = None
    resumed_steps: int = 0
    min_version: int | None = None  # oldest policy version that sampled a token of it
    obs_truncations: int = 0
    generation_truncations: int = 0
    action_tokens: int = 0
    summary_tokens: int = 0
    meta_actions: int = 0  # fold: branch/return calls (no env step)
    thinking_tokens: int = 0
    answer_tokens: int = 0
    thinking_cuts: int = 0
    done: bool = False

    @property
    def max_turns(self) -> int:
        return self.request.max_turns or 0

    @property
    def turn(self) -> int:
        return len(self.turns)


class RolloutEngine:
    """One env backend, the rollout budgets and the token format; plays every episode.

    ``policy`` provides the tokenizer and chat template the token contexts are written in
    (``None``: the engine keeps no token contexts and only text actors may play). ``env`` is a
    local instance of the backend's env: its tasks (``env.task(split, i)``), capabilities and
    prompt (its instructions, tools and observation role) are read from it.
    """

    def __init__(self, backend: EnvBackend, cfg: RolloutConfig, policy: Policy | None, env: Env) -> None:
        self.backend, self.cfg, self.policy, self.env = backend, cfg, policy, env
        self.prompt = PromptSpec.of(env, cfg.include_instructions, cfg.example_turns, cfg.tools_in_system_prompt)
        self.context = CONTEXTS[cfg.context]
        note = self.context.system_note  # e.g. fold's meta-actions, explained in the system prompt
        if note is not None:
            self.prompt = replace(self.prompt, system=f"{self.prompt.system}\n\n{note}" if self.prompt.system else note)
        if policy is not None:
            check_summary_budget(policy.chat, cfg)
            if cfg.thinking_budget is not None and policy.chat.thinking is None:
                raise UserError(f"rollout.thinking_budget={cfg.thinking_budget} but the chat template of {policy.path!r} has no "
                                "thinking markers (<think>...</think>); set rollout.thinking_budget=null or use a reasoning model")
        #: The thinking markers of a reasoning template (``turnforge.policy.thinking``): actions are
        #: parsed from their answer part; None: no thinking
        self.thinking = policy.chat.thinking if policy is not None else None
        self.caps = capabilities(env)
        if self.caps.images and policy is not None and policy.vision is None:
            raise UserError(f"env {env.env_id!r} shows images in its observations but the model is text-only; use a "
                            "vision-language model (model.tiny.vision.enabled=true, or a local VLM directory)")
        self.marker = policy.chat.encode(cfg.truncation_marker) if policy is not None else ()
        #: Special tokens a decoded action keeps: the env's tool-call format's markers (Mistral's
        #: [TOOL_CALLS], Llama's <|python_tag|>), which the env must see; the other special tokens go
        fmt = TOOL_FORMATS.get(getattr(env, "tool_call_format", ""))
        keep = set() if policy is None or fmt is None else {
            i for i in (policy.tokenizer.convert_tokens_to_ids(m) for m in fmt.markers)
            if isinstance(i, int) and i != policy.tokenizer.unk_token_id}
        self._dropped = frozenset(set(policy.tokenizer.all_special_ids) - keep) if keep else None
        self._free_slots: list[int] = list(range(backend.num_envs))[::-1]
        self._by_slot: dict[int, Episode] = {}
        self.stats = EngineStats()
        self._seq = 0
        #: Episodic memory (``turnforge.rollout.episodic``): read at each reset of a token context; the
        #: trainer adds to it between rounds (None: no memory)
        self.memory: EpisodicMemory | None = None
        #: Guards the episode tables while a ``GroupStream`` drives the engine from a thread; its
        #: waiters are woken after every round that collected env results.
        self.lock = threading.Condition()

    @property
    def num_envs(self) -> int:
        return self.backend.num_envs

    @property
    def free_envs(self) -> int:
        """Env slots with no episode on them."""
        return len(self._free_slots)

    @property
    def running(self) -> int:
        """Episodes launched and not yet finished."""
        return len(self._by_slot)

    def pool_stats(self) -> PoolStats | None:
        """The env worker pool's counters (restarts, hangs); None when envs run in this process."""
        return None if isinstance(self.backend, InlineEnvs) else self.backend.stats()

    def abandon(self, e: Episode) -> None:
        """Free the env slot of running episode ``e`` without finishing it (a group restarted
        for staleness); ``e`` must have no env request in flight (``e.awaiting_action``)."""
        if e.done or not e.awaiting_action:
            raise RuntimeError(f"episode {e.request.trajectory_id!r} is finished or has an env request in flight")
        del self._by_slot[e.slot]
        self._free_slots.append(e.slot)

    # ------------------------------------------------------------------ entry point 1: play
    def play(self, requests: Sequence[EpisodeRequest], actor: Actor, *, keep_snapshots: bool = False,
             tokens: bool = True, on_wave: Callable[[int], None] | None = None,
             on_progress: Callable[[int], None] | None = None) -> tuple[list[Trajectory], RolloutStats]:
        """Play ``requests`` to the end with ``actor``, in waves of ``num_envs`` episodes;
        return their trajectories (in request order) and counters. With ``keep_snapshots``
        each trajectory records the env snapshot taken before each turn's action; with
        ``tokens=False`` no token context is kept, nor anchor keys and potentials (no samples;
        for text actors whose episodes are only scored, e.g. Monte-Carlo rollouts).
        ``on_wave(k)`` runs before wave ``k`` starts (e.g. to reseed the actor);
        ``on_progress(n)`` after every scheduling round, with the requests finished so far.

        On several trainer ranks (``turnforge.dist``) every rank calls it alike: each plays its
        share of the requests on its own envs (``ranked_play``: rank r plays r, r + ranks, ...) and
        every rank gets all the trajectories. The actor must then draw per episode (a
        ``PolicyActor`` with ``episode_seed``; the expert and random actors do), so an episode
        does not depend on the rank that plays it; waves (and ``on_wave``) are the rank's own."""
        if world().distributed and isinstance(actor, PolicyActor) and actor.episode_seed is None:
            raise RuntimeError("on several trainer ranks the policy must draw its noise per episode (PolicyActor's "
                               "episode_seed): a batch generator would make an episode depend on the rank that plays it")
        return ranked_play(lambda mine, progress: self._play(mine, actor, keep_snapshots, tokens, on_wave, progress),
                           requests, on_progress)

    def _play(self, requests: Sequence[EpisodeRequest], actor: Actor, keep_snapshots: bool, tokens: bool,
              on_wave: Callable[[int], None] | None,
              on_progress: Callable[[int], None] | None) -> tuple[list[Trajectory], RolloutStats]:
        if self._by_slot:
            raise RuntimeError("the rollout engine is busy (a group stream has episodes running)")
        trajectories: list[Trajectory] = []
        episodes: list[Episode] = []
        for k, lo in enumerate(range(0, len(requests), self.num_envs)):
            if on_wave is not None:
                on_wave(k)
            wave = [self.launch(req, actor, keep_snapshots, tokens=tokens) for req in requests[lo:lo + self.num_envs]]
            while self._by_slot:
                self.round(lockstep=True)
                if on_progress is not None:
                    on_progress(lo + sum(e.done for e in wave))
            episodes.extend(wave)
            trajectories.extend(self.trajectory(e) for e in wave)
        return trajectories, rollout_stats(episodes)

    # ------------------------------------------------------------------ the core
    def launch(self, req: EpisodeRequest, actor: Actor, keep_snapshots: bool = False, tokens: bool = True) -> Episode:
        """Start ``req`` on a free env slot (reset, or restore from its snapshot); ``round`` plays it.
        Needs a free slot (``free_envs > 0``)."""
        if actor.needs_tokens and (self.policy is None or not tokens):
            raise ValueError("this actor acts on token ids; the engine needs a policy's token format and tokens=True")
        if keep_snapshots:
            self.caps.require("snapshot", self.env.env_id, "keeping env snapshots")
        if req.start is not None:
            self.caps.require("snapshot", self.env.env_id, "starting an episode from a snapshot")
        if req.max_turns is None:
            req = replace(req, max_turns=self.cfg.max_turns)
        needs = actor.probe(req.task, req.trajectory_id, 0)  # what the actor reads off the env: check the env has it
        if needs.expert:
            self.caps.require("expert", self.env.env_id, f"{type(actor).__name__} (it plays the expert's moves)")
            if self.context.writes_summaries and tokens and self.policy is not None:
                self.caps.require("expert_summary", self.env.env_id,
                                  f"{type(actor).__name__} with rollout.context={self.context.name} (it writes the expert's "
                                  "summaries)")
        if needs.random_seed is not None:
            self.caps.require("random_action", self.env.env_id, f"{type(actor).__name__} (it plays random actions)")
        ctx = None
        if self.policy is not None and tokens:
            ctx = EpisodeContext(self.policy.chat, self.cfg, self.prompt, self.marker, req.trajectory_id,
                                 vision=self.policy.vision)
        slot = self._free_slots.pop()
        ep = Episode(req, actor, self._seq, slot, ctx, keep_snapshots)
        self._seq += 1
        self._by_slot[slot] = ep
        self.stats.admitted_episodes += 1
        probe = self._probe(ep, 0)
        if req.start is None:
            self.backend.send_reset([slot], [req.env_seed], [req.task], [probe], [ep.seq])
        else:
            self.backend.send_restore([slot], [req.start], [req.reseed], [probe], [ep.seq])
        return ep

    def _probe(self, ep: Episode, turn: int) -> Probe:
        """What the env host reads after the request that precedes action ``turn``."""
        if turn >= ep.max_turns:
            return Probe()  # no action follows: the turn budget ends the episode
        probe = Probe() if turn < len(ep.request.first_actions) else ep.actor.probe(ep.request.task, ep.request.trajectory_id, turn)
        summary = probe.expert and ep.ctx is not None and self.context.writes_summaries
        return Probe(probe.expert, probe.random_seed, ep.keep_snapshots, keys=ep.ctx is not None, summary=summary)

    def _on_result(self, r: EnvResult) -> None:
        ep = self._by_slot.get(r.env_id)
        if ep is None or ep.done:
            raise RuntimeError(f"env backend returned a result for env {r.env_id}, which runs no episode")
        req = ep.request
        if r.status == "failed":
            ep.failure = f"env {r.kind}() raised on {req.task.task_id} (seed {req.env_seed}): {r.error}"
            self._finish(ep)
            return
        ep.resumed_steps += r.status == "resumed"
        if r.kind == "step":
            text, gen_truncated, cut = ep.pending
            ep.turns.append(
                Turn(ep.observation, text, r.reward, r.invalid_action, ep.after.anchor_key, cut, gen_truncated,
                     potential=ep.after.potential, next_potential=r.potential, info=dict(r.info))
            )
            ep.ret += r.reward
            self.stats.turns += 1
        ep.pending = None
        ep.observation, ep.after = r.observation, r.after
        if r.kind == "step" and (r.terminated or r.truncated):
            ep.success, ep.terminated, ep.truncated = r.success, r.terminated, r.truncated
            ep.reason = "env" if r.truncated else None
            self._finish(ep)
        elif ep.turn >= ep.max_turns:
            ep.truncated, ep.reason = True, "max_turns"
            self._finish(ep)
        else:
            if ep.ctx is not None:
                if r.kind != "step" and self.memory is not None:  # the first observation: recall past successes
                    ep.ctx.memory = self._memory_ids(ep.observation)
                try:
                    ep.cut = ep.ctx.observe(ep.observation, r.images)
                except (ContextOverflow, SummaryLimit) as err:
                    ep.truncated, ep.reason = True, "summary_limit" if isinstance(err, SummaryLimit) else "context_budget"
                    self._finish(ep)
                    return
                ep.obs_truncations += ep.cut > 0
            if ep.keep_snapshots:
                assert r.after.snapshot is not None, "the env host returned no snapshot"
                ep.snapshots.append(r.after.snapshot)
            ep.awaiting_action = True

    def _memory_ids(self, observation: str) -> tuple[int, ...]:
        """The memory block's ids for an episode whose first observation is ``observation``
        (cut to ``memory.max_tokens`` with the truncation marker)."""
        assert self.memory is not None and self.policy is not None
        text = self.memory.block(observation)
        if not text:
            return ()
        ids = self.policy.chat.encode(text)
        limit = self.memory.cfg.max_tokens
        return ids if len(ids) <= limit else ids[: limit - len(self.marker)] + self.marker

    def _finish(self, ep: Episode) -> None:
        ep.done, ep.awaiting_action = True, False
        self.stats.finished_episodes += ep.failure is None
        self.stats.infra_failures += ep.failure is not None
        self.stats.resumed_steps += ep.resumed_steps
        del self._by_slot[ep.slot]
        self._free_slots.append(ep.slot)

    def _summarize(self, eps: list[Episode]) -> list[Episode]:
        """The summaries ``eps``' contexts ask for, one batched call per actor; returns the
        episodes still running (a new segment that cannot fit ends its episode)."""
        due = [e for e in eps if e.ctx is not None and e.ctx.summary_due]
        by_actor: dict[int, list[Episode]] = {}
        for e in due:
            by_actor.setdefault(id(e.actor), []).append(e)
        ended: set[int] = set()
        for group in by_actor.values():
            actor = group[0].actor
            inputs = [ActorInput(e.ctx.prompt() if actor.needs_tokens else None, e.request.task, e.request.trajectory_id,  # type: ignore[union-attr]
                                 e.turn, e.after, summary=True, max_new_tokens=self.cfg.summary_max_tokens,
                                 images=e.ctx.prompt_images()) for e in group]  # type: ignore[union-attr]
            t0 = time.perf_counter()
            answers = actor.act(inputs)
            if actor.needs_tokens:
                self.stats.generation_seconds += time.perf_counter() - t0
                self.stats.generation_calls += 1
            for e, answer in zip(group, answers):
                if isinstance(answer, Generation):
                    ids, logprobs, version = answer.ids, answer.logprobs, e.actor.version
                    e.min_version = version if e.min_version is None else min(e.min_version, version)
                else:  # a written summary, as the tokens the LM should produce
                    ids, logprobs, version = self.policy.chat.encode(answer) + (self.policy.stop_ids[0],), None, -1  # type: ignore[union-attr]
                e.summary_tokens += len(ids)
                try:
                    e.cut = e.ctx.summarize(tuple(ids), logprobs, version)  # type: ignore[union-attr]
                except ContextOverflow:
                    with self.lock:
                        e.truncated, e.reason = True, "context_budget"
                        self._finish(e)
                        self.lock.notify_all()
                    ended.add(id(e))
                    continue
                e.obs_truncations += e.cut > 0
        return [e for e in eps if id(e) not in ended]

    def _act(self, eps: list[Episode]) -> None:
        """Actions for ``eps`` (in this order): summaries their contexts ask for, then first
        actions of the requests, then one batched call per actor; then send every action to
        the backend at once."""
        eps = self._summarize(eps)
        if not eps:
            return
        texts: dict[int, str] = {}
        by_actor: dict[int, list[Episode]] = {}
        for e in eps:
            if e.turn < len(e.request.first_actions):
                self._record(e, e.request.first_actions[e.turn], texts)
            else:
                by_actor.setdefault(id(e.actor), []).append(e)
        for group in by_actor.values():
            actor = group[0].actor
            inputs = [ActorInput(e.ctx.prompt() if e.ctx is not None and actor.needs_tokens else None, e.request.task,
                                 e.request.trajectory_id, e.turn, e.after,
                                 images=e.ctx.prompt_images() if e.ctx is not None and actor.needs_tokens else ())
                      for e in group]
            t0 = time.perf_counter()
            if self.cfg.thinking_budget is not None and actor.needs_tokens:
                assert self.thinking is not None
                acted = think_then_answer(actor, inputs, self.thinking, self.cfg.thinking_budget, self.cfg.max_new_tokens)
            else:
                acted = [(a, NO_FORCE) for a in actor.act(inputs)]
            if actor.needs_tokens:
                self.stats.generation_seconds += time.perf_counter() - t0
                self.stats.generation_calls += 1
                self.stats.batch_sizes = (self.stats.batch_sizes + [len(group)])[-200:]
            gens = [a for a, _ in acted if isinstance(a, Generation)]
            decoded = iter(self._answer_text(self._decode([self._answer(g.ids) for g in gens]))) if gens else iter(())
            for e, (action, forced) in zip(group, acted):
                if isinstance(action, Generation):
                    self._record(e, action, texts, next(decoded), forced)
                else:
                    self._record(e, action, texts)
        stepping = [e for e in eps if e.slot in texts]  # the others took a fold meta-action (or ended on one)
        for e in stepping:
            e.awaiting_action = False
        if stepping:
            self.backend.send_step([e.slot for e in stepping], [texts[e.slot] for e in stepping],
                                   [self._probe(e, e.turn + 1) for e in stepping], [e.seq for e in stepping])

    def _answer(self, ids: Sequence[int]) -> Sequence[int]:
        """The answer part of an action's ids (after the last ``</think>`` of a reasoning template):
        what the env is sent. All of them without thinking markers."""
        return ids if self.thinking is None else ids[self.thinking.split(ids):]

    def _decode(self, ids: list[Sequence[int]]) -> list[str]:
        """Actions' ids as text: special tokens dropped, the tool-call format's markers kept."""
        tok = self.policy.tokenizer  # type: ignore[union-attr]
        if self._dropped is None:
            return tok.batch_decode(ids, skip_special_tokens=True)
        return tok.batch_decode([[i for i in row if i not in self._dropped] for row in ids], skip_special_tokens=False)

    def _answer_text(self, texts: list[str]) -> list[str]:
        """Decoded answers as the env gets them: a reasoning template's without the newlines after ``</think>``."""
        return texts if self.thinking is None else [t.lstrip("\n") for t in texts]

    def _record(self, e: Episode, action: Generation | str, texts: dict[int, str], decoded: str | None = None,
                forced: tuple[int, int] = NO_FORCE) -> None:
        """Write one action into the episode's context; ``texts[slot]`` = the text the env gets (the
        answer part only, for a reasoning template). ``forced``: the span of the ids the engine wrote
        (a thinking closed at its budget)."""
        if isinstance(action, Generation) and self._fold(e, action, decoded):
            return
        if isinstance(action, Generation):  # sampled ids: recorded as sampled, never re-tokenized
            version = e.actor.version
            e.ctx.act(action.ids, action.logprobs, version, forced=forced)  # type: ignore[union-attr]
            e.min_version = version if e.min_version is None else min(e.min_version, version)
            text, stopped, ids = decoded, action.stopped, action.ids
        elif e.ctx is not None:  # a text action, written as the tokens the LM should produce
            if self.thinking is None and any(close in action for _, close in THINKING_MARKERS):
                raise UserError(f"the expert's action {action[:60]!r} holds a thought but the chat template of "
                                f"{self.policy.path!r} has no thinking markers; set model.thinking=true, use a reasoning "  # type: ignore[union-attr]
                                "model, or turn the env's expert thoughts off (env.kwargs.expert_thoughts=false)")
            chat = self.policy.chat  # type: ignore[union-attr]
            ids = chat.encode(chat.continuing(action)) + (self.policy.stop_ids[0],)  # type: ignore[union-attr]
            e.ctx.act(ids, None, -1)
            text = self._answer_text(self._decode([self._answer(ids)]))[0]
            stopped = True
        else:  # no token context: a text action's answer part (what follows a reasoning template's last </think>)
            answer = action if self.thinking is None else action.rpartition(self.thinking.close)[2]
            text, stopped, ids = self._answer_text([answer])[0], True, ()
        split = len(ids) - len(self._answer(ids))

        def sampled(a: int, b: int) -> int:  # ids in [a, b) not written by the engine
            return b - a - max(0, min(b, forced[1]) - max(a, forced[0]))

        n = sampled(0, len(ids))
        e.thinking_tokens += sampled(0, split)
        e.answer_tokens += sampled(split, len(ids))
        e.thinking_cuts += forced != NO_FORCE
        e.generation_truncations += not stopped
        e.action_tokens += n
        self.stats.generated_tokens += n
        e.pending = (text, not stopped, e.cut)
        texts[e.slot] = text

    def _fold(self, e: Episode, action: Generation, decoded: str | None) -> bool:
        """``rollout.context=fold``: a sampled ``branch(goal)`` (no branch open, fewer than
        ``rollout.max_branches`` so far) or ``return(message)`` (in a branch) is recorded and switches
        the episode's context; it is not sent to the env and the episode acts again. True if it was one."""
        ctx = e.ctx
        if not self.context.meta_actions or ctx is None or decoded is None:
            return False
        meta = fold_meta(decoded)
        if meta is None or (meta[0] == "branch") == ctx.in_branch or (meta[0] == "branch" and ctx.branches >= self.cfg.max_branches):
            return False
        version = e.actor.version
        ctx.act(action.ids, action.logprobs, version, meta=True)
        e.min_version = version if e.min_version is None else min(e.min_version, version)
        e.action_tokens += len(action.ids)
        self.stats.generated_tokens += len(action.ids)
        e.generation_truncations += not action.stopped
        e.meta_actions += 1
        try:
            e.cut = ctx.branch(meta[1]) if meta[0] == "branch" else ctx.fold_return(meta[1])
        except ContextOverflow:
            with self.lock:
                e.truncated, e.reason = True, "context_budget"
                self._finish(e)
                self.lock.notify_all()
            return True
        e.obs_truncations += e.cut > 0
        return True

    def round(self, lockstep: bool, wait: float | None = None) -> None:
        """One scheduling round: collect env results, then act for the episodes that await
        an action. ``lockstep``: wait for every request in flight, then act on all running
        episodes in admission order; otherwise act on whatever is ready, waiting up to
        ``wait`` seconds for a result only when nothing can act."""
        with self.lock:
            running = list(self._by_slot.values())
            in_flight = sum(not e.awaiting_action for e in running)
            ready = any(e.awaiting_action for e in running)
        if lockstep:
            results = self.backend.recv(in_flight) if in_flight else []
        else:
            results = self.backend.recv(1, timeout=0.0005 if ready else wait) if in_flight else []
        with self.lock:
            for r in results:
                self._on_result(r)
            running = sorted(self._by_slot.values(), key=lambda e: e.seq)
            acting = [e for e in running if e.awaiting_action]
            if lockstep and len(acting) < len(running):
                acting = []
            self.lock.notify_all()
        if acting:
            self._act(acting)

    def trajectory(self, e: Episode) -> Trajectory:
        """The record of episode ``e`` (finished, or abandoned mid-way)."""
        samples = tuple(e.ctx.finish()) if e.ctx is not None else ()
        req = e.request
        return Trajectory(
            trajectory_id=req.trajectory_id, task=req.task, group_id=req.group_id, env_seed=req.env_seed,
            turns=tuple(e.turns), samples=samples, episode_return=e.ret, success=e.success, terminated=e.terminated,
            truncated=e.truncated, truncation_reason=e.reason,
            policy_version=e.min_version if e.min_version is not None else e.actor.version,
            infra_failure=e.failure, resumed_steps=e.resumed_steps,
            snapshots=tuple(e.snapshots[: len(e.turns)]),  # one per played turn (a failed step has none)
            memory_tokens=len(e.ctx.memory) if e.ctx is not None else 0,
        )

    def close(self) -> None:
        self.backend.close()
        close_env(self.env)  # the local instance (tasks, action checks) may hold a browser


def rollout_stats(episodes: Sequence[Episode]) -> RolloutStats:
    """The counters of finished episodes."""
    return RolloutStats(
        episodes=len(episodes),
        turns=sum(e.turn for e in episodes),
        obs_truncations=sum(e.obs_truncations for e in episodes),
        context_overflows=sum(e.reason == "context_budget" for e in episodes),
        generation_truncations=sum(e.generation_truncations for e in episodes),
        history_dropped=sum(e.ctx.history_dropped for e in episodes if e.ctx is not None),
        infra_failures=sum(e.failure is not None for e in episodes),
        generated_tokens=sum(e.action_tokens for e in episodes),
        summaries=sum(e.ctx.summaries for e in episodes if e.ctx is not None),
        summary_tokens=sum(e.summary_tokens for e in episodes),
        summary_limits=sum(e.reason == "summary_limit" for e in episodes),
        memory_recalls=sum(bool(e.ctx.memory) for e in episodes if e.ctx is not None),
        memory_tokens=sum(len(e.ctx.memory) for e in episodes if e.ctx is not None),
        thinking_tokens=sum(e.thinking_tokens for e in episodes),
        answer_tokens=sum(e.answer_tokens for e in episodes),
        thinking_cuts=sum(e.thinking_cuts for e in episodes),
    )


def run_env_slots(cfg: TrainConfig) -> int:
    """Env slots of a training run's engine: ``engine.env_slots``, or one iteration's episodes,
    or an evaluation's (up to 256). Evaluations play in waves of this size, so ``turnforge eval``
    uses it too."""
    if cfg.engine.env_slots is not None:
        return cfg.engine.env_slots
    return max(cfg.rl.tasks_per_iteration * cfg.rl.group_size, min(cfg.eval.episodes, 256))


def make_engine(cfg: TrainConfig, policy: Policy | None, num_envs: int | None = None, *,
                workers: int | None = None) -> RolloutEngine:
    """The engine a run's config asks for: ``num_envs`` env slots (default ``run_env_slots``)
    on the backend of ``make_backend`` (``engine.env_workers`` worker processes, Ray actors
    with ``cluster=ray``, or this process) and a local env instance with the recipe's task source."""
    num_envs = run_env_slots(cfg) if num_envs is None else num_envs
    env = build_env(cfg.env.id, cfg.env.kwargs, cfg.env.tasks, cfg.env.heldout_fraction)
    backend = make_backend(cfg.env.id, dict(cfg.env.kwargs), num_envs, cfg.engine, on_ray=cfg.cluster == "ray", workers=workers)
    return RolloutEngine(backend, cfg.rollout, policy, env)
