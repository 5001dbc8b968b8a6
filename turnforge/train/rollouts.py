"""Where the RL trainer's episodes come from: a ``GroupStream`` of the rollout engine.

Every source hands out the same thing per iteration: the trajectories of
``tasks_per_iteration`` groups of G episodes, their counters, and engine metrics to log.
Group ``k`` (in admission order) is task ``k % tasks_per_iteration`` of iteration
``k // tasks_per_iteration``, with the same env seeds in every mode, so synchronous and
asynchronous runs see the same task sequence.

- ``engine.mode=sync`` (``LocalRollouts``, lock-step): the run's own engine plays each
  iteration's groups with the trainer's policy, sampling from a generator seeded by the
  iteration. The tokens do not depend on the env backend: in-process envs and
  ``engine.env_workers`` worker processes give the same run.
- ``engine.mode=async`` (``LocalRollouts``, a rollout thread): a second engine, on its own
  env backend (``engine.env_slots`` envs), with its own copy of the policy; the trainer
  hands it new weights after every update (``after_update``) and it bounds staleness by
  ``engine.eta``.
- ``cluster=ray`` (``RayRollouts``): the same stream in a Ray actor
  (``turnforge.rollout.ray_worker``), weights shipped through Ray's object store.
- ``agent.entrypoint`` (``AgentRollouts``): agent programs through the gateway.

With a judge (``reward.judge.enabled``, ``agent.reward=judge``), ``JudgedRollouts`` wraps the
source: a judge model replaces each episode's outcome reward before credit assignment.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from turnforge.dist import gather, summed, world
from turnforge.envpool import PoolStats
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest, RolloutStats, make_engine
from turnforge.rollout.groups import GroupBatch, GroupStream
from turnforge.seeding import generator, rng, stable_hash
from turnforge.train.metrics import StreamStats
from turnforge.train.session import Session
from turnforge.types import Trajectory


@dataclass
class RolloutBatch:
    """One iteration's episodes and what to log about how they were made."""

    trajectories: list[Trajectory]
    stats: RolloutStats
    env_steps: int  # env steps of these trajectories (the run's env-step budget counts what it trains on)
    stream: StreamStats


