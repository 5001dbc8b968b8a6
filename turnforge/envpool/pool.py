"""EnvPool: N text envs spread over M worker processes, with an async send/recv API.

Env ``i`` lives on worker ``i % M``. ``send_reset``/``send_restore``/``send_step`` queue one
request per env (at most one in flight per env) and return at once; ``recv(batch_size)``
returns as soon as ``batch_size`` results are ready. Each worker runs its requests one at a
time with the same ``EnvHost`` code as the in-process backend (``turnforge.envpool.host``).

Order: a worker holds at most ``dispatch_depth`` requests at once; the others wait in the
parent, and each reply lets in the waiting request with the lowest ``priority`` (then the
oldest). The rollout engine gives each request its episode's admission order, so when many
more episodes run than workers can step at once (asynchronous rollouts), the oldest move
first and finish first, instead of every episode advancing one step per lap of a FIFO queue:
the first trajectories of a run, and every trajectory after them, are done sooner and are
less stale, and the workers are as busy as before. Without priorities the order is the order
of sending.

Fault tolerance: after every successful request the worker sends back ``env.snapshot()`` with
the result (envs with the snapshot capability), and the parent keeps the latest one per env:
that is the source of truth for recovery. A step of an env without snapshots whose worker
died fails (its episode cannot resume). A worker whose process exits (pipe EOF) or that does not answer within
``step_timeout`` is killed and restarted; its envs are restored from their snapshots in the
new worker and every request that was in flight on it is re-sent. A request that was
*running* when its worker died is re-sent once only: if it kills (or hangs) the worker again
its result has status ``'failed'``, so the caller can mark the episode an infrastructure
failure. Results are never lost or duplicated, and env faults never raise out of ``recv``;
only more than ``max_restarts`` restarts raise ``RuntimeError``.

Worker boundary: ``BasePool`` holds all of the above bookkeeping and talks to a worker only
through the small ``Worker`` interface (start with a list of ``(env_id, snapshot)``, send a
request, poll for replies in FIFO order and for death, kill). ``EnvPool`` puts a process and a
pipe behind it; ``turnforge.envpool.ray_pool.RayEnvPool`` a Ray actor. Both run the same
worker-side code, ``EnvHost``.

Envs registered in the parent reach the workers by shipping the registry's ``EnvSpec``
(its factory pickles by reference: a ``"module:attr"`` string or a top-level class whose
module the worker can import; spawned workers inherit the parent's ``sys.path``).
"""

from __future__ import annotations

import heapq
import multiprocessing as mp
import os
import pickle
import signal
import time
import weakref
from collections import deque
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Protocol, Sequence

from turnforge.envpool.host import (
    NO_PROBE, Assignments, EnvResult, Message, Probe, Reply, Status, WorkerLimits, open_host,
)
from turnforge.envs.base import capabilities
from turnforge.envs.registry import EnvSpec, list_envs, make
from turnforge.errors import RunStopped, UserError
from turnforge.sandbox.gate import usable_cores
from turnforge.types import EnvSnapshot, Task

@dataclass(frozen=True)
class PoolStats:
    """Counters since the pool started. ``env_utilization`` = sum of worker busy seconds /
    (wall seconds * num_workers); ``steps_per_s`` = completed steps / wall seconds."""

    steps: int
    resets: int
    steps_per_s: float
    env_utilization: float
    restarts: int
    timeouts: int
    failed: int


@dataclass
class _Request:
    env_id: int
    kind: str
    payload: Any  # (seed, task, probe), (snapshot, reseed, probe) or (action text, probe)
    priority: int = 0  # lower runs first among the requests waiting for the same worker
    order: int = 0  # when it was first sent (ties of priority)
    attempts: int = 0  # times it was running when its worker died or hung
    resent: bool = False

    def key(self) -> tuple[int, int]:
        return self.priority, self.order


