"""``InlineEnvs``: envs of this process behind the env-backend API (no worker processes)."""

from __future__ import annotations

import time
from collections import deque
from typing import Sequence

from turnforge.envpool.host import NO_PROBE, EnvHost, EnvResult, Probe
from turnforge.envpool.pool import PoolStats, per_env
from turnforge.envs.base import Env
from turnforge.envs.registry import make_batch
from turnforge.types import EnvSnapshot, Task


class InlineEnvs:
    """``num_envs`` envs of ``env_id`` in this process, answered by the same ``EnvHost`` as a
    worker's: a request runs when it is sent, so ``recv`` never waits. An env that raises
    gives a ``'failed'`` result."""

    def __init__(self, env_id: str, num_envs: int, env_kwargs: dict | None = None) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self._start(make_batch(env_id, num_envs, **(env_kwargs or {})))

    @classmethod
    def from_envs(cls, envs: Sequence[Env]) -> "InlineEnvs":
        """A backend over env objects built elsewhere (env id ``i`` is ``envs[i]``)."""
        if not envs:
            raise ValueError("InlineEnvs.from_envs needs at least one env")
        self = cls.__new__(cls)
        self._start(list(envs))
        return self

    def _start(self, envs: list[Env]) -> None:
        self.num_envs = len(envs)
        self.host = EnvHost(dict(enumerate(envs)))
        self._ready: deque[EnvResult] = deque()
        self._steps = self._resets = self._failed = 0
        self._busy, self._t_start = 0.0, time.perf_counter()

    def send_reset(self, env_ids: Sequence[int], seeds: Sequence[int | None] | None = None,
                   tasks: Sequence[Task | None] | None = None, probes: Sequence[Probe] | None = None,
                   priorities: Sequence[int] | None = None) -> None:  # each runs at once: no order to keep
        n = len(env_ids)
        for i, seed, task, probe in zip(env_ids, per_env(seeds, n), per_env(tasks, n), per_env(probes, n, NO_PROBE)):
            self._run(i, "reset", (seed, task, probe))

    def send_restore(self, env_ids: Sequence[int], snapshots: Sequence[EnvSnapshot],
                     reseeds: Sequence[int | None] | None = None, probes: Sequence[Probe] | None = None,
                     priorities: Sequence[int] | None = None) -> None:
        n = len(env_ids)
        for i, snap, reseed, probe in zip(env_ids, snapshots, per_env(reseeds, n), per_env(probes, n, NO_PROBE)):
            self._run(i, "restore", (snap, reseed, probe))

    def send_step(self, env_ids: Sequence[int], action_texts: Sequence[str], probes: Sequence[Probe] | None = None,
                  priorities: Sequence[int] | None = None) -> None:
        for i, text, probe in zip(env_ids, action_texts, per_env(probes, len(env_ids), NO_PROBE)):
            self._run(i, "step", (text, probe))

    def _run(self, i: int, kind, payload) -> None:
        env_id, ok, out, seconds = self.host.handle(i, kind, payload)
        self._busy += seconds
        if not ok:
            self._failed += 1
            self._ready.append(EnvResult.failed(env_id, kind, out, seconds))
            return
        self._steps += kind == "step"
        self._resets += kind != "step"
        self._ready.append(EnvResult.ok(env_id, kind, out[0], out[1], seconds))

    def recv(self, batch_size: int = 1, timeout: float | None = None) -> list[EnvResult]:
        out = list(self._ready)
        self._ready.clear()
        return out

    def stats(self) -> PoolStats:
        wall = max(time.perf_counter() - self._t_start, 1e-9)
        return PoolStats(self._steps, self._resets, self._steps / wall, self._busy / wall, 0, 0, self._failed)

    def close(self) -> None:
        self.host.close()
