"""RayEnvPool: EnvPool's envs on Ray actors instead of local processes, for scale-out.

Same API, results and fault tolerance as ``EnvPool`` (the bookkeeping is ``BasePool``, shared):
env ``i`` lives on actor ``i % M``, each actor holds its envs in an ``EnvHost`` and sends the
env's snapshot back with every result; an actor that dies (``RayActorError``: its process
exited, was killed, or its node went away) or does not answer within ``step_timeout`` is
killed with ``ray.kill(no_restart=True)`` and replaced by a new actor restored from the
snapshots; the request that was running is re-sent once, then ``'failed'``. Ray's own actor
restarts and task retries are off, so no request runs twice behind the pool's back.

Departures from the process backend, both for correctness or because Ray forces them:

* The parent submits an actor's requests one at a time (the next when the previous reply
  arrives), not all at once: when an actor dies right after a request, Ray can lose that
  request's reply, and the parent could then not tell which request was running. The cost
  is one round trip per request (about a millisecond on one machine).
* ``memory_limit_mb`` is ``RLIMIT_AS`` on top of the address space the Ray worker process has
  mapped when the actor starts (several GB of thread arenas that Ray reserves but does not
  use), not an absolute limit.
* ``worker_pids()`` are process ids on the actors' nodes, not necessarily this one.

Env specs travel as in ``EnvPool``: the registry's ``EnvSpec`` pickled (by reference) in the
parent and unpickled in the actor, so the env's module must be importable there. Ray adds the
driver's working directory to its workers' ``sys.path`` but not the rest of the driver's
``sys.path``: give other folders with ``connect_ray(runtime_env={"env_vars": {"PYTHONPATH": ...}})``
or install the package on every node.

Multi-node
----------
On the head node (the one that runs the trainer, or any one)::

    ray start --head --port=6379

On every other machine, with the same Python environment and turnforge installed::

    ray start --address=HEAD_IP:6379

Then pass the address: ``connect_ray("HEAD_IP:6379")`` (or ``"auto"`` on a cluster node, or
``"ray://HEAD_IP:10001"`` for Ray Client) and build the pool as usual, or
``RayEnvPool(..., address="HEAD_IP:6379")``. Ray's scheduler places the actors; the default
``scheduling_strategy="SPREAD"`` spreads them over the nodes. Each actor asks for ``num_cpus``
(default 0, so any number fit) and ``resources``: e.g. ``ray start --resources='{"env": 8}'`` on
the env machines and ``resources={"env": 1}`` keeps the actors there, at most 8 per machine.
Actors' stdout and stderr go to Ray's session logs (``/tmp/ray/session_latest/logs``).
"""

from __future__ import annotations

import pickle
import socket
from collections import deque
from typing import Any, Sequence

from turnforge.envpool.host import Assignments, Message, Reply, WorkerLimits, last_line, open_host
from turnforge.envpool.pool import BasePool, check_started
from turnforge.envs.registry import EnvSpec
from turnforge.errors import UserError

try:
    import ray
except ImportError:  # the optional extra is missing; connect_ray and RayEnvPool say how to add it
    ray = None


def _require_ray() -> None:
    if ray is None:
        raise UserError('Ray is not installed; pip install "turnforge[ray]"')


