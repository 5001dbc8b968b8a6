"""Parallel env execution: ``EnvPool`` runs N text envs on M worker processes, with an
asynchronous send/recv API, crash/hang recovery from env snapshots, and metrics.
``RayEnvPool`` (same API, on Ray actors across machines) and ``connect_ray`` are imported
lazily, so importing this package does not import Ray."""

from typing import Any

from turnforge.envpool.pool import CpuBudgetExceeded, EnvPool, EnvResult, PoolStats, WorkerLimits

__all__ = ["CpuBudgetExceeded", "EnvPool", "EnvResult", "PoolStats", "RayEnvPool", "WorkerLimits", "connect_ray", "pool_from_config"]


def pool_from_config(engine: Any, env_id: str, env_kwargs: dict, num_envs: int, on_ray: bool) -> Any:
    """The env pool a run's ``engine`` config section asks for: ``EnvPool`` (worker
    processes) or, ``on_ray``, ``RayEnvPool`` (actors); ``engine.env_workers`` workers."""
    kwargs = dict(step_timeout=engine.step_timeout, memory_limit_mb=engine.worker_memory_mb,
                  cpu_limit_s=engine.worker_cpu_seconds)
    if on_ray:
        from turnforge.envpool.ray_pool import RayEnvPool

        return RayEnvPool(env_id, num_envs, engine.env_workers, env_kwargs, address=engine.ray_address,
                          num_cpus=engine.ray_cpus_per_env_worker, **kwargs)
    return EnvPool(env_id, num_envs, engine.env_workers, env_kwargs, **kwargs)


def __getattr__(name: str) -> Any:
    if name in ("RayEnvPool", "connect_ray"):
        from turnforge.envpool import ray_pool

        return getattr(ray_pool, name)
    raise AttributeError(f"module 'turnforge.envpool' has no attribute {name!r}")
