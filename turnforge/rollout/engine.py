"""The asynchronous rollout engine: per-trajectory scheduling over an env backend,
continuous batching of generation, bounded staleness, partial rollouts, weight sync.

Each episode is a small state machine: *awaiting an env result* or *awaiting an action*.
One scheduling round (``RolloutEngine.tick``):

1. **admit** new groups (G episodes of one task) into free env slots while the
   ``StalenessController`` allows: ``floor((N_r - 1) / B) <= version + eta``;
2. **collect** whatever env results are ready (without waiting when some episode can act,
   waiting for at least one otherwise);
3. **generate** one action for every episode that awaits one, in one batched call:
   continuous batching at turn granularity, whatever turns are ready, never an action for
   a finished env;
4. **send** those actions to the env backend at once (non-blocking) and loop.

A finished episode frees its slot at once, so the next group starts while other episodes
are still running: no lock-step over a batch. ``lockstep=True`` turns the engine into the
synchronous baseline (verl-agent/RAGEN style) on the same code path: it generates only
when every running episode awaits an action, and admits the next batch only after the
current one is consumed.

Versions and staleness: every generated token carries the version of the weights that
sampled it (``Sample.versions``). Weights change only between generation calls, so an
episode running across a weight update continues with the new weights: its later turns
carry the newer version (APRIL's partial rollouts, at turn granularity; see below).
``RolloutEngine.take`` hands the trainer whole groups oldest first (admission order), so a
trajectory admitted at version ``v`` is trained at step ``<= v + eta`` (the controller's
guarantee). With ``partial_rollouts`` the trainer takes the oldest *completed* groups,
skipping older groups still running (they carry over to a later step with newer weights);
any group whose oldest token would then be more than ``eta`` versions old is restarted
from its first turn (counted as ``stale_restarts``), so the bound holds for every token.

Fault tolerance: env results come with a status from the backend (``EnvPool`` restarts
crashed and hung workers from snapshots). ``'resumed'`` steps are counted on the
trajectory; ``'failed'`` ends the episode as an infrastructure failure, which the trainer
excludes from advantages. Every admitted episode ends exactly once: finished or failed (a
stale restart replaces an episode, counted; ``stop()`` abandons the ones still running).

Departures: (1) an in-flight generation call is not aborted token-wise when new weights
arrive; the switch happens at the next turn (a turn is at most ``max_new_tokens`` tokens).
(2) Weight sync is a ``load_state_dict`` into the engine's own copy of the policy (one
machine); ``turnforge.rollout.ray_worker`` ships the same state dict through Ray.
(3) Episodes cannot start from snapshots here (Monte-Carlo rollouts use ``rollout()``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

import torch

from turnforge.config import RolloutConfig
from turnforge.envpool.pool import EnvResult
from turnforge.envs.base import Env
from turnforge.policy.generate import sample
from turnforge.policy.model import Policy
from turnforge.rollout.context import ContextOverflow, EpisodeContext, PromptSpec
from turnforge.rollout.runner import EpisodeRequest
from turnforge.rollout.staleness import StalenessController
from turnforge.types import Trajectory, Turn


# ---------------------------------------------------------------------------- env backends
class EnvBackend(Protocol):
    """Where envs run: ``InlineEnvs`` (this process) or ``turnforge.envpool`` (workers)."""

    num_envs: int

    def send_reset(self, env_ids: Sequence[int], seeds: Sequence[int | None], tasks: Sequence) -> None: ...

    def send_step(self, env_ids: Sequence[int], action_texts: Sequence[str]) -> None: ...

    def recv(self, batch_size: int = 1, timeout: float | None = None) -> list[EnvResult]: ...


class InlineEnvs:
    """``Env`` objects of this process behind the backend API: a request runs when it is
    sent, so ``recv`` never waits. An env that raises gives a ``'failed'`` result."""

    def __init__(self, envs: Sequence[Env]) -> None:
        self.envs, self.num_envs = list(envs), len(envs)
        self._ready: deque[EnvResult] = deque()

    def send_reset(self, env_ids, seeds, tasks) -> None:
        for i, seed, task in zip(env_ids, seeds, tasks):
            self._run(i, "reset", lambda env, s=seed, t=task: (env.reset(s, t), 0.0, False, False, False, False, {}))

    def send_step(self, env_ids, action_texts) -> None:
        def step(env, text):
            r = env.step(text)
            return r.observation, r.reward, r.terminated, r.truncated, r.invalid_action, r.success, r.info

        for i, text in zip(env_ids, action_texts):
            self._run(i, "step", lambda env, a=text: step(env, a))

    def _run(self, i: int, kind: str, fn: Callable) -> None:
        env = self.envs[i]
        t0 = time.perf_counter()
        try:
            obs, rew, term, trunc, invalid, success, info = fn(env)
            potential = 0.0 if term else env.potential()
            self._ready.append(EnvResult(i, kind, obs, rew, term, trunc, invalid, success, dict(info), "ok", None,
                                         time.perf_counter() - t0, env.anchor_key(), potential))
        except Exception as err:  # an env bug is an infrastructure failure of this episode
            self._ready.append(EnvResult(i, kind, "", 0.0, False, False, False, False, {}, "failed",
                                         f"{type(err).__name__}: {err}", time.perf_counter() - t0))

    def recv(self, batch_size: int = 1, timeout: float | None = None) -> list[EnvResult]:
        out = list(self._ready)
        self._ready.clear()
        return out

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- episodes
@dataclass
class _Episode:
    request: EpisodeRequest
    group: int  # admission index of its group (0, 1, ...)
    slot: int  # env id in the backend
    ctx: EpisodeContext
    start_version: int
    observation: str = ""
    anchor_key: str = ""
    potential: float = 0.0
    turns: list[Turn] = field(default_factory=list)
    # the turn being built: (action text, generation hit max_new_tokens, observation tokens cut,
    # anchor key and potential of the state acted in); text is None until the action is generated
    pending: tuple | None = None
    awaiting_action: bool = False
    ret: float = 0.0
    success: bool = False
    terminated: bool = False
    truncated: bool = False
    reason: str | None = None
    failure: str | None = None
    resumed_steps: int = 0
    min_version: int | None = None
    done: bool = False


@dataclass
class _Group:
    index: int
    episodes: list[_Episode]
    start_version: int

    @property
    def done(self) -> bool:
        return all(e.done for e in self.episodes)


@dataclass(frozen=True)
class GroupBatch:
    """What ``RolloutEngine.take`` hands the trainer: whole groups, oldest first, and the
    staleness of each trajectory (trainer version minus its oldest token's version)."""

    trajectories: list[Trajectory]
    staleness: list[int]  # one per trajectory with sampled tokens
    version: int  # the trainer version the batch is taken at


@dataclass
class EngineStats:
    """Counters since the engine started (``env_busy`` / ``idle`` need the backend's and
    trainer's own clocks; the engine counts what it sees)."""

    admitted_groups: int = 0
    finished_episodes: int = 0
    infra_failures: int = 0
    resumed_steps: int = 0
    stale_restarts: int = 0
    turns: int = 0
    generated_tokens: int = 0
    generation_calls: int = 0
    generation_seconds: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)


