"""Where the RL trainer's episodes come from: ``SyncRollouts`` (the lock-step runner) or
``EngineRollouts`` (the per-trajectory engine, optionally in a background rollout worker).

Both hand out the same thing per iteration: the trajectories of ``tasks_per_iteration``
groups of G episodes, and counters to log. Group ``k`` (in admission order) is task ``k %
tasks_per_iteration`` of iteration ``k // tasks_per_iteration`` with the same env seeds in
both, so synchronous and asynchronous runs see the same task sequence.

``engine.mode=sync`` with ``engine.env_workers=0`` is the deterministic default: the
runner plays in the trainer's process. With env workers, ``sync`` runs the engine in
lock-step over an ``EnvPool`` (the fair synchronous baseline for slow envs). ``async`` runs
the engine in a rollout worker thread with its own copy of the policy; the trainer hands it
new weights after every update (``after_update``), and the engine bounds staleness by
``engine.eta``. With ``cluster=ray`` env workers are Ray actors (``RayEnvPool``).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from turnforge.envpool import pool_from_config
from turnforge.envs import make, make_batch
from turnforge.envs.base import stable_hash
from turnforge.rollout.context import PromptSpec
from turnforge.rollout.engine import GroupBatch, InlineEnvs, RolloutEngine
from turnforge.rollout.runner import EpisodeRequest, PolicyActor, RolloutStats, rollout
from turnforge.train.common import generator, rng
from turnforge.train.session import Session
from turnforge.types import Trajectory


@dataclass
class RolloutBatch:
    """One iteration's episodes and what to log about how they were made."""

    trajectories: list[Trajectory]
    stats: RolloutStats
    env_steps: int  # env steps of these trajectories (the run's env-step budget counts what it trains on)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class GroupMaker:
    """The G episode requests of group ``k``: task ``k % T`` of iteration ``k // T``
    (offset by ``start_group``), with the sync runner's env seeds and ids. Picklable, so a
    Ray rollout worker builds the same groups."""

    env_id: str
    env_kwargs: dict
    seed: int
    tasks_per_iteration: int
    group_size: int
    start_group: int = 0
    _env: object = field(default=None, repr=False)

    def __call__(self, k: int) -> list[EpisodeRequest]:
        if self._env is None:
            self._env = make(self.env_id, **self.env_kwargs)
        it, j = divmod(self.start_group + k, self.tasks_per_iteration)
        task_index = int(rng(self.seed, "rl-tasks", it).integers(0, 2**31 - 1, self.tasks_per_iteration)[j])
        task = self._env.task("train", task_index)
        return [
            EpisodeRequest(task, stable_hash(self.seed, "rl", it, j, g), f"{it}-{j}", f"rl-{it}-{j}-{g}")
            for g in range(self.group_size)
        ]

    @classmethod
    def of(cls, s: Session, start_group: int = 0) -> "GroupMaker":
        cfg, rl = s.cfg, s.cfg.rl
        return cls(cfg.env.id, dict(cfg.env.kwargs), cfg.seed, rl.tasks_per_iteration, rl.group_size, start_group)


def stats_of(trajs: list[Trajectory]) -> RolloutStats:
    """Budget counters of finished trajectories (the engine's view of ``RolloutStats``)."""
    return RolloutStats(
        episodes=len(trajs),
        turns=sum(t.num_turns for t in trajs),
        obs_truncations=sum(tn.obs_truncated_tokens > 0 for t in trajs for tn in t.turns),
        context_overflows=sum(t.truncation_reason == "context_budget" for t in trajs),
        generation_truncations=sum(tn.generation_truncated for t in trajs for tn in t.turns),
        history_dropped=0,
        infra_failures=sum(t.infra_failure is not None for t in trajs),
        generated_tokens=sum(int(x.num_action_tokens) for t in trajs for x in t.samples),
    )


