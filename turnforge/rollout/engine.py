"""The rollout engine: every episode in turnforge is played here.

Two entry points over one core:

- ``RolloutEngine.play(requests, actor)``: play a list of episode requests (optionally from
  env snapshots, optionally keeping a snapshot before every action) and return when all are
  done. Evaluation, demonstrations, value pretraining and Monte-Carlo rollouts use it.
- ``GroupStream``: hand the trainer whole groups of G episodes, synchronously (lock-step,
  one batch per trainer step) or asynchronously (a background rollout thread, per-trajectory
  scheduling, bounded staleness, partial rollouts, weight sync). RL uses it.

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
when nothing more fits the context (``'context_budget'``) or when the env ends it. Observations
cut to fit, history turns dropped and generations cut at ``max_new_tokens`` are counted
(``RolloutStats``). An env that raises ends its episode as an infrastructure failure
(``Trajectory.infra_failure``), never a reward of 0; the other episodes go on. A failed reset
or restore gives such a trajectory too, with no turns and no samples, so every request
returns one trajectory and every failure is counted (``turnforge.train.failures`` decides
whether a stage may go on).

Asynchronous mode (``GroupStream(lockstep=False)``), as before the refactor: admission under the
``StalenessController`` (``floor((N_r - 1) / B) <= version + eta``), continuous batching of
generation at turn granularity, weights switched between generation calls (an episode running
across an update continues with the new weights: APRIL's partial rollouts at turn
granularity); with ``partial_rollouts`` the trainer takes the oldest completed groups and a
group whose oldest token would exceed ``eta`` is restarted (``stale_restarts``). Departures:
an in-flight generation call is not aborted token-wise when new weights arrive; weight sync
is a ``load_state_dict`` into the stream's own policy copy (``turnforge.rollout.ray_worker``
ships it through Ray).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

import torch

from turnforge.config import RolloutConfig, TrainConfig
from turnforge.envpool import EnvBackend, make_backend
from turnforge.envs.registry import build_env
from turnforge.envpool.host import AfterState, EnvResult, Probe
from turnforge.envs.base import Env, EnvSnapshot, capabilities
from turnforge.policy.generate import Generation
from turnforge.policy.model import Policy
from turnforge.rollout.actors import Actor, ActorInput, PolicyActor
from turnforge.rollout.context import ContextOverflow, EpisodeContext, PromptSpec
from turnforge.rollout.staleness import StalenessController
from turnforge.types import Task, Trajectory, Turn


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


@dataclass
class _Episode:
    request: EpisodeRequest
    actor: Actor
    seq: int  # admission order: lock-step rounds act in this order
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
        self.caps = capabilities(env)
        self.marker = policy.chat.encode(cfg.truncation_marker) if policy is not None else ()
        self.free_slots: list[int] = list(range(backend.num_envs))[::-1]
        self.by_slot: dict[int, _Episode] = {}
        self.stats = EngineStats()
        self._seq = 0
        self._lock = threading.Condition()  # guards the episode tables when a GroupStream runs a thread

    @property
    def num_envs(self) -> int:
        return self.backend.num_envs

    # ------------------------------------------------------------------ entry point 1: play
    def play(self, requests: Sequence[EpisodeRequest], actor: Actor, *, keep_snapshots: bool = False,
             tokens: bool = True, on_wave: Callable[[int], None] | None = None) -> tuple[list[Trajectory], RolloutStats]:
        """Play ``requests`` to the end with ``actor``, in waves of ``num_envs`` episodes;
        return their trajectories (in request order) and counters. With ``keep_snapshots``
        each trajectory records the env snapshot taken before each turn's action; with
        ``tokens=False`` no token context is kept, nor anchor keys and potentials (no samples;
        for text actors whose episodes are only scored, e.g. Monte-Carlo rollouts).
        ``on_wave(k)`` runs before wave ``k`` starts (e.g. to reseed the actor)."""
        if self.by_slot:
            raise RuntimeError("the rollout engine is busy (a group stream has episodes running)")
        trajectories: list[Trajectory] = []
        episodes: list[_Episode] = []
        for k, lo in enumerate(range(0, len(requests), self.num_envs)):
            if on_wave is not None:
                on_wave(k)
            wave = [self._launch(req, actor, keep_snapshots, tokens=tokens) for req in requests[lo:lo + self.num_envs]]
            while self.by_slot:
                self.round(lockstep=True)
            episodes.extend(wave)
            trajectories.extend(self._trajectory(e) for e in wave)
        return trajectories, rollout_stats(episodes)

    # ------------------------------------------------------------------ the core
    def _launch(self, req: EpisodeRequest, actor: Actor, keep_snapshots: bool, tokens: bool = True) -> _Episode:
        """Start ``req`` on a free env slot (reset, or restore from its snapshot)."""
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
        if needs.random_seed is not None:
            self.caps.require("random_action", self.env.env_id, f"{type(actor).__name__} (it plays random actions)")
        ctx = None
        if self.policy is not None and tokens:
            ctx = EpisodeContext(self.policy.chat, self.cfg, self.prompt, self.marker, req.trajectory_id)
        slot = self.free_slots.pop()
        ep = _Episode(req, actor, self._seq, slot, ctx, keep_snapshots)
        self._seq += 1
        self.by_slot[slot] = ep
        self.stats.admitted_episodes += 1
        probe = self._probe(ep, 0)
        if req.start is None:
            self.backend.send_reset([slot], [req.env_seed], [req.task], [probe])
        else:
            self.backend.send_restore([slot], [req.start], [req.reseed], [probe])
        return ep

    def _probe(self, ep: _Episode, turn: int) -> Probe:
        """What the env host reads after the request that precedes action ``turn``."""
        if turn >= ep.max_turns:
            return Probe()  # no action follows: the turn budget ends the episode
        probe = Probe() if turn < len(ep.request.first_actions) else ep.actor.probe(ep.request.task, ep.request.trajectory_id, turn)
        return Probe(probe.expert, probe.random_seed, ep.keep_snapshots, keys=ep.ctx is not None)

    def _on_result(self, r: EnvResult) -> None:
        ep = self.by_slot.get(r.env_id)
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
                try:
                    ep.cut = ep.ctx.observe(ep.observation)
                except ContextOverflow:
                    ep.truncated, ep.reason = True, "context_budget"
                    self._finish(ep)
                    return
                ep.obs_truncations += ep.cut > 0
            if ep.keep_snapshots:
                assert r.after.snapshot is not None, "the env host returned no snapshot"
                ep.snapshots.append(r.after.snapshot)
            ep.awaiting_action = True

    def _finish(self, ep: _Episode) -> None:
        ep.done, ep.awaiting_action = True, False
        self.stats.finished_episodes += ep.failure is None
        self.stats.infra_failures += ep.failure is not None
        self.stats.resumed_steps += ep.resumed_steps
        del self.by_slot[ep.slot]
        self.free_slots.append(ep.slot)

    def _act(self, eps: list[_Episode]) -> None:
        """Actions for ``eps`` (in this order): first actions of the requests, then one
        batched call per actor; then send every action to the backend at once."""
        texts: dict[int, str] = {}
        by_actor: dict[int, list[_Episode]] = {}
        for e in eps:
            if e.turn < len(e.request.first_actions):
                self._record(e, e.request.first_actions[e.turn], texts)
            else:
                by_actor.setdefault(id(e.actor), []).append(e)
        for group in by_actor.values():
            actor = group[0].actor
            inputs = [ActorInput(e.ctx.prompt() if e.ctx is not None and actor.needs_tokens else None, e.request.task,
                                 e.request.trajectory_id, e.turn, e.after) for e in group]
            t0 = time.perf_counter()
            actions = actor.act(inputs)
            if actor.needs_tokens:
                self.stats.generation_seconds += time.perf_counter() - t0
                self.stats.generation_calls += 1
                self.stats.batch_sizes = (self.stats.batch_sizes + [len(group)])[-200:]
            gens = [a for a in actions if isinstance(a, Generation)]
            decoded = iter(self.policy.tokenizer.batch_decode([g.ids for g in gens], skip_special_tokens=True)) if gens else iter(())
            for e, action in zip(group, actions):
                if isinstance(action, Generation):
                    self._record(e, action, texts, next(decoded))
                else:
                    self._record(e, action, texts)
        for e in eps:
            e.awaiting_action = False
        self.backend.send_step([e.slot for e in eps], [texts[e.slot] for e in eps], [self._probe(e, e.turn + 1) for e in eps])

    def _record(self, e: _Episode, action: Generation | str, texts: dict[int, str], decoded: str | None = None) -> None:
        """Write one action into the episode's context; ``texts[slot]`` = the text the env gets."""
        if isinstance(action, Generation):  # sampled ids: recorded as sampled, never re-tokenized
            version = e.actor.version
            e.ctx.act(action.ids, action.logprobs, version)  # type: ignore[union-attr]
            e.min_version = version if e.min_version is None else min(e.min_version, version)
            text, stopped, n = decoded, action.stopped, len(action.ids)
        elif e.ctx is not None:  # a text action, written as the tokens the LM should produce
            ids = self.policy.chat.encode(action) + (self.policy.stop_ids[0],)  # type: ignore[union-attr]
            e.ctx.act(ids, None, -1)
            text, stopped, n = self.policy.tokenizer.decode(ids, skip_special_tokens=True), True, len(ids)  # type: ignore[union-attr]
        else:
            text, stopped, n = action, True, 0
        e.generation_truncations += not stopped
        e.action_tokens += n
        self.stats.generated_tokens += n
        e.pending = (text, not stopped, e.cut)
        texts[e.slot] = text

    def round(self, lockstep: bool, wait: float | None = None) -> None:
        """One scheduling round: collect env results, then act for the episodes that await
        an action. ``lockstep``: wait for every request in flight, then act on all running
        episodes in admission order; otherwise act on whatever is ready, waiting up to
        ``wait`` seconds for a result only when nothing can act."""
        with self._lock:
            running = list(self.by_slot.values())
            in_flight = sum(not e.awaiting_action for e in running)
            ready = any(e.awaiting_action for e in running)
        if lockstep:
            results = self.backend.recv(in_flight) if in_flight else []
        else:
            results = self.backend.recv(1, timeout=0.0005 if ready else wait) if in_flight else []
        with self._lock:
            for r in results:
                self._on_result(r)
            running = sorted(self.by_slot.values(), key=lambda e: e.seq)
            acting = [e for e in running if e.awaiting_action]
            if lockstep and len(acting) < len(running):
                acting = []
            self._lock.notify_all()
        if acting:
            self._act(acting)

    def _trajectory(self, e: _Episode) -> Trajectory:
        samples = tuple(e.ctx.finish()) if e.ctx is not None else ()
        req = e.request
        return Trajectory(
            trajectory_id=req.trajectory_id, task=req.task, group_id=req.group_id, env_seed=req.env_seed,
            turns=tuple(e.turns), samples=samples, episode_return=e.ret, success=e.success, terminated=e.terminated,
            truncated=e.truncated, truncation_reason=e.reason,
            policy_version=e.min_version if e.min_version is not None else e.actor.version,
            infra_failure=e.failure, resumed_steps=e.resumed_steps,
            snapshots=tuple(e.snapshots[: len(e.turns)]),  # one per played turn (a failed step has none)
        )

    def close(self) -> None:
        self.backend.close()