def _probe(address: str, timeout: float) -> None:
    """Raise ``UserError`` unless a TCP connection to ``address``'s host and port opens within
    ``timeout`` (Ray itself retries an unreachable address for minutes)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"Ray address {address!r} is not 'local', 'auto', 'host:port' or 'ray://host:port'")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        raise UserError(f"cannot reach a Ray cluster at {address!r}: {err.strerror or err}") from None


def connect_ray(address: str | None = None, *, num_cpus: int | None = None, runtime_env: dict | None = None,
                timeout: float = 5.0) -> None:
    """Connect this process to Ray.

    ``None`` or ``'local'``: start a local Ray instance with ``num_cpus`` CPUs (default: all),
    no dashboard and actors' logs not copied to this terminal. ``'auto'``: the cluster this
    machine belongs to (``RAY_ADDRESS`` or the last ``ray start``). ``'host:port'`` or
    ``'ray://host:port'``: that cluster's head; an address that does not accept a TCP
    connection within ``timeout`` seconds raises ``UserError``. ``runtime_env`` is passed to
    ``ray.init`` (e.g. ``{"env_vars": {"PYTHONPATH": ...}}``). If Ray is already initialized in
    this process, that connection is kept as it is (after the reachability check).
    """
    _require_ray()
    local = address in (None, "local")
    if not local and num_cpus is not None:
        raise UserError("num_cpus applies to a local Ray instance only; cluster nodes set theirs with "
                        "ray start --num-cpus")
    if not local and address != "auto":
        _probe(address, timeout)
    if ray.is_initialized():
        return
    try:
        if local:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     runtime_env=runtime_env)
        else:
            ray.init(address=address, log_to_driver=False, runtime_env=runtime_env)
    except ConnectionError as err:
        raise UserError(f"cannot connect to a Ray cluster at {address!r}: {last_line(str(err))}") from None


class _EnvActorBody:
    """The Ray actor: the same worker-side code (``EnvHost``) as a worker process."""

    def __init__(self, blob: bytes, limits: WorkerLimits) -> None:
        self.host, self.started = open_host(lambda: pickle.loads(blob), limits, on_top_of_current=True)

    def ready(self) -> tuple[str, Any]:
        return self.started

    def handle(self, *msg: Any) -> Reply:
        return self.host.handle(*msg)


# one request at a time per actor; Ray must not restart actors or retry requests on its own
_EnvActor = ray.remote(max_concurrency=1, max_restarts=0, max_task_retries=0)(_EnvActorBody) if ray else None


class _ActorWorker:
    """One Ray actor behind the ``Worker`` interface. ``running`` is the request the actor has
    (its reply's ref, and the request); ``backlog`` the ones the pool sent after it."""

    def __init__(self, options: dict, limits: WorkerLimits) -> None:
        self.options = options
        self.limits = limits
        self.actor: Any = None
        self.started_ref: Any = None
        self.running: tuple[Any, Message] | None = None
        self.backlog: deque[Message] = deque()
        self.pid: int | None = None

    def start(self, spec: EnvSpec, env_kwargs: dict, assignments: Assignments) -> None:
        blob = pickle.dumps((spec, env_kwargs, assignments))  # as a pipe would: the spec by reference
        self.actor = _EnvActor.options(**self.options).remote(blob, self.limits)
        self.started_ref = self.actor.ready.remote()

    def wait_ready(self, timeout: float) -> None:
        started = None
        if ray.wait([self.started_ref], timeout=timeout)[0]:
            try:
                started = ray.get(self.started_ref)
            except ray.exceptions.RayError as err:
                started = ("exited", type(err).__name__)
        self.pid = check_started(self, started, timeout)

    def send(self, msg: Message) -> None:
        if self.running is None:
            self.running = (self.actor.handle.remote(*msg), msg)
        else:
            self.backlog.append(msg)

    def poll(self) -> tuple[list[Reply], str | None]:
        if self.running is None or not ray.wait([self.running[0]], timeout=0)[0]:
            return [], None
        ref, msg = self.running
        self.running = None
        try:
            reply = ray.get(ref)
        except ray.exceptions.RayTaskError as err:  # Ray could not run the method or ship its reply
            reply = (msg[0], False, last_line(str(err)), 0.0)
        except ray.exceptions.RayError as err:  # the actor died (or its node, or the reply with it)
            return [], f"worker died ({type(err).__name__})"
        if self.backlog:
            self.send(self.backlog.popleft())
        return [reply], None

    def stop(self) -> None:
        pass  # nothing to finish: kill() follows

    def kill(self, grace: float = 0.0) -> None:
        if self.actor is not None and ray.is_initialized():  # at exit Ray may have shut down first
            ray.kill(self.actor, no_restart=True)
        self.actor = self.running = None
        self.backlog.clear()


def _wait_actors(workers: Sequence[_ActorWorker], timeout: float) -> None:
    """Block until an actor's running request is done (or its actor died), or ``timeout``."""
    refs = [w.running[0] for w in workers if w.running is not None]
    if refs:
        ray.wait(refs, num_returns=1, timeout=timeout)


class RayEnvPool(BasePool):
    """``num_envs`` envs of ``env_id`` on ``num_workers`` Ray actors (see the module docstring).

    Connects with ``connect_ray(address)`` once the env id and options are checked (a local
    instance when ``address`` is None and Ray is not initialized). Per actor: ``num_cpus`` (default 0), ``resources`` (custom Ray
    resources) and ``scheduling_strategy`` (default ``'SPREAD'``: over all nodes). The other
    arguments mean what they mean for ``EnvPool``.
    """

    def __init__(self, env_id: str, num_envs: int, num_workers: int, env_kwargs: dict | None = None, *,
                 step_timeout: float = 30.0, memory_limit_mb: int | None = None, cpu_limit_s: int | None = None,
                 max_restarts: int = 100, start_timeout: float = 60.0, address: str | None = None, num_cpus: float = 0.0,
                 resources: dict[str, float] | None = None, scheduling_strategy: Any = "SPREAD") -> None:
        options = {"num_cpus": num_cpus, "resources": dict(resources or {}), "scheduling_strategy": scheduling_strategy}

        def new_workers(n: int) -> list[_ActorWorker]:
            connect_ray(address)  # after BasePool's env checks: a bad env id starts no Ray
            return [_ActorWorker(options, WorkerLimits(memory_limit_mb, cpu_limit_s)) for _ in range(n)]

        super().__init__(env_id, num_envs, num_workers, env_kwargs, step_timeout=step_timeout,
                         max_restarts=max_restarts, start_timeout=start_timeout, new_workers=new_workers,
                         wait=_wait_actors)