def env_slots(cfg) -> int:
    """Envs the engine keeps busy: ``engine.env_slots``, or enough for every trajectory the
    staleness bound lets run at once, ``(eta + 1)`` iterations' worth."""
    return cfg.engine.env_slots or (cfg.engine.eta + 1) * cfg.rl.tasks_per_iteration * cfg.rl.group_size


class _Source:
    def after_update(self) -> None:
        """The trainer updated the policy (weight sync for rollout workers)."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _TrainerClock:
    """Trainer-side counters of an engine: time spent waiting for batches."""

    def __init__(self) -> None:
        self.started, self.total_wait, self.last_wait = time.perf_counter(), 0.0, 0.0

    def waited(self, seconds: float) -> None:
        self.last_wait = seconds
        self.total_wait += seconds

    def batch(self, batch: GroupBatch, eta: int, turns: int, stale_restarts: int, batch_sizes: list[int],
              pool: dict | None) -> RolloutBatch:
        """The ``RolloutBatch`` of an engine batch, with staleness, idle and pool metrics."""
        metrics: dict[str, float] = {
            "env_steps_executed": float(turns),  # by the engine so far, running and discarded episodes included
            "trainer_wait_seconds": round(self.last_wait, 3),
            "trainer_idle_ratio": self.total_wait / max(time.perf_counter() - self.started, 1e-9),
            "stale_restarts": float(stale_restarts),
            "resumed_steps": float(sum(t.resumed_steps for t in batch.trajectories)),
            "mean_generation_batch": float(np.mean(batch_sizes)) if batch_sizes else 0.0,
        }
        if batch.staleness:
            ages = np.asarray(batch.staleness)
            metrics.update(staleness_mean=float(ages.mean()), staleness_max=float(ages.max()))
            for a in range(eta + 1):
                metrics[f"staleness_{a}"] = float((ages == a).mean())
        if pool is not None:
            metrics.update(env_utilization=pool["env_utilization"], env_pool_steps_per_s=pool["steps_per_s"],
                           env_worker_restarts=float(pool["restarts"]),
                           env_timeouts=float(pool["timeouts"]), env_failed=float(pool["failed"]))
        stats = stats_of(batch.trajectories)
        return RolloutBatch(batch.trajectories, stats, stats.turns, metrics)


class SyncRollouts(_Source):
    """The lock-step runner in the trainer's process (deterministic)."""

    def __init__(self, s: Session, keep_snapshots: bool) -> None:
        self.s, self.keep_snapshots = s, keep_snapshots
        self.groups = GroupMaker.of(s)

    def next(self, it: int) -> RolloutBatch:
        s, rl = self.s, self.s.cfg.rl
        requests = [r for j in range(rl.tasks_per_iteration) for r in self.groups(it * rl.tasks_per_iteration + j)]
        actor = PolicyActor(s.policy, s.cfg.rollout.max_new_tokens, s.cfg.rollout.temperature, generator(s.cfg.seed, "rl-sample", it))
        trajs, stats = rollout(actor, s.envs, requests, s.cfg.rollout, s.policy, keep_snapshots=self.keep_snapshots)
        return RolloutBatch(trajs, stats, stats.turns)


