"""The env side of every env backend: ``EnvHost`` runs reset/restore/step requests on its envs.

The same code answers requests in the trainer's process (``InlineEnvs``), in an ``EnvPool``
worker process and in a ``RayEnvPool`` actor, so an env behaves identically on each backend.
After every request the host reads what the rollout engine asked for in the request's
``Probe`` (``AfterState``): the state's anchor key and shaping potential (when the env has
those capabilities), the expert's next action, an env-side random action, a snapshot.

Requests:

- ``reset (seed, task, probe)``: ``env.reset(task=task, seed=seed)``;
- ``restore (snapshot, reseed, probe)``: ``env.restore(snapshot)`` (its observation: what
  ``restore`` returns, else ``snapshot.observation``), then ``env.reseed(reseed)`` unless
  ``reseed`` is None; a snapshot of a finished episode fails;
- ``step (action_text, probe)``: ``env.step(action_text)``.

An exception inside a request becomes a failed reply (its traceback's last line); the host
lives on. ``WorkerLimits`` bound memory and per-request CPU time in worker processes.
"""

from __future__ import annotations

import os
import random
import signal
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal, Mapping

from turnforge.envs.base import Env, capabilities, close_env
from turnforge.errors import Interrupted
from turnforge.envs.registry import EnvSpec, make_batch, register
from turnforge.types import EnvSnapshot, Scalar, StepResult

Kind = Literal["reset", "restore", "step"]
Status = Literal["ok", "resumed", "restarted", "failed"]
Assignments = list[tuple[int, "EnvSnapshot | None"]]  # (env id, snapshot to restore or None) per env of a worker
Message = tuple[int, Kind, Any]  # (env id, kind, payload): one request as the host sees it
# (env id, ok, (StepResult, AfterState) or the error line, seconds)
Reply = tuple[int, bool, Any, float]


@dataclass(frozen=True)
class Probe:
    """What the rollout engine wants read off an env after a request, besides its result."""

    expert: bool = False  # env.expert_action(): the expert's next action (demonstrations)
    random_seed: int | None = None  # env.random_action(random.Random(random_seed)) (random actors)
    snapshot: bool = False  # env.snapshot() of the state the request left
    keys: bool = True  # env.anchor_key() and env.potential() (not needed by episodes that are only scored)
    summary: bool = False  # with expert: also env.expert_summary() (demonstrations of summarize contexts)


NO_PROBE = Probe()


@dataclass(frozen=True)
class AfterState:
    """What the host read off an env after a request (see ``Probe``). ``anchor_key`` and
    ``potential`` are "" and 0.0 when the env lacks the capability; ``potential`` is 0 after a
    terminating step (terminal states have potential 0); nothing but the potential is read after
    a step that ended the episode."""

    anchor_key: str = ""
    potential: float = 0.0
    expert_action: str | None = None
    expert_summary: str | None = None
    random_action: str | None = None
    snapshot: EnvSnapshot | None = None


@dataclass(frozen=True)
class EnvResult:
    """One finished request.

    ``status``: ``'ok'``; ``'resumed'`` = a step that was in flight on a worker that died or
    hung, re-run after restoring the env from its last snapshot; ``'restarted'`` = the same for
    a reset or restore (the episode starts over, nothing is resumed); ``'failed'`` = the env
    raised (``error`` = the traceback's last line; the worker lives on) or the request took its
    worker down twice, or the env could not be restored after a crash. On ``'failed'`` the
    observation is ``''``, reward 0 and flags False; the env must be reset before its next step.
    ``seconds`` = time the env spent on the request (for a crash or hang: time until the crash
    was noticed).
    """

    env_id: int
    kind: Kind
    observation: str
    reward: float
    terminated: bool
    truncated: bool
    invalid_action: bool
    success: bool
    info: Mapping[str, Scalar]
    status: Status
    error: str | None
    seconds: float
    after: AfterState = AfterState()
    images: tuple[bytes, ...] = ()  # PNG bytes shown with the observation (``StepResult.images``)

    @property
    def anchor_key(self) -> str:
        return self.after.anchor_key

    @property
    def potential(self) -> float:
        return self.after.potential

    @classmethod
    def ok(cls, env_id: int, kind: Kind, result: StepResult, after: AfterState, seconds: float,
           status: Status = "ok") -> "EnvResult":
        return cls(env_id, kind, result.observation, result.reward, result.terminated, result.truncated,
                   result.invalid_action, result.success, dict(result.info), status, None, seconds, after, result.images)

    @classmethod
    def failed(cls, env_id: int, kind: Kind, error: str, seconds: float) -> "EnvResult":
        return cls(env_id, kind, "", 0.0, False, False, False, False, {}, "failed", error, seconds)


