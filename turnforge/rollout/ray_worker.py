"""The rollout worker as a Ray actor (``cluster=ray``): the trainer stays in the driver
process; the engine, its copy of the policy and its envs live in the actor.

The actor receives the policy once (pickled through Ray's object store: model, tokenizer
and chat format, so no shared filesystem is needed) and then only state dicts with a
version (``set_weights``, also through the object store). It runs a ``GroupStream`` over its
own ``RolloutEngine`` (asynchronous: a background thread, so generation continues while the
trainer updates; synchronous: lock-step, driven by ``take``); ``take`` blocks until the next
batch of whole groups is ready. Its env backend comes from ``make_backend`` like every other:
with ``engine.env_workers > 0`` the envs are Ray actors too (``RayEnvPool``), placed by Ray's
scheduler anywhere in the cluster.

Multi-node: start a head (``ray start --head --port=6379``) and workers (``ray start
--address=HEAD:6379``), then train with ``cluster=ray engine.ray_address=HEAD:6379`` (or
``auto`` on a cluster node). Every node needs turnforge installed (same version).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from turnforge.config import EngineConfig, RolloutConfig
from turnforge.envpool import PoolStats, make_backend
from turnforge.envs import make
from turnforge.policy.model import Policy
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import RolloutEngine
from turnforge.rollout.groups import GroupBatch, GroupStream


@dataclass(frozen=True)
class WorkerStats:
    """What the rollout worker reports after each batch (``RolloutWorker.stats``)."""

    turns: int  # env steps the engine ran so far, episodes still running or discarded included
    stale_restarts: int
    batch_sizes: tuple[int, ...]  # episodes per generation call (the last 200)
    pool: PoolStats


class RolloutWorker:
    """The body of the Ray actor (plain class, so it is testable without Ray)."""

    def __init__(
        self,
        policy: Policy,
        rollout_cfg: RolloutConfig,
        engine_cfg: EngineConfig,
        env_id: str,
        env_kwargs: dict,
        make_group: Callable,
        *,
        group_size: int,
        groups_per_batch: int,
        num_envs: int,
        seed: int,
        lockstep: bool,
        keep_snapshots: bool = False,
        generator_for: Callable[[int], torch.Generator] | None = None,
        threads: int = 1,
    ) -> None:
        torch.set_num_threads(threads)
        policy.model.eval()
        backend = make_backend(env_id, env_kwargs, num_envs, engine_cfg, on_ray=True)
        self.engine = RolloutEngine(backend, rollout_cfg, policy, make(env_id, **env_kwargs))
        actor = PolicyActor(policy, rollout_cfg.max_new_tokens, rollout_cfg.temperature, torch.Generator().manual_seed(seed))
        self.stream = GroupStream(
            self.engine, actor, make_group, group_size=group_size, groups_per_batch=groups_per_batch, eta=engine_cfg.eta,
            lockstep=lockstep, partial_rollouts=engine_cfg.partial_rollouts, keep_snapshots=keep_snapshots,
            generator_for=generator_for,
        )
        if not lockstep:
            self.stream.start()

    def take(self) -> GroupBatch:
        return self.stream.take()

    def set_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.stream.set_weights(state_dict, version)

    def stats(self) -> WorkerStats:
        st = self.engine.stats
        return WorkerStats(st.turns, self.stream.stale_restarts, tuple(st.batch_sizes), self.engine.backend.stats())

    def close(self) -> None:
        self.stream.stop()
        self.engine.close()


def remote_worker(num_cpus: float = 1.0):
    """The Ray actor class of ``RolloutWorker`` (``max_concurrency=2``: ``set_weights`` gets
    through while a ``take`` waits)."""
    import ray

    return ray.remote(num_cpus=num_cpus, max_concurrency=2)(RolloutWorker)