class EngineRollouts(_Source):
    """The per-trajectory engine: lock-step over env workers (``sync``) or in a rollout
    worker thread with bounded staleness (``async``)."""

    def __init__(self, s: Session) -> None:
        cfg, eng, rl = s.cfg, s.cfg.engine, s.cfg.rl
        self.s, self.is_async = s, eng.mode == "async"
        slots = env_slots(cfg)
        self.pool = None
        if eng.env_workers > 0:
            self.pool = pool_from_config(eng, cfg.env.id, dict(cfg.env.kwargs), slots, on_ray=cfg.cluster == "ray")
            backend = self.pool
        else:
            backend = InlineEnvs(make_batch(cfg.env.id, slots, **cfg.env.kwargs))
        policy = s.policy
        if self.is_async:  # the rollout worker's own copy: the trainer updates its weights in place
            policy = copy.deepcopy(s.policy)
            policy.model.eval()
        self.engine = RolloutEngine(
            policy, backend, cfg.rollout, GroupMaker.of(s, s.state.iteration * rl.tasks_per_iteration),  # resume goes on
            group_size=rl.group_size, groups_per_batch=rl.tasks_per_iteration, eta=eng.eta,
            generator=generator(cfg.seed, "rl-engine", s.state.iteration), lockstep=not self.is_async,
            partial_rollouts=eng.partial_rollouts, prompt=PromptSpec.of(s.envs[0], s.cfg.rollout.include_instructions),
        )
        self.clock = _TrainerClock()
        if self.is_async:
            self.engine.start()

    def next(self, it: int) -> RolloutBatch:
        t0 = time.perf_counter()
        batch = self.engine.take()
        self.clock.waited(time.perf_counter() - t0)
        st = self.engine.stats
        pool = asdict(self.pool.stats()) if self.pool is not None else None
        return self.clock.batch(batch, self.s.cfg.engine.eta, st.turns, st.stale_restarts, st.batch_sizes[-200:], pool)

    def after_update(self) -> None:
        """Weight sync: the rollout worker gets a copy of the new weights and version."""
        p = self.s.policy
        weights = {k: v.detach().clone() for k, v in p.model.state_dict().items()} if self.is_async else None
        self.engine.set_weights(weights, p.version)

    def close(self) -> None:
        self.engine.stop()
        if self.pool is not None:
            self.pool.close()


class RayRollouts(_Source):
    """``cluster=ray``: the rollout worker is a Ray actor (``turnforge.rollout.ray_worker``);
    the trainer stays here and ships each update's weights through Ray's object store."""

    def __init__(self, s: Session) -> None:
        import ray

        from turnforge.envpool.ray_pool import connect_ray
        from turnforge.rollout.ray_worker import remote_worker

        cfg, eng, rl = s.cfg, s.cfg.engine, s.cfg.rl
        connect_ray(eng.ray_address)
        self.s, self.ray = s, ray
        slots = env_slots(cfg)
        self.worker = remote_worker(num_cpus=1.0).remote(
            ray.put(s.policy), cfg.rollout, eng, cfg.env.id, dict(cfg.env.kwargs),
            GroupMaker.of(s, s.state.iteration * rl.tasks_per_iteration),
            group_size=rl.group_size, groups_per_batch=rl.tasks_per_iteration, num_envs=slots,
            seed=stable_hash(cfg.seed, "rl-engine", s.state.iteration), threads=1,
        )
        self.clock = _TrainerClock()

    def next(self, it: int) -> RolloutBatch:
        t0 = time.perf_counter()
        batch = self.ray.get(self.worker.take.remote())
        self.clock.waited(time.perf_counter() - t0)
        st = self.ray.get(self.worker.stats.remote())
        pool = st.get("pool")
        return self.clock.batch(batch, self.s.cfg.engine.eta, st["turns"], st["stale_restarts"], st["batch_sizes"], pool)

    def after_update(self) -> None:
        p = self.s.policy
        weights = self.ray.put({k: v.detach().clone() for k, v in p.model.state_dict().items()})
        self.worker.set_weights.remote(weights, p.version)

    def close(self) -> None:
        try:
            self.ray.get(self.worker.close.remote(), timeout=30)
        finally:
            self.ray.kill(self.worker)


def make_rollouts(s: Session, keep_snapshots: bool) -> SyncRollouts | EngineRollouts | RayRollouts:
    eng = s.cfg.engine
    if s.cfg.cluster == "ray":
        return RayRollouts(s)
    if eng.mode == "sync" and eng.env_workers == 0:
        return SyncRollouts(s, keep_snapshots)
    return EngineRollouts(s)