class RolloutEngine:
    """Per-trajectory asynchronous rollouts (see the module docstring).

    ``make_group(k)`` returns the G ``EpisodeRequest`` of the k-th admitted group;
    ``groups_per_batch`` groups make one trainer batch (``B = groups_per_batch * G``
    trajectories). ``policy`` is the engine's own policy (a copy of the trainer's when the
    engine runs in a thread; the trainer's own when it is driven inline). The backend must
    have at least ``G`` env slots.
    """

    def __init__(
        self,
        policy: Policy,
        backend: EnvBackend,
        cfg: RolloutConfig,
        make_group: Callable[[int], list[EpisodeRequest]],
        *,
        group_size: int,
        groups_per_batch: int,
        eta: int,
        generator: torch.Generator,
        lockstep: bool = False,
        partial_rollouts: bool = False,
        max_groups: int | None = None,
        prompt: PromptSpec | None = None,
    ) -> None:
        if backend.num_envs < group_size:
            raise ValueError(f"the env backend has {backend.num_envs} env slots; one group needs group_size={group_size}")
        if partial_rollouts and eta < 1:
            raise ValueError("partial_rollouts needs eta >= 1: a carried-over trajectory is at least one version old")
        self.policy, self.backend, self.cfg, self.make_group = policy, backend, cfg, make_group
        self.group_size, self.groups_per_batch = group_size, groups_per_batch
        self.controller = StalenessController(groups_per_batch * group_size, eta, group_size)
        self.generator, self.lockstep, self.partial = generator, lockstep, partial_rollouts
        self.max_groups = max_groups  # stop admitting after this many groups (None = no limit)
        self.prompt = prompt or PromptSpec()  # PromptSpec.of(env, cfg.include_instructions)
        self.version = policy.version
        self.controller.version = 0
        self._version0 = policy.version
        self.free_slots: list[int] = list(range(backend.num_envs))[::-1]
        self.by_slot: dict[int, _Episode] = {}
        self.groups: dict[int, _Group] = {}  # admitted and not yet taken
        self.consumed = 0  # groups handed to the trainer (lockstep admission)
        self.stats = EngineStats()
        self.marker = policy.chat.encode(cfg.truncation_marker)
        # threading
        self._lock = threading.Condition()
        self._pending_weights: tuple[dict, int] | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ scheduling
    def _can_admit(self) -> bool:
        if self.max_groups is not None and self.stats.admitted_groups >= self.max_groups:
            return False
        if len(self.free_slots) < self.group_size:
            return False
        if self.lockstep:  # the next batch only once the current one is consumed, all at once
            in_batch = self.stats.admitted_groups - self.consumed
            return in_batch < self.groups_per_batch and (in_batch > 0 or not self.groups)
        return self.controller.can_admit()

    def _admit(self) -> None:
        while self._can_admit():
            _, _ = self.controller.admit()
            k = self.stats.admitted_groups
            self.stats.admitted_groups += 1
            episodes = [self._new_episode(req, k) for req in self.make_group(k)]
            self.groups[k] = _Group(k, episodes, self.version)
            self.backend.send_reset([e.slot for e in episodes], [e.request.env_seed for e in episodes],
                                    [e.request.task for e in episodes])

    def _new_episode(self, req: EpisodeRequest, group: int) -> _Episode:
        if req.start is not None:
            raise ValueError("RolloutEngine cannot start episodes from snapshots; use rollout()")
        slot = self.free_slots.pop()
        ctx = EpisodeContext(self.policy.chat, self.cfg, self.prompt, self.marker, req.trajectory_id)
        ep = _Episode(req, group, slot, ctx, self.version)
        self.by_slot[slot] = ep
        return ep

    def _on_result(self, r) -> None:
        ep = self.by_slot.get(r.env_id)
        if ep is None or ep.done:
            raise RuntimeError(f"env backend returned a result for env {r.env_id}, which runs no episode")
        if r.status == "failed":
            where = "reset" if r.kind == "reset" else "step"
            ep.failure = f"env {where}() failed on {ep.request.task.task_id} (seed {ep.request.env_seed}): {r.error}"
            self._finish(ep)
            return
        ep.resumed_steps += r.status == "resumed"
        if r.kind == "step":
            text, gen_truncated, cut, anchor, potential = ep.pending
            ep.turns.append(
                Turn(ep.observation, text, r.reward, r.invalid_action, anchor, cut, gen_truncated,
                     potential=potential, next_potential=0.0 if r.terminated else r.potential, info=dict(r.info))
            )
            ep.ret += r.reward
            self.stats.turns += 1
        ep.pending = None
        ep.observation, ep.anchor_key, ep.potential = r.observation, r.anchor_key, r.potential
        max_turns = ep.request.max_turns or self.cfg.max_turns
        if r.kind == "step" and (r.terminated or r.truncated):
            ep.success, ep.terminated, ep.truncated = r.success, r.terminated, r.truncated
            ep.reason = "env" if r.truncated else None
            self._finish(ep)
        elif len(ep.turns) >= max_turns:
            ep.truncated, ep.reason = True, "max_turns"
            self._finish(ep)
        else:
            try:
                cut = ep.ctx.observe(ep.observation)
            except ContextOverflow:
                ep.truncated, ep.reason = True, "context_budget"
                self._finish(ep)
                return
            ep.pending = (None, False, cut, None, None)
            ep.awaiting_action = True

    def _finish(self, ep: _Episode) -> None:
        ep.done, ep.awaiting_action = True, False
        self.stats.finished_episodes += ep.failure is None
        self.stats.infra_failures += ep.failure is not None
        self.stats.resumed_steps += ep.resumed_steps
        del self.by_slot[ep.slot]
        self.free_slots.append(ep.slot)

    def _generate(self, eps: list[_Episode]) -> None:
        prompts = [e.ctx.prompt() for e in eps]
        t0 = time.perf_counter()
        gens = sample(
            self.policy.model, prompts, max_new_tokens=self.cfg.max_new_tokens, stop_ids=self.policy.stop_ids,
            pad_id=self.policy.pad_id, temperature=self.cfg.temperature, generator=self.generator,
        )
        self.stats.generation_seconds += time.perf_counter() - t0
        self.stats.generation_calls += 1
        self.stats.batch_sizes.append(len(eps))
        texts = self.policy.tokenizer.batch_decode([g.ids for g in gens], skip_special_tokens=True)
        for e, g, text in zip(eps, gens, texts):
            e.ctx.act(g.ids, g.logprobs, self.version)
            e.min_version = self.version if e.min_version is None else min(e.min_version, self.version)
            self.stats.generated_tokens += len(g.ids)
            e.pending = (text, not g.stopped, e.pending[2], e.anchor_key, e.potential)
            e.awaiting_action = False
        self.backend.send_step([e.slot for e in eps], list(texts))

    def tick(self, wait: float | None = None) -> None:
        """One scheduling round: admit, collect ready env results, generate, send.
        Waits up to ``wait`` seconds (None: until one result) only when nothing can act."""
        self._schedule()
        self._step(wait)

    def _schedule(self) -> bool:
        """Apply new weights, restart stale groups, admit new ones; False when nothing runs."""
        with self._lock:
            self._apply_pending_weights()
            if self.partial:
                self._restart_stale()
            self._admit()
            return bool(self.by_slot)

    def _step(self, wait: float | None) -> None:
        """Collect env results and generate the next actions. Env waits and generation run
        without the lock (the trainer can take batches meanwhile); state changes under it."""
        with self._lock:
            running = list(self.by_slot.values())
            ready = [e for e in running if e.awaiting_action]
            in_flight = sum(not e.awaiting_action for e in running)
        if self.lockstep and in_flight:
            ready = []  # the synchronous baseline waits for every env of the batch
        results = self.backend.recv(1, timeout=0.0005 if ready else wait) if in_flight else []
        with self._lock:
            for r in results:
                self._on_result(r)
            running = list(self.by_slot.values())
            ready = [e for e in running if e.awaiting_action]
            if self.lockstep and any(not e.awaiting_action for e in running):
                ready = []
            self._lock.notify_all()
        if ready:
            self._generate(ready)

    # ------------------------------------------------------------------ the trainer's side
    def _consumable(self) -> list[_Group] | None:
        order = sorted(self.groups)
        if not self.partial:
            head = order[: self.groups_per_batch]
            if len(head) == self.groups_per_batch and all(self.groups[k].done for k in head):
                return [self.groups[k] for k in head]
            return None
        done = [self.groups[k] for k in order if self.groups[k].done and (self._oldest(self.groups[k]) or 0) <= self.controller.eta]
        return done[: self.groups_per_batch] if len(done) >= self.groups_per_batch else None

    def _oldest(self, g: _Group) -> int | None:
        """Trainer steps since the version of the group's oldest sampled token."""
        versions = [e.min_version for e in g.episodes if e.min_version is not None]
        return None if not versions else self.controller.version - (min(versions) - self._version0)

    def _restart_stale(self) -> None:
        """partial_rollouts: restart groups whose oldest token is already more than eta
        versions old (they could never be trained within the bound), once none of their
        envs has a request in flight and enough env slots are free."""
        for g in self.groups.values():
            age = self._oldest(g)
            if age is None or age <= self.controller.eta:
                continue
            if any(not e.done and not e.awaiting_action for e in g.episodes):
                continue  # a reset/step is in flight; check again after it returns
            running = [e for e in g.episodes if not e.done]
            if len(self.free_slots) + len(running) < len(g.episodes):
                continue
            self.stats.stale_restarts += 1
            for e in running:
                del self.by_slot[e.slot]
                self.free_slots.append(e.slot)
            g.episodes = [self._new_episode(e.request, g.index) for e in g.episodes]
            g.start_version = self.version
            self.backend.send_reset([e.slot for e in g.episodes], [e.request.env_seed for e in g.episodes],
                                    [e.request.task for e in g.episodes])

    def _pop(self, groups: list[_Group]) -> GroupBatch:
        version = self.controller.version
        trajs, staleness = [], []
        for g in groups:
            del self.groups[g.index]
            for e in g.episodes:
                trajs.append(self._trajectory(e))
                if e.min_version is not None:
                    staleness.append(version - (e.min_version - self._version0))
        self.consumed += len(groups)
        return GroupBatch(trajs, staleness, version)

    def take(self, timeout: float | None = None) -> GroupBatch:
        """The next trainer batch: ``groups_per_batch`` whole groups. Drives the engine
        inline when no background thread runs; otherwise waits for the thread."""
        if self._thread is None:
            while (ready := self._consumable()) is None:
                if not self.by_slot and not self._can_admit() and self._consumable() is None:
                    raise RuntimeError("the rollout engine cannot produce another batch (max_groups reached?)")
                self.tick()
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
        """The trainer finished a step: new weights (None when the engine shares the
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
            self.policy.model.load_state_dict(state_dict)
        self.policy.version = self.version = version

    # ------------------------------------------------------------------ background thread
    def start(self) -> None:
        """Run the scheduling loop in a background thread (the rollout worker)."""
        if self._thread is not None:
            raise RuntimeError("the rollout engine already runs")
        self._thread = threading.Thread(target=self._loop, name="turnforge-rollout", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop:
                if not self._schedule():  # nothing may start (staleness bound) and nothing runs
                    with self._lock:
                        self._lock.wait(timeout=0.01)
                    continue
                self._step(wait=0.05)
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

    # ------------------------------------------------------------------ records
    def _trajectory(self, e: _Episode) -> Trajectory:
        samples = tuple(e.ctx.finish())
        return Trajectory(
            trajectory_id=e.request.trajectory_id, task=e.request.task, group_id=e.request.group_id,
            env_seed=e.request.env_seed, turns=tuple(e.turns), samples=samples, episode_return=e.ret,
            success=e.success, terminated=e.terminated, truncated=e.truncated, truncation_reason=e.reason,
            policy_version=e.min_version if e.min_version is not None else self.version,
            infra_failure=e.failure, resumed_steps=e.resumed_steps,
        )
