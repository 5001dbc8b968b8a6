"""The rollout worker as a Ray actor (``cluster=ray``): the trainer stays in the driver
process; the engine, its copy of the policy and its envs live in the actor.

The actor receives the policy once (pickled through Ray's object store: model, tokenizer
and chat format, so no shared filesystem is needed) and then only state dicts with a
version (``set_weights``, also through the object store). It runs ``RolloutEngine`` in a
background thread, so generation continues while the trainer updates; ``take`` blocks
until the next batch of whole groups is ready. With ``env_workers > 0`` its envs are Ray
actors too (``RayEnvPool``), placed by Ray's scheduler anywhere in the cluster.

Multi-node: start a head (``ray start --head --port=6379``) and workers (``ray start
--address=HEAD:6379``), then train with ``cluster=ray engine.ray_address=HEAD:6379`` (or
``auto`` on a cluster node). Every node needs turnforge installed (same version).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

import torch

from turnforge.config import EngineConfig, RolloutConfig
from turnforge.envpool import pool_from_config
from turnforge.envs import make_batch
from turnforge.policy.model import Policy
from turnforge.rollout.context import PromptSpec
from turnforge.rollout.engine import GroupBatch, InlineEnvs, RolloutEngine


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
        threads: int = 1,
    ) -> None:
        torch.set_num_threads(threads)
        policy.model.eval()
        self.pool = None
        if engine_cfg.env_workers > 0:
            self.pool = pool_from_config(engine_cfg, env_id, env_kwargs, num_envs, on_ray=True)
            backend = self.pool
        else:
            backend = InlineEnvs(make_batch(env_id, num_envs, **env_kwargs))
        prompt = PromptSpec.of(make_batch(env_id, 1, **env_kwargs)[0], rollout_cfg.include_instructions)
        self.engine = RolloutEngine(
            policy, backend, rollout_cfg, make_group, group_size=group_size, groups_per_batch=groups_per_batch,
            eta=engine_cfg.eta, generator=torch.Generator().manual_seed(seed), partial_rollouts=engine_cfg.partial_rollouts,
            prompt=prompt,
        )
        self.engine.start()

    def take(self) -> GroupBatch:
        return self.engine.take()

    def set_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.engine.set_weights(state_dict, version)

    def stats(self) -> dict[str, Any]:
        st = self.engine.stats
        out: dict[str, Any] = {"turns": st.turns, "stale_restarts": st.stale_restarts,
                               "batch_sizes": st.batch_sizes[-200:]}
        if self.pool is not None:
            out["pool"] = asdict(self.pool.stats())
        return out

    def close(self) -> None:
        self.engine.stop()
        if self.pool is not None:
            self.pool.close()


def remote_worker(num_cpus: float = 1.0):
    """The Ray actor class of ``RolloutWorker`` (``max_concurrency=2``: ``set_weights`` gets
    through while a ``take`` waits)."""
    import ray

    return ray.remote(num_cpus=num_cpus, max_concurrency=2)(RolloutWorker)
