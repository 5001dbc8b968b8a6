"""Where envs run: the env backends behind one API, and the one factory that builds them.

- ``InlineEnvs``: envs in this process (``engine.env_workers=0``);
- ``EnvPool``: N envs on M worker processes, with crash/hang recovery from env snapshots;
- ``RayEnvPool``: the same on Ray actors across machines (``cluster=ray``).

All three run requests with the same ``EnvHost`` (``turnforge.envpool.host``) and answer the
same calls: ``send_reset``/``send_restore``/``send_step`` (non-blocking; ``priorities``: lower
first where requests wait for a worker), ``recv``, ``stats``, ``close``. ``make_backend`` is
how every caller (the rollout engine's sources: evaluation, demonstrations, RL, Monte-Carlo
rollouts) gets one. ``RayEnvPool`` and ``connect_ray`` are
imported lazily, so importing this package imports neither Ray nor torch (worker processes
import it).
"""

from typing import Any, Protocol, Sequence

from turnforge.envpool.host import AfterState, CpuBudgetExceeded, EnvResult, Probe, WorkerLimits
from turnforge.envpool.inline import InlineEnvs
from turnforge.envpool.pool import EnvPool, PoolStats

__all__ = [
    "AfterState", "CpuBudgetExceeded", "EnvBackend", "EnvPool", "EnvResult", "InlineEnvs", "PoolStats", "Probe",
    "RayEnvPool", "WorkerLimits", "connect_ray", "make_backend",
]


class EnvBackend(Protocol):
    """What the rollout engine needs of an env backend (see the module docstring)."""

    num_envs: int

    def send_reset(self, env_ids: Sequence[int], seeds: Sequence[int | None] | None = None,
                   tasks: Sequence[Any] | None = None, probes: Sequence[Probe] | None = None,
                   priorities: Sequence[int] | None = None) -> None: ...

    def send_restore(self, env_ids: Sequence[int], snapshots: Sequence[Any], reseeds: Sequence[int | None] | None = None,
                     probes: Sequence[Probe] | None = None, priorities: Sequence[int] | None = None) -> None: ...

    def send_step(self, env_ids: Sequence[int], action_texts: Sequence[str], probes: Sequence[Probe] | None = None,
                  priorities: Sequence[int] | None = None) -> None: ...

    def recv(self, batch_size: int = 1, timeout: float | None = None) -> list[EnvResult]: ...

    def stats(self) -> PoolStats: ...

    def close(self) -> None: ...


def make_backend(env_id: str, env_kwargs: dict, num_envs: int, engine: Any, *, on_ray: bool = False,
                 workers: int | None = None) -> EnvBackend:
    """The env backend a run's config asks for: ``InlineEnvs`` with 0 workers, else ``EnvPool``
    (worker processes) or, ``on_ray``, ``RayEnvPool`` (actors). ``engine`` is the run's
    ``EngineConfig`` (workers, timeouts, limits, Ray address); ``workers`` overrides
    ``engine.env_workers``."""
    workers = engine.env_workers if workers is None else workers
    if workers == 0:
        return InlineEnvs(env_id, num_envs, env_kwargs)
    kwargs = dict(step_timeout=engine.step_timeout, memory_limit_mb=engine.worker_memory_mb,
                  cpu_limit_s=engine.worker_cpu_seconds)
    if on_ray:
        from turnforge.envpool.ray_pool import RayEnvPool

        return RayEnvPool(env_id, num_envs, workers, env_kwargs, address=engine.ray_address,
                          num_cpus=engine.ray_cpus_per_env_worker, resources=dict(engine.ray_env_resources), **kwargs)
    return EnvPool(env_id, num_envs, workers, env_kwargs, **kwargs)


def __getattr__(name: str) -> Any:
    if name in ("RayEnvPool", "connect_ray"):
        from turnforge.envpool import ray_pool

        return getattr(ray_pool, name)
    raise AttributeError(f"module 'turnforge.envpool' has no attribute {name!r}")