def rollout_stats(episodes: Sequence[_Episode]) -> RolloutStats:
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
    )


# ---------------------------------------------------------------------------- entry point 2: groups
@dataclass
class _Group:
    index: int
    episodes: list[_Episode]

    @property
    def done(self) -> bool:
        return all(e.done for e in self.episodes)


@dataclass(frozen=True)
class GroupBatch:
    """What ``GroupStream.take`` hands the trainer: whole groups, oldest first, the staleness
    of each trajectory (trainer version minus its oldest token's version) and their counters."""

    trajectories: list[Trajectory]
    staleness: list[int]  # one per trajectory with sampled tokens
    version: int  # the trainer version the batch is taken at
    stats: RolloutStats


class GroupStream:
    """Whole groups of G episodes for the trainer, from one engine (see the module docstring).

    ``make_group(k)`` returns the G ``EpisodeRequest`` of the k-th admitted group;
    ``groups_per_batch`` groups make one trainer batch. ``actor`` is the policy that samples
    them (its policy is the trainer's own when the stream runs inline, a copy when it runs in
    a thread). ``lockstep=True`` is the synchronous mode: a batch is admitted once the previous
    one is taken, and played in lock-step rounds; ``generator_for(b)`` then gives the sampling
    generator of batch ``b`` (so a resumed or re-run iteration draws the same tokens).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        actor: PolicyActor,
        make_group: Callable[[int], list[EpisodeRequest]],
        *,
        group_size: int,
        groups_per_batch: int,
        eta: int = 0,
        lockstep: bool = True,
        partial_rollouts: bool = False,
        keep_snapshots: bool = False,
        max_groups: int | None = None,
        generator_for: Callable[[int], torch.Generator] | None = None,
    ) -> None:
        if engine.num_envs < group_size:
            raise ValueError(f"the env backend has {engine.num_envs} env slots; one group needs group_size={group_size}")
        if partial_rollouts and eta < 1:
            raise ValueError("partial_rollouts needs eta >= 1: a carried-over trajectory is at least one version old")
        self.engine, self.actor, self.make_group = engine, actor, make_group
        self.group_size, self.groups_per_batch = group_size, groups_per_batch
        self.controller = StalenessController(groups_per_batch * group_size, eta, group_size)
        self.lockstep, self.partial, self.keep_snapshots = lockstep, partial_rollouts, keep_snapshots
        self.max_groups, self.generator_for = max_groups, generator_for
        self.version0 = actor.version
        self.admitted = 0  # groups admitted
        self.consumed = 0  # groups handed to the trainer
        self.stale_restarts = 0
        self.groups: dict[int, _Group] = {}  # admitted and not yet taken
        self._pending_weights: tuple[Mapping[str, torch.Tensor] | None, int] | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None

    @property
    def _lock(self) -> threading.Condition:
        return self.engine._lock

    # ------------------------------------------------------------------ scheduling
    def _can_admit(self) -> bool:
        if self.max_groups is not None and self.admitted >= self.max_groups:
            return False
        if len(self.engine.free_slots) < self.group_size:
            return False
        if self.lockstep:  # the next batch only once the current one is taken
            in_batch = self.admitted - self.consumed
            return in_batch < self.groups_per_batch and (in_batch > 0 or not self.groups)
        return self.controller.can_admit()

    def _admit(self) -> None:
        while self._can_admit():
            self.controller.admit()
            k = self.admitted
            if self.lockstep and self.generator_for is not None and k % self.groups_per_batch == 0:
                self.actor.generator = self.generator_for(k // self.groups_per_batch)
            self.admitted += 1
            episodes = [self.engine._launch(req, self.actor, self.keep_snapshots) for req in self.make_group(k)]
            self.groups[k] = _Group(k, episodes)

    def _consumable(self) -> list[_Group] | None:
        order = sorted(self.groups)
        if not self.partial:
            head = order[: self.groups_per_batch]
            if len(head) == self.groups_per_batch and all(self.groups[k].done for k in head):
                return [self.groups[k] for k in head]
            return None
        done = [self.groups[k] for k in order if self.groups[k].done and (self._age(self.groups[k]) or 0) <= self.controller.eta]
        return done[: self.groups_per_batch] if len(done) >= self.groups_per_batch else None

    def _age(self, g: _Group) -> int | None:
        """Trainer steps since the version of the group's oldest sampled token."""
        versions = [e.min_version for e in g.episodes if e.min_version is not None]
        return None if not versions else self.controller.version - (min(versions) - self.version0)

    def _restart_stale(self) -> None:
        """partial_rollouts: restart groups whose oldest token is already more than eta
        versions old (they could never be trained within the bound), once none of their
        envs has a request in flight and enough env slots are free."""
        engine = self.engine
        for g in self.groups.values():
            age = self._age(g)
            if age is None or age <= self.controller.eta:
                continue
            if any(not e.done and not e.awaiting_action for e in g.episodes):
                continue  # a reset/step is in flight; check again after it returns
            running = [e for e in g.episodes if not e.done]
            if len(engine.free_slots) + len(running) < len(g.episodes):
                continue
            self.stale_restarts += 1
            for e in running:
                del engine.by_slot[e.slot]
                engine.free_slots.append(e.slot)
            g.episodes = [engine._launch(e.request, self.actor, self.keep_snapshots) for e in g.episodes]

    def _pop(self, groups: list[_Group]) -> GroupBatch:
        version = self.controller.version
        trajs, staleness, episodes = [], [], []
        for g in groups:
            del self.groups[g.index]
            for e in g.episodes:
                trajs.append(self.engine._trajectory(e))
                episodes.append(e)
                if e.min_version is not None:
                    staleness.append(version - (e.min_version - self.version0))
        self.consumed += len(groups)
        return GroupBatch(trajs, staleness, version, rollout_stats(episodes))

    def _schedule(self) -> bool:
        """Apply new weights, restart stale groups, admit new ones; False when nothing runs."""
        with self._lock:
            self._apply_pending_weights()
            if self.partial:
                self._restart_stale()
            self._admit()
            return bool(self.engine.by_slot)

    # ------------------------------------------------------------------ the trainer's side
    def take(self, timeout: float | None = None) -> GroupBatch:
        """The next trainer batch: ``groups_per_batch`` whole groups. Drives the engine
        inline when no background thread runs; otherwise waits for the thread."""
        if self._thread is None:
            while (ready := self._consumable()) is None:
                if not self._schedule() and self._consumable() is None:
                    raise RuntimeError("the rollout engine cannot produce another batch (max_groups reached?)")
                self.engine.round(self.lockstep)
            return self._pop(ready)
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self._lock:
            while True:
                if self._error is not None:
                    raise RuntimeError("the rollout thread failed") from self._error
                ready = self._consumable()
                if ready is not None:
                    return self._pop(ready)
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    raise TimeoutError("no trainer batch within the timeout")
                self._lock.wait(timeout=0.05 if left is None else min(left, 0.05))

    def set_weights(self, state_dict: Mapping[str, torch.Tensor] | None, version: int) -> None:
        """The trainer finished a step: new weights (None when the stream shares the
        trainer's model) and version. Applied before the next generation call."""
        with self._lock:
            self._pending_weights = (state_dict, version)
            self.controller.train_step()  # the trainer's version counts now; admission waits for the weights
            if self._thread is None:
                self._apply_pending_weights()

    def _apply_pending_weights(self) -> None:
        """Load the weights ``set_weights`` left (call with the lock held)."""
        if self._pending_weights is None:
            return
        state_dict, version = self._pending_weights
        self._pending_weights = None
        if state_dict is not None:
            self.actor.policy.model.load_state_dict(state_dict)
        self.actor.policy.version = version

    # ------------------------------------------------------------------ background thread
    def start(self) -> None:
        """Run the scheduling loop in a background thread (the rollout worker)."""
        if self._thread is not None:
            raise RuntimeError("the group stream already runs")
        self._thread = threading.Thread(target=self._loop, name="turnforge-rollout", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop:
                if not self._schedule():  # nothing may start (staleness bound) and nothing runs
                    with self._lock:
                        self._lock.wait(timeout=0.01)
                    continue
                self.engine.round(self.lockstep, wait=0.05)
        except BaseException as err:  # surfaced to the trainer by take()
            with self._lock:
                self._error = err
                self._lock.notify_all()

    def stop(self) -> None:
        """Stop the background thread (episodes in flight are abandoned, never trained on)."""
        self._stop = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None



def run_env_slots(cfg: TrainConfig) -> int:
    """Env slots of a training run's engine: one iteration's episodes, or an evaluation's
    (up to 256). Evaluations play in waves of this size, so ``turnforge eval`` uses it too."""
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