# ---------------------------------------------------------------------------- worker side
def _worker_main(conn: Connection, limits: WorkerLimits) -> None:
    """Worker process: build envs, then answer requests one at a time until EOF or ``None``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    os.setpgrp()  # its own process group: killing a hung worker takes what its envs started (browsers, servers)
    host, started = open_host(conn.recv, limits)
    conn.send(started)
    try:
        while host is not None:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            conn.send(host.handle(*msg))
    finally:
        if host is not None:
            host.close()


# ---------------------------------------------------------------------------- transport
class Worker(Protocol):
    """All the pool knows of one worker. ``pid`` is set once ``wait_ready`` returns."""

    pid: int | None

    def start(self, spec: EnvSpec, env_kwargs: dict, assignments: Assignments) -> None:
        """Launch the worker and have it build (and restore) its envs; returns at once."""

    def wait_ready(self, timeout: float) -> None:
        """Block until the envs are built; kill the worker and raise ``RuntimeError`` if not."""

    def send(self, msg: Message) -> None:
        """Submit one request; never raises for a dead worker (``poll`` reports it)."""

    def poll(self) -> tuple[list[Reply], str | None]:
        """Without blocking: the replies that arrived, oldest first, and why the worker is
        gone (``None`` while it lives)."""

    def stop(self) -> None:
        """Ask the worker to exit once it is idle."""

    def kill(self, grace: float = 0.0) -> None:
        """Give the worker ``grace`` seconds to exit by itself, then make sure it is gone."""


class WorkerStartError(RunStopped, RuntimeError):
    """An env worker did not start (its envs failed to build, or no answer within
    ``start_timeout``): the run stops with one line (exit 1), not a traceback."""


def check_started(worker: Worker, started: tuple[str, Any] | None, timeout: float) -> int:
    """Turn a worker's start-up reply (``None`` = none within ``timeout``) into its pid, or kill
    it and raise ``WorkerStartError``."""
    if started is not None and started[0] == "ready":
        return started[1]
    worker.kill()
    if started is None:
        raise WorkerStartError(f"env worker did not start within {timeout:.0f}s (engine.env_workers workers start "
                               f"{usable_cores()} at a time; fewer workers, or a lighter env start, help)")
    tag, value = started
    if tag == "error":
        raise WorkerStartError(f"env worker failed to build its envs: {value}")
    raise RuntimeError(f"env worker exited during start-up ({value})")


class _ProcessWorker:
    """A worker process and the parent's end of its pipe (see ``Worker``)."""

    def __init__(self, ctx: Any, limits: WorkerLimits) -> None:
        self.ctx = ctx
        self.limits = limits
        self.proc: Any = None
        self.conn: Connection | None = None
        self.pid: int | None = None

    def start(self, spec: EnvSpec, env_kwargs: dict, assignments: Assignments) -> None:
        parent_conn, child_conn = self.ctx.Pipe(duplex=True)
        self.proc = self.ctx.Process(target=_worker_main, args=(child_conn, self.limits), daemon=True)
        self.proc.start()
        child_conn.close()
        self.conn = parent_conn
        self.conn.send((spec, env_kwargs, assignments))

    def wait_ready(self, timeout: float) -> None:
        assert self.conn is not None
        started = None
        if self.conn.poll(timeout):
            try:
                started = self.conn.recv()
            except (EOFError, OSError):
                self.proc.join(timeout=5)
                started = ("exited", f"exit code {self.proc.exitcode}; a script that starts workers must guard its "
                                     "entry point with `if __name__ == '__main__':`")
        self.pid = check_started(self, started, timeout)

    def send(self, msg: Message) -> None:
        assert self.conn is not None
        try:
            self.conn.send(msg)
        except OSError:
            pass  # the worker is dead; the next poll() says so

    def poll(self) -> tuple[list[Reply], str | None]:
        replies: list[Reply] = []
        if not self._read(replies) and self.proc.is_alive():
            return replies, None
        self.proc.join(timeout=5)
        self._read(replies)  # replies it wrote before dying are results, not lost work
        return replies, f"worker died (exit code {self.proc.exitcode})"

    def _read(self, out: list[Reply]) -> bool:
        """Append every reply waiting in the pipe to ``out``; True on EOF (the worker is gone)."""
        try:
            while self.conn.poll():
                out.append(self.conn.recv())
        except (EOFError, OSError):
            return True
        return False

    def stop(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send(None)
            except OSError:
                pass

    def kill(self, grace: float = 0.0) -> None:
        if self.proc is not None and grace > 0:
            self.proc.join(timeout=grace)
        started: list[int] = []
        if self.proc is not None and self.proc.is_alive():
            started = descendants(self.proc.pid)  # what its envs started (browsers start process groups of their own)
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(timeout=5)
            for pid in started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:  # and what is left in its process group
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.conn is not None:
            self.conn.close()
        self.conn = None


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, their children, ...), from ``/proc`` (empty elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _wait_processes(workers: Sequence[_ProcessWorker], timeout: float) -> None:
    """Block until a worker has a reply or has exited, or ``timeout`` seconds passed."""
    wait([w.conn for w in workers] + [w.proc.sentinel for w in workers], timeout=timeout)


def _shutdown(workers: list[Worker]) -> None:
    """Ask every worker to exit, give them a second together, then kill what is left."""
    for w in workers:
        w.stop()
    deadline = time.perf_counter() + 1.0
    for w in workers:
        w.kill(grace=max(0.0, deadline - time.perf_counter()))


# ---------------------------------------------------------------------------- bookkeeping
#: Requests a worker holds at once (module docstring: Order). A worker runs one and has the
#: next ones at hand while the parent is away from ``recv`` (a generation call of the engine
#: takes about as long as one to three steps of a slow env); the rest wait in the parent by priority.
DISPATCH_DEPTH = 4


class BasePool:
    """Requests, snapshots and recovery (see the module docstring) over any ``Worker``
    transport: ``new_workers(n)`` makes ``n`` unstarted workers (called once, after the env
    checks), ``wait(workers, timeout)`` blocks until one of them has a reply or died. ``EnvPool``
    and ``RayEnvPool`` only choose these two. Not thread-safe: one thread drives the pool."""

    def __init__(self, env_id: str, num_envs: int, num_workers: int, env_kwargs: dict | None, *,
                 step_timeout: float, max_restarts: int, start_timeout: float,
                 new_workers: Callable[[int], list[Worker]], wait: Callable[[list[Worker], float], None],
                 dispatch_depth: int = DISPATCH_DEPTH) -> None:
        if num_envs < 1 or num_workers < 1:
            raise ValueError(f"num_envs and num_workers must be >= 1, got {num_envs} and {num_workers}")
        if dispatch_depth < 1:
            raise ValueError(f"dispatch_depth must be >= 1, got {dispatch_depth}")
        self.dispatch_depth = int(dispatch_depth)
        self.env_kwargs = dict(env_kwargs or {})
        probe_env = make(env_id, **self.env_kwargs)  # a bad id or option raises UserError before any worker starts
        self.spec = list_envs()[env_id]
        try:
            pickle.dumps(self.spec)
        except Exception as err:
            raise UserError(
                f"env {env_id!r} cannot be sent to worker processes ({err}); register it as a "
                "'module:attr' string or a top-level class"
            ) from None
        self.env_id = env_id
        self.num_envs = int(num_envs)
        self.num_workers = min(int(num_workers), self.num_envs)
        self.step_timeout = float(step_timeout)
        self.max_restarts = int(max_restarts)
        self.start_timeout = float(start_timeout)
        self._can_snapshot = capabilities(probe_env).snapshot

        self._snapshots: list[EnvSnapshot | None] = [None] * self.num_envs
        self._in_flight: list[bool] = [False] * self.num_envs
        self._ready: deque[EnvResult] = deque()
        # per worker: the requests sent to it and not yet answered, oldest first; the worker runs
        # them in order, so the oldest started when it was sent or when the previous reply came
        self._queues: list[deque[_Request]] = [deque() for _ in range(self.num_workers)]
        # per worker: the requests not sent to it yet (it holds dispatch_depth), a heap by _Request.key
        self._waiting: list[list[tuple[tuple[int, int], _Request]]] = [[] for _ in range(self.num_workers)]
        self._sent = 0
        self._head_started: list[float] = [0.0] * self.num_workers
        self._steps = self._resets = self._restarts = self._timeouts = self._failed = 0
        self._busy = 0.0
        self._closed = False

        self._wait = wait
        self._workers = new_workers(self.num_workers)
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        t0 = time.perf_counter()
        try:
            # at most one start per usable core at a time: each worker imports and builds its envs
            # (an MCP env starts a server to list its tools); started all at once on a small
            # machine, the last ones would pass start_timeout queued behind the others
            starting: deque[Worker] = deque()
            for w_idx, w in enumerate(self._workers):
                if len(starting) >= usable_cores():
                    starting.popleft().wait_ready(self.start_timeout)
                w.start(self.spec, self.env_kwargs, self._assignments(w_idx))
                starting.append(w)
            for w in starting:
                w.wait_ready(self.start_timeout)
        except BaseException:
            self.close()
            raise
        self.startup_seconds = time.perf_counter() - t0
        self._t_start = time.perf_counter()

    # ------------------------------------------------------------------ requests
    def _assignments(self, w_idx: int) -> Assignments:
        return [(i, self._snapshots[i]) for i in range(w_idx, self.num_envs, self.num_workers)]

    def _check_ids(self, env_ids: Sequence[int], n: int, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        if len(env_ids) != n:
            raise ValueError(f"got {len(env_ids)} env ids but {n} {what}")
        if len(set(env_ids)) != len(env_ids):
            raise ValueError(f"env ids must be distinct, got {list(env_ids)}")
        for i in env_ids:
            if not 0 <= i < self.num_envs:
                raise ValueError(f"env id {i} out of range [0, {self.num_envs})")
            if self._in_flight[i]:
                raise ValueError(f"env {i} already has a request in flight; recv() its result first")

    def _send(self, req: _Request) -> None:
        """Queue ``req`` for its env's worker: sent now while the worker holds fewer than
        ``dispatch_depth`` requests, else when a reply makes room (lowest priority first)."""
        w_idx = req.env_id % self.num_workers
        self._in_flight[req.env_id] = True
        if not req.order:
            self._sent += 1
            req.order = self._sent
        heapq.heappush(self._waiting[w_idx], (req.key(), req))
        self._dispatch(w_idx)

    def _dispatch(self, w_idx: int) -> None:
        queue, waiting = self._queues[w_idx], self._waiting[w_idx]
        while waiting and len(queue) < self.dispatch_depth:
            _, req = heapq.heappop(waiting)
            if not queue:
                self._head_started[w_idx] = time.perf_counter()
            queue.append(req)
            self._workers[w_idx].send((req.env_id, req.kind, req.payload))

    def send_reset(self, env_ids: Sequence[int], seeds: Sequence[int | None] | None = None,
                   tasks: Sequence[Task | None] | None = None, probes: Sequence[Probe] | None = None,
                   priorities: Sequence[int] | None = None) -> None:
        """Queue a reset per env (``seeds``/``tasks`` default to None each). Non-blocking.
        ``priorities``: see the module docstring (default 0 each: the order of sending)."""
        n = len(env_ids)
        seeds, tasks, probes = per_env(seeds, n), per_env(tasks, n), per_env(probes, n, NO_PROBE)
        self._check_ids(env_ids, len(seeds), "seeds")
        self._check_ids(env_ids, len(tasks), "tasks")
        for i, seed, task, probe, prio in zip(env_ids, seeds, tasks, probes, per_env(priorities, n, 0)):
            self._send(_Request(int(i), "reset", (seed, task, probe), int(prio)))

    def send_restore(self, env_ids: Sequence[int], snapshots: Sequence[EnvSnapshot],
                     reseeds: Sequence[int | None] | None = None, probes: Sequence[Probe] | None = None,
                     priorities: Sequence[int] | None = None) -> None:
        """Queue a restore per env: the env goes to ``snapshots[k]`` (then ``reseed`` unless None). Non-blocking."""
        n = len(env_ids)
        reseeds, probes = per_env(reseeds, n), per_env(probes, n, NO_PROBE)
        self._check_ids(env_ids, len(snapshots), "snapshots")
        for i, snap, reseed, probe, prio in zip(env_ids, snapshots, reseeds, probes, per_env(priorities, n, 0)):
            self._send(_Request(int(i), "restore", (snap, reseed, probe), int(prio)))

    def send_step(self, env_ids: Sequence[int], action_texts: Sequence[str], probes: Sequence[Probe] | None = None,
                  priorities: Sequence[int] | None = None) -> None:
        """Queue one step per env. Non-blocking."""
        n = len(env_ids)
        self._check_ids(env_ids, len(action_texts), "action texts")
        for i, text, probe, prio in zip(env_ids, action_texts, per_env(probes, n, NO_PROBE), per_env(priorities, n, 0)):
            self._send(_Request(int(i), "step", (text, probe), int(prio)))

    # ------------------------------------------------------------------ results
    def recv(self, batch_size: int = 1, timeout: float | None = None) -> list[EnvResult]:
        """Wait until at least ``batch_size`` results are ready, then return *all* ready
        results (so possibly more than ``batch_size``), oldest first. With ``timeout`` it
        returns whatever is ready after that many seconds, possibly fewer or none."""
        pending = sum(self._in_flight)  # sent and not yet returned, ready ones included
        if batch_size > pending:
            raise ValueError(f"recv(batch_size={batch_size}) but only {pending} requests are pending")
        deadline = None if timeout is None else time.perf_counter() + timeout
        while len(self._ready) < batch_size:
            if not self._pump(deadline):
                break
        out = list(self._ready)
        self._ready.clear()
        for r in out:
            self._in_flight[r.env_id] = False
        return out

    def step_all(self, env_ids: Sequence[int], actions: Sequence[str]) -> list[EnvResult]:
        """Synchronous: step ``env_ids`` and return their results in the same order. Results of
        other requests that arrive meanwhile stay ready for the next ``recv``."""
        self.send_step(env_ids, actions)
        wanted = set(env_ids)
        while sum(r.env_id in wanted for r in self._ready) < len(wanted):
            self._pump(None)
        mine = {r.env_id: r for r in self._ready if r.env_id in wanted}
        self._ready = deque(r for r in self._ready if r.env_id not in wanted)
        for i in env_ids:
            self._in_flight[i] = False
        return [mine[i] for i in env_ids]

    def _pump(self, deadline: float | None) -> bool:
        """Wait for replies (or a dead/hung worker) once; False when ``deadline`` passed."""
        now = time.perf_counter()
        busy = [w_idx for w_idx, q in enumerate(self._queues) if q]
        if not busy:
            return False
        wake = min(self._head_started[w_idx] + self.step_timeout for w_idx in busy)
        if deadline is not None:
            if now >= deadline:
                return False
            wake = min(wake, deadline)
        self._wait([self._workers[w_idx] for w_idx in busy], max(0.0, wake - now))
        for w_idx in busy:
            replies, died = self._workers[w_idx].poll()
            for reply in replies:
                self._on_reply(w_idx, reply)
            if self._queues[w_idx] and died is not None:
                self._recover(w_idx, died)
            elif self._queues[w_idx] and time.perf_counter() >= self._head_started[w_idx] + self.step_timeout:
                self._timeouts += 1
                self._recover(w_idx, f"timed out after {self.step_timeout:g}s")
        return True

    def _on_reply(self, w_idx: int, reply: Reply) -> None:
        env_id, ok, payload, seconds = reply
        req = self._queues[w_idx].popleft()
        assert req.env_id == env_id, f"worker replied for env {env_id}, expected {req.env_id}"
        self._head_started[w_idx] = time.perf_counter()
        self._busy += seconds
        self._dispatch(w_idx)
        if not ok:
            self._fail(req, payload, seconds)
            return
        result, after = payload
        self._snapshots[env_id] = after.snapshot  # the source of truth for recovery (None after the end)
        if req.kind == "step":
            self._steps += 1
        else:
            self._resets += 1
        if after.snapshot is not None and not req.payload[-1].snapshot:
            after = replace(after, snapshot=None)  # kept here for recovery, not handed out unasked
        status: Status = "ok" if not req.resent else ("resumed" if req.kind == "step" else "restarted")
        self._ready.append(EnvResult.ok(env_id, req.kind, result, after, seconds, status))  # type: ignore[arg-type]

    def _fail(self, req: _Request, error: str, seconds: float) -> None:
        self._failed += 1
        self._ready.append(EnvResult.failed(req.env_id, req.kind, error, seconds))  # type: ignore[arg-type]

    def _recover(self, w_idx: int, why: str) -> None:
        """Kill and restart worker ``w_idx``; restore its envs from snapshots; re-send its queue.
        A step of an env that has no snapshot to restore fails (its episode cannot resume)."""
        w = self._workers[w_idx]
        seconds = time.perf_counter() - self._head_started[w_idx]
        w.kill()
        self._restarts += 1
        if self._restarts > self.max_restarts:
            raise RuntimeError(f"{type(self).__name__}({self.env_id!r}): more than max_restarts={self.max_restarts} "
                               f"worker restarts (last: {why}); the env is probably broken")
        requests = list(self._queues[w_idx])
        self._queues[w_idx].clear()
        head, rest = requests[0], requests[1:]
        head.attempts += 1
        w.start(self.spec, self.env_kwargs, self._assignments(w_idx))
        w.wait_ready(self.start_timeout)
        if head.attempts >= 2:
            self._fail(head, f"{why} twice on this request", seconds)
        else:
            rest.insert(0, head)
        started: set[int] = set()  # envs whose re-sent requests start a new episode first
        for req in rest:  # requests queued behind the head never ran; re-running them is safe
            req.resent = True
            if req.kind != "step":
                started.add(req.env_id)
            elif req.env_id not in started and self._snapshots[req.env_id] is None and not self._can_snapshot:
                self._fail(req, f"{why}; env {self.env_id!r} has no snapshot() to resume its episode from", seconds)
                continue
            self._send(req)
        self._dispatch(w_idx)  # what waited in the parent, where nothing was re-sent

    # ------------------------------------------------------------------ metrics & lifecycle
    def stats(self) -> PoolStats:
        wall = max(time.perf_counter() - self._t_start, 1e-9)
        return PoolStats(self._steps, self._resets, self._steps / wall,
                         self._busy / (wall * self.num_workers), self._restarts, self._timeouts, self._failed)

    def worker_pids(self) -> list[int]:
        """Process id of each worker (worker ``k`` holds envs ``k, k + M, ...``)."""
        return [w.pid for w in self._workers]

    def close(self) -> None:
        """Stop all workers (idempotent). Also runs on garbage collection and interpreter exit."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> BasePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EnvPool(BasePool):
    """``num_envs`` envs of ``env_id`` on ``num_workers`` processes (see the module docstring).

    ``start_method``: ``'spawn'`` (default) or ``'forkserver'``; never fork, so a parent that
    imported torch or CUDA is not copied. Scripts must guard their entry point with
    ``if __name__ == "__main__":``. ``memory_limit_mb`` sets ``RLIMIT_AS`` in each worker;
    an env that runs out of memory then fails its request (``MemoryError``) instead of taking
    the machine down. ``cpu_limit_s`` is the CPU-time budget of one request (whole seconds;
    a request over it fails with ``CpuBudgetExceeded``; a sleeping env uses none). ``num_workers`` is capped at ``num_envs``. Not thread-safe: one thread
    drives the pool. A worker that cannot be restarted (start-up error or ``start_timeout``)
    raises ``RuntimeError`` from ``recv``.
    """

    def __init__(self, env_id: str, num_envs: int, num_workers: int, env_kwargs: dict | None = None, *,
                 step_timeout: float = 30.0, memory_limit_mb: int | None = None, cpu_limit_s: int | None = None,
                 max_restarts: int = 100, start_method: str = "spawn", start_timeout: float = 60.0,
                 dispatch_depth: int = DISPATCH_DEPTH) -> None:
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        ctx = mp.get_context(start_method)
        limits = WorkerLimits(memory_limit_mb, cpu_limit_s)
        super().__init__(env_id, num_envs, num_workers, env_kwargs, step_timeout=step_timeout,
                         max_restarts=max_restarts, start_timeout=start_timeout,
                         new_workers=lambda n: [_ProcessWorker(ctx, limits) for _ in range(n)],
                         wait=_wait_processes, dispatch_depth=dispatch_depth)


def per_env(values: Sequence[Any] | None, n: int, default: Any = None) -> list[Any]:
    """``values`` as a list, or ``n`` copies of ``default``."""
    return list(values) if values is not None else [default] * n