@dataclass
class GroupMaker:
    """The G episode requests of group ``k``: task ``k % T`` of iteration ``k // T``
    (offset by ``start_group``). Picklable, so a Ray rollout worker builds the same groups."""

    env_id: str
    env_kwargs: dict
    tasks_file: str | None
    heldout_fraction: float | None
    seed: int
    tasks_per_iteration: int
    group_size: int
    start_group: int = 0  # in this rank's groups
    rank: int = 0  # on several trainer ranks, rank r plays tasks r, r + ranks, ... of each iteration
    ranks: int = 1
    _env: object = field(default=None, repr=False)

    def __call__(self, k: int) -> list[EpisodeRequest]:
        if self._env is None:
            from turnforge.envs.registry import build_env

            self._env = build_env(self.env_id, self.env_kwargs, self.tasks_file, self.heldout_fraction)
        it, mine = divmod(self.start_group + k, self.tasks_per_iteration // self.ranks)
        j = mine * self.ranks + self.rank
        task_index = int(rng(self.seed, "rl-tasks", it).integers(0, 2**31 - 1, self.tasks_per_iteration)[j])
        task = self._env.task("train", task_index)
        return [
            EpisodeRequest(task, stable_hash(self.seed, "rl", it, j, g), f"{it}-{j}", f"rl-{it}-{j}-{g}")
            for g in range(self.group_size)
        ]

    @classmethod
    def of(cls, s: Session, start_iteration: int = 0) -> "GroupMaker":
        """This rank's groups from iteration ``start_iteration`` on."""
        cfg, rl, w = s.cfg, s.cfg.rl, world()
        return cls(cfg.env.id, dict(cfg.env.kwargs), cfg.env.tasks, cfg.env.heldout_fraction, cfg.seed,
                   rl.tasks_per_iteration, rl.group_size, start_iteration * rl.tasks_per_iteration // w.size, w.rank, w.size)


def env_slots(cfg) -> int:
    """Envs the asynchronous rollout worker keeps busy: ``engine.env_slots``, or enough for
    every trajectory the staleness bound lets run at once, ``(eta + 1)`` iterations' worth."""
    return cfg.engine.env_slots or (cfg.engine.eta + 1) * cfg.rl.tasks_per_iteration * cfg.rl.group_size


class _TrainerClock:
    """Trainer-side counters of a stream: time spent waiting for batches."""

    def __init__(self) -> None:
        self.started, self.total_wait, self.last_wait = time.perf_counter(), 0.0, 0.0

    def waited(self, seconds: float) -> None:
        self.last_wait = seconds
        self.total_wait += seconds

    def batch(self, batch: GroupBatch, eta: int, turns: int, stale_restarts: int, batch_sizes: list[int] | tuple[int, ...],
              pool: PoolStats | None) -> RolloutBatch:
        """The ``RolloutBatch`` of a group batch, with staleness, idle and pool figures."""
        ages = np.asarray(batch.staleness)
        stream = StreamStats(
            env_steps_executed=turns,
            trainer_wait_seconds=round(self.last_wait, 3),
            trainer_idle_ratio=self.total_wait / max(time.perf_counter() - self.started, 1e-9),
            stale_restarts=stale_restarts,
            resumed_steps=sum(t.resumed_steps for t in batch.trajectories),
            mean_generation_batch=float(np.mean(batch_sizes)) if batch_sizes else 0.0,
            staleness_mean=float(ages.mean()) if len(ages) else None,
            staleness_max=int(ages.max()) if len(ages) else None,
            staleness_shares=tuple(float((ages == a).mean()) for a in range(eta + 1)) if len(ages) else (),
            env_pool=pool,
        )
        return RolloutBatch(batch.trajectories, batch.stats, batch.stats.turns, stream)


class _Source:
    def after_update(self) -> None:
        """The trainer updated the policy (weight sync for rollout workers)."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalRollouts(_Source):
    """A group stream in this process: lock-step on the run's engine (``sync``), or a rollout
    thread on an engine of its own (``async``)."""

    def __init__(self, s: Session, keep_snapshots: bool) -> None:
        cfg, eng, rl = s.cfg, s.cfg.engine, s.cfg.rl
        self.s, self.is_async = s, eng.mode == "async"
        start_it = s.state.iteration  # a resumed run goes on with the next iteration's groups and generator
        groups = GroupMaker.of(s, start_it)
        if self.is_async:  # the rollout worker's own engine and policy copy: the trainer updates its weights in place
            policy = copy.deepcopy(s.policy)
            policy.model.eval()
            if policy.sampler is not None and hasattr(policy.sampler, "push"):  # inference replicas: one push per version
                from turnforge.inference.client import copies_weights_of

                copies_weights_of(policy.model, s.policy.model)
            self.engine = make_engine(cfg, policy, env_slots(cfg))
            actor = PolicyActor(policy, cfg.rollout.max_new_tokens, cfg.rollout.temperature,
                                generator(cfg.seed, "rl-engine", start_it),
                                episode_seed=cfg.episode_seed("rl-episode"))
        else:
            self.engine = s.rollout_engine
            actor = PolicyActor(s.policy, cfg.rollout.max_new_tokens, cfg.rollout.temperature,
                                _IterationGenerator(cfg.seed, start_it, world().rank)(0),  # reseeded per batch by generator_for
                                episode_seed=cfg.episode_seed("rl-episode"))
        self.stream = GroupStream(
            self.engine, actor, groups, group_size=rl.group_size, groups_per_batch=rl.tasks_per_iteration // world().size,
            eta=eng.eta, lockstep=not self.is_async, partial_rollouts=eng.partial_rollouts, keep_snapshots=keep_snapshots,
            generator_for=_IterationGenerator(cfg.seed, start_it, world().rank),
        )
        self.clock = _TrainerClock()
        if self.is_async:
            self.stream.start()

    def next(self, it: int) -> RolloutBatch:
        t0 = time.perf_counter()
        batch = self.stream.take()
        self.clock.waited(time.perf_counter() - t0)
        st = self.engine.stats
        return self.clock.batch(batch, self.s.cfg.engine.eta, st.turns, self.stream.stale_restarts, st.batch_sizes,
                                self.engine.pool_stats())

    def after_update(self) -> None:
        """Weight sync: the rollout thread gets a copy of the new weights and version."""
        p = self.s.policy
        weights = {k: v.detach().clone() for k, v in p.model.state_dict().items()} if self.is_async else None
        self.stream.set_weights(weights, p.version)

    def close(self) -> None:
        self.stream.stop()
        if self.is_async:
            self.engine.close()


class RayRollouts(_Source):
    """``cluster=ray``: the rollout worker is a Ray actor (``turnforge.rollout.ray_worker``);
    the trainer stays here and ships each update's weights through Ray's object store."""

    def __init__(self, s: Session, keep_snapshots: bool) -> None:
        import ray

        from turnforge.envpool.ray_pool import connect_ray
        from turnforge.rollout.ray_worker import remote_worker

        cfg, eng, rl = s.cfg, s.cfg.engine, s.cfg.rl
        connect_ray(eng.ray_address)
        self.s, self.ray = s, ray
        start_it = s.state.iteration
        lockstep = eng.mode == "sync"
        seed = cfg.seed
        self.worker = remote_worker(num_cpus=1.0).remote(
            ray.put(s.policy), cfg.rollout, eng, cfg.env.id, dict(cfg.env.kwargs),
            GroupMaker.of(s, start_it),
            group_size=rl.group_size, groups_per_batch=rl.tasks_per_iteration,
            num_envs=rl.tasks_per_iteration * rl.group_size if lockstep else env_slots(cfg),
            seed=stable_hash(seed, "rl-engine", start_it), lockstep=lockstep, keep_snapshots=keep_snapshots,
            generator_for=_IterationGenerator(seed, start_it), threads=1,
        )
        self.clock = _TrainerClock()

    def next(self, it: int) -> RolloutBatch:
        t0 = time.perf_counter()
        batch = self.ray.get(self.worker.take.remote())
        self.clock.waited(time.perf_counter() - t0)
        st = self.ray.get(self.worker.stats.remote())
        pool = st.pool if self.s.cfg.engine.env_workers > 0 else None
        return self.clock.batch(batch, self.s.cfg.engine.eta, st.turns, st.stale_restarts, st.batch_sizes, pool)

    def after_update(self) -> None:
        p = self.s.policy
        weights = self.ray.put({k: v.detach().clone() for k, v in p.model.state_dict().items()})
        done = self.worker.set_weights.remote(weights, p.version)
        if self.s.cfg.engine.mode == "sync":
            self.ray.get(done)  # lock-step: the next batch is sampled with these weights, not raced by them

    def close(self) -> None:
        try:
            self.ray.get(self.worker.close.remote(), timeout=30)
        finally:
            self.ray.kill(self.worker)


@dataclass(frozen=True)
class _IterationGenerator:
    """``generator(seed, "rl-sample", start + b)`` (on trainer rank r > 0, a stream of its own,
    ``(seed, "rl-sample", start + b, "rank", r)``), picklable for the Ray worker."""

    seed: int
    start: int
    rank: int = 0

    def __call__(self, b: int):
        if self.rank:
            return generator(self.seed, "rl-sample", self.start + b, "rank", self.rank)
        return generator(self.seed, "rl-sample", self.start + b)


class AgentRollouts(_Source):
    """``agent.entrypoint``: each iteration's groups are agent rollouts through the gateway
    (``turnforge.gateway.agents.AgentEngine``, the run's engine), G per task, tasks drawn as
    ``GroupMaker`` draws them; sampled with a generator seeded by the iteration."""

    def __init__(self, s: Session) -> None:
        from turnforge.gateway.agents import AgentEngine

        if not isinstance(s.engine, AgentEngine):
            raise TypeError(f"agent rollouts need the run's AgentEngine; the run's engine is a {type(s.engine).__name__}")
        self.s, self.engine, self.clock = s, s.engine, _TrainerClock()

    def next(self, it: int) -> RolloutBatch:
        cfg, rl, engine = self.s.cfg, self.s.cfg.rl, self.engine
        indices = rng(cfg.seed, "rl-tasks", it).integers(0, 2**31 - 1, rl.tasks_per_iteration)
        requests = [EpisodeRequest(engine.env.task("train", int(k)), stable_hash(cfg.seed, "rl", it, j, g), f"{it}-{j}",
                                   f"rl-{it}-{j}-{g}") for j, k in enumerate(indices) for g in range(rl.group_size)]
        actor = PolicyActor(self.s.policy, cfg.rollout.max_new_tokens, cfg.rollout.temperature, generator(cfg.seed, "rl-agent", it))
        trajs, stats = engine.play(requests, actor)
        sizes = engine.gateway.batch_sizes[-200:]
        stream = StreamStats(env_steps_executed=stats.turns, trainer_wait_seconds=0.0, trainer_idle_ratio=0.0,
                             stale_restarts=0, resumed_steps=0, mean_generation_batch=float(np.mean(sizes)) if sizes else 0.0)
        return RolloutBatch(trajs, stats, stats.turns, stream)


class JudgedRollouts(_Source):
    """Another source's batches with each episode's reward given by a judge model
    (``reward.judge.enabled`` or ``agent.reward=judge``; ``turnforge.rewards.judge``)."""

    def __init__(self, inner: _Source, judge) -> None:
        self.inner, self.judge = inner, judge

    def next(self, it: int) -> RolloutBatch:
        batch = self.inner.next(it)
        return dataclasses.replace(batch, trajectories=self.judge.apply(batch.trajectories))

    def after_update(self) -> None:
        self.inner.after_update()

    def close(self) -> None:
        self.inner.close()


class RankedRollouts(_Source):
    """On several trainer ranks (``turnforge.dist``): each rank plays its share of every
    iteration's groups on its own engine (``LocalRollouts``; ``GroupMaker`` deals tasks r, r +
    ranks, ... to rank r), and every rank gets the whole iteration, groups in task order as one
    rank would have them, counters summed: credit is assigned on the whole batch, so no group's
    advantages depend on where it was played."""

    def __init__(self, inner: _Source) -> None:
        self.inner = inner

    def next(self, it: int) -> RolloutBatch:
        parts = gather(self.inner.next(it))
        trajs = sorted((t for p in parts for t in p.trajectories), key=lambda t: int(t.group_id.split("-")[1]))
        stats = summed([p.stats for p in parts])
        env_steps = sum(p.env_steps for p in parts)
        stream = dataclasses.replace(parts[0].stream, env_steps_executed=sum(p.stream.env_steps_executed for p in parts))
        return RolloutBatch(trajs, stats, env_steps, stream)

    def after_update(self) -> None:
        self.inner.after_update()

    def close(self) -> None:
        self.inner.close()


def make_rollouts(s: Session, keep_snapshots: bool) -> _Source:
    cfg = s.cfg
    if world().distributed:  # on several ranks: each rank's own engine, synchronous (turnforge.app.rules); with
        # cluster=ray its env workers are Ray actors (engine.env_workers)
        return RankedRollouts(LocalRollouts(s, keep_snapshots))
    if cfg.agent.entrypoint is not None:
        source: _Source = AgentRollouts(s)
    elif cfg.cluster == "ray":
        source = RayRollouts(s, keep_snapshots)
    else:
        source = LocalRollouts(s, keep_snapshots)
    if cfg.reward.judge.enabled or (cfg.agent.entrypoint is not None and cfg.agent.reward == "judge"):
        from turnforge.rewards.judge import Judge

        source = JudgedRollouts(source, Judge.load(cfg.reward.judge, s.run.checkpoint("bc")))
    return source
