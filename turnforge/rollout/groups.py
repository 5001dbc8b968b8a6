"""Whole groups of G episodes for the RL trainer, from one rollout engine: ``GroupStream``.

``make_group(k)`` gives the G episode requests of the k-th admitted group; ``groups_per_batch``
groups make one trainer batch (``take``). Two modes over the engine's public episode API
(``launch``, ``round``, ``trajectory``, ``abandon``):

- lock-step (``lockstep=True``, synchronous RL): a batch is admitted once the previous one is
  taken and played in lock-step rounds, each batch with the generator ``generator_for(b)``, so
  a resumed or re-run iteration draws the same tokens on any env backend;
- asynchronous (a background rollout thread, ``start``): admission under the
  ``StalenessController`` (``floor((N_r - 1) / B) <= version + eta``), continuous batching of
  generation at turn granularity, weights switched between generation calls (an episode
  running across an update continues with the new weights: APRIL's partial rollouts at turn
  granularity); with ``partial_rollouts`` the trainer takes the oldest completed groups and a
  group whose oldest token would exceed ``eta`` is restarted (``stale_restarts``).

Departures: an in-flight generation call is not aborted token-wise when new weights arrive;
weight sync is a ``load_state_dict`` into the stream's own policy copy
(``turnforge.rollout.ray_worker`` ships it through Ray).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import Episode, EpisodeRequest, RolloutEngine, RolloutStats, rollout_stats
from turnforge.rollout.staleness import StalenessController
from turnforge.types import Trajectory


@dataclass
class _Group:
    index: int
    episodes: list[Episode]

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
        return self.engine.lock

    # ------------------------------------------------------------------ scheduling
    def _can_admit(self) -> bool:
        if self.max_groups is not None and self.admitted >= self.max_groups:
            return False
        if self.engine.free_envs < self.group_size:
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
            episodes = [self.engine.launch(req, self.actor, self.keep_snapshots) for req in self.make_group(k)]
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
            if engine.free_envs + len(running) < len(g.episodes):
                continue
            self.stale_restarts += 1
            for e in running:
                engine.abandon(e)
            g.episodes = [engine.launch(e.request, self.actor, self.keep_snapshots) for e in g.episodes]

    def _pop(self, groups: list[_Group]) -> GroupBatch:
        version = self.controller.version
        trajs, staleness, episodes = [], [], []
        for g in groups:
            del self.groups[g.index]
            for e in g.episodes:
                trajs.append(self.engine.trajectory(e))
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
            return self.engine.running > 0

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