def last_line(tb: str) -> str:
    """The last non-empty line of a traceback (the exception and its message)."""
    lines = [ln for ln in tb.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "unknown error"


@dataclass(frozen=True)
class WorkerLimits:
    """Per-worker budgets: ``memory_mb`` caps the address space (``RLIMIT_AS``);
    ``cpu_seconds`` caps the CPU time of one request (``RLIMIT_CPU``, whole seconds): a request
    over it fails with ``CpuBudgetExceeded`` and the worker lives on."""

    memory_mb: int | None = None
    cpu_seconds: int | None = None


class CpuBudgetExceeded(BaseException):
    """Raised inside a request that used more than ``WorkerLimits.cpu_seconds`` of CPU (a
    ``BaseException``, so an env's own ``except Exception`` does not swallow it)."""


def _on_sigxcpu(signum: int, frame: Any) -> None:
    raise CpuBudgetExceeded("the request used more CPU time than the worker's budget")


def limit_memory(memory_limit_mb: int | None, on_top_of_current: bool) -> None:
    """Set ``RLIMIT_AS``; with ``on_top_of_current`` the limit is the address space mapped now
    plus ``memory_limit_mb`` (a Ray worker maps gigabytes for its own threads before any env)."""
    if memory_limit_mb is None:
        return
    import resource

    limit = int(memory_limit_mb) * 2**20
    if on_top_of_current:
        with open("/proc/self/statm") as f:
            limit += int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


class EnvHost:
    """One backend's (or worker's) envs, answering one request at a time.

    ``snapshot_always``: take a snapshot after every request whether the probe asks or not
    (worker pools keep the latest one per env to restore a crashed worker's envs)."""

    def __init__(self, envs: Mapping[int, Env], *, snapshot_always: bool = False, cpu_seconds: int | None = None) -> None:
        self.envs = dict(envs)
        first = next(iter(self.envs.values()), None)
        self.caps = capabilities(first) if first is not None else None
        self.snapshot_always = snapshot_always and self.caps is not None and self.caps.snapshot
        self.cpu_seconds = cpu_seconds
        if cpu_seconds is not None:
            try:
                signal.signal(signal.SIGXCPU, _on_sigxcpu)  # else the default action kills the worker: restart, then 'failed'
            except ValueError:  # not the main thread (some Ray actors)
                pass

    @classmethod
    def from_spec(cls, spec: EnvSpec, env_kwargs: dict, assignments: Assignments, cpu_seconds: int | None = None) -> "EnvHost":
        """A worker's host: register ``spec`` (envs registered in the parent), build the
        assigned envs and restore those that come with a snapshot."""
        register(spec.env_id, spec.factory, overwrite=True, **spec.kwargs)
        envs = dict(zip([i for i, _ in assignments], make_batch(spec.env_id, len(assignments), **env_kwargs)))
        for env_id, snap in assignments:
            if snap is not None:
                envs[env_id].restore(snap)
        return cls(envs, snapshot_always=True, cpu_seconds=cpu_seconds)

    def handle(self, env_id: int, kind: Kind, payload: Any) -> Reply:
        """Run one request; an env exception becomes a failed reply (the host lives on). A signal
        that stops the run (``Interrupted``, raised by its handler while an env of the trainer's own
        process was running) is not the env's failure: it propagates."""
        t0 = time.perf_counter()
        self._arm_cpu_budget()
        try:
            env = self.envs[env_id]
            if kind == "reset":
                seed, task, probe = payload
                result = StepResult(env.reset(task=task, seed=seed), 0.0, False, False)
            elif kind == "restore":
                snapshot, reseed, probe = payload
                obs = env.restore(snapshot)
                if reseed is not None:
                    env.reseed(reseed)
                if getattr(env, "done", False):
                    raise ValueError("the start snapshot is of a finished episode")
                result = StepResult(obs if isinstance(obs, str) else snapshot.observation, 0.0, False, False)
            else:
                text, probe = payload
                result = env.step(text)
            if self.caps.images and not (result.terminated or result.truncated):
                result = replace(result, images=tuple(env.observation_images()))
            return env_id, True, (result, self._after(env, result, probe)), time.perf_counter() - t0
        except Interrupted:  # the run's SIGINT/SIGTERM handler, fired inside an env of this process: the run stops
            raise
        except (Exception, CpuBudgetExceeded):
            return env_id, False, last_line(traceback.format_exc()), time.perf_counter() - t0
        finally:
            self._arm_cpu_budget(off=True)

    def close(self) -> None:
        """Call each env's optional ``close()`` (an MCP env stops its server); errors are ignored."""
        for env in self.envs.values():
            try:
                close_env(env)
            except Exception:  # closing must not stop the others from closing
                pass

    def _after(self, env: Env, result: StepResult, probe: Probe) -> AfterState:
        caps = self.caps
        potential = float(env.potential()) if caps.potential and probe.keys and not result.terminated else 0.0
        if result.terminated or result.truncated:
            return AfterState(potential=potential)  # the episode ended: nothing is acted on from here
        snapshot = None
        if caps.snapshot and (probe.snapshot or self.snapshot_always):
            snapshot = replace(env.snapshot(), observation=result.observation)
        return AfterState(
            anchor_key=env.anchor_key() if caps.anchor_key and probe.keys else "",
            potential=potential,
            expert_action=env.expert_action() if probe.expert else None,
            expert_summary=env.expert_summary() if probe.expert and probe.summary else None,
            random_action=env.random_action(random.Random(probe.random_seed)) if probe.random_seed is not None else None,
            snapshot=snapshot,
        )

    def _arm_cpu_budget(self, off: bool = False) -> None:
        """Soft ``RLIMIT_CPU`` = CPU used so far + the budget (whole seconds), or none."""
        if self.cpu_seconds is None:
            return
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = hard if off else int(time.process_time()) + 1 + int(self.cpu_seconds)
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def open_host(receive: Callable[[], tuple[EnvSpec, dict, Assignments]], limits: WorkerLimits,
              on_top_of_current: bool = False) -> tuple[EnvHost | None, tuple[str, Any]]:
    """Apply ``limits``, then build the envs that ``receive()`` describes. Returns the host and
    the start-up reply for the parent: ``('ready', pid)``, or ``(None, ('error', last line))``."""
    limit_memory(limits.memory_mb, on_top_of_current)
    try:
        return EnvHost.from_spec(*receive(), cpu_seconds=limits.cpu_seconds), ("ready", os.getpid())
    except Exception:
        return None, ("error", last_line(traceback.format_exc()))
