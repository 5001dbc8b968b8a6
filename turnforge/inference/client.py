"""Sampling on inference replicas (``rollout.backend=server``): ``ServerSampler``.

A replica is a ``turnforge serve`` process (the gateway's model server) with a token-in/token-out
route, ``POST /v1/generate``, and a weight route, ``POST /v1/weights`` (load a push) /
``GET /v1/weights`` (what it holds). The run starts ``rollout.server.replicas`` of them on free
local ports (each ends when the trainer's process does) and adds the ones named in
``rollout.server.urls``; all must serve the trainer's model (``model_fingerprint``), checked
before any work.

``ServerSampler`` is a ``Policy.sampler``, as vLLM's engine is: a ``PolicyActor`` hands it each
call's prompts with their episode keys and row seeds. Before sampling it makes sure every replica
holds the policy's current weights: when the model or its version changed it publishes a push
(``turnforge.inference.weights``: the file transport) and asks every replica to load it. Then it
deals the rows to the replicas by episode (a stable hash of the key, so an episode's turns meet
its prefix cache), one request per replica, all at once. Each request names the push it expects;
the answer names the push and trainer version that sampled it, so every sample's version is the
one its replica served (checked, not assumed). With per-episode noise (``rollout.noise``; the
default with this backend) each row's draws come from its own seed, so which replica samples a
row does not change it, and the tokens are those in-process sampling would draw, up to float rounding.

Never hang: every request, weight load and replica start has ``rollout.server.timeout_s``. A
replica that fails one (no answer in time, a connection refused, a push it could not load, other
weights than asked) is taken out of rotation for the rest of the run, counted, and named in one
line (transport, replica, push and version); its rows go to the replicas left, so nothing it
half-sampled is used (an answer is whole or not at all). When fewer than
``rollout.server.min_replicas`` of the replicas remain the run stops with one line.

On several trainer ranks (``turnforge.dist``) the ranks share the replicas: rank 0 starts them
and tells the others their addresses; every rank samples its own share of the episodes on them.
A push is a collective, ``publish``, at the points every rank reaches alike (a resumed run's start,
``sync_sampler`` after each update, the end of behaviour cloning): the sharded trainer's weights
are first gathered into each rank's sampling model one tensor at a time (``sync_weights``, never
a second full copy), rank 0 writes the push from that model and has the replicas load it, and
every rank learns which push each replica holds. A replica that any rank found failed leaves the
rotation of all of them at that point, counted once. Sampling never pushes on several ranks (a
rank that samples no episode between two updates would leave the others waiting); a sample at
weights not published is a bug, refused.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from turnforge.dist import broadcast, gather, world
from turnforge.errors import RunStopped, UserError
from turnforge.inference.weights import ReplicaFailed, WeightPush, WeightSync
from turnforge.policy.generate import Generation
from turnforge.runs import RunDir
from turnforge.seeding import stable_hash


@dataclass(eq=False)  # one object per replica: hashed by identity
class Replica:
    """One inference replica and what the sampler knows of it."""

    index: int
    url: str  # http://host:port
    process: subprocess.Popen | None = None  # started by this run (None: given in rollout.server.urls)
    alive: bool = True
    push: int = 0  # the push it holds
    reason: str | None = None  # why it left the rotation
    actor: Any = None  # started by this run as a Ray actor (rollout.server.launch=ray)

    @property
    def name(self) -> str:
        return f"replica {self.index} ({self.url})"

    def stop(self) -> None:
        """End it if this run started it (its process terminated, its actor killed)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
        if self.actor is not None:
            import ray

            if ray.is_initialized():
                ray.kill(self.actor)
            self.actor = None


@dataclass
class ServerStats:
    """The sampler's counters so far in the run (each RL iteration's record holds a copy)."""

    pushes: int = 0
    full_pushes: int = 0
    push_bytes: int = 0
    push_seconds: float = 0.0  # writing the pushes
    load_seconds: float = 0.0  # from a push written to every replica serving it (the slowest replica), summed
    last_load_seconds: float = 0.0  # the same, of the last push
    requests: int = 0
    retried_rows: int = 0  # rows sampled again on another replica after theirs failed
    replicas_lost: int = 0
    replicas_alive: int = 0
    regroups: int = 0  # broadcast transports: groups formed again after a failed forming or broadcast
    last_push: WeightPush | None = None


class ServerSampler:
    """See the module docstring. ``post``/``get`` (url, json, timeout) -> json are the HTTP
    calls (httpx; replaceable in unit tests)."""

    def __init__(self, replicas: Sequence[Replica], sync: WeightSync, fingerprint: str, *, timeout_s: float,
                 min_replicas: float, log: Callable[[str], None] | None = None) -> None:
        import httpx

        self.replicas, self.sync, self.fingerprint = list(replicas), sync, fingerprint
        self.timeout_s, self.min_replicas = timeout_s, min_replicas
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.stats = ServerStats(replicas_alive=len(self.replicas))
        self._client = httpx.Client(timeout=timeout_s)
        self._lock = threading.Lock()  # one caller at a time: a push never races a request
        self._loaded: tuple[torch.nn.Module, int] | None = None  # (model, version) the replicas hold
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(len(self.replicas), 1),
                                                           thread_name_prefix="turnforge-replica")

    def __deepcopy__(self, memo: dict) -> "ServerSampler":  # a policy copy (async rollouts) shares the replicas
        return self

    # ------------------------------------------------------------------ HTTP
    def _call(self, replica: Replica, method: str, route: str, body: dict | None = None, waits: int = 1) -> dict:
        """One request; its answer within ``waits`` times ``rollout.server.timeout_s`` (a replica's
        part of a broadcast push is bounded by one timeout per step of its own)."""
        import httpx

        try:
            r = self._client.request(method, f"{replica.url}{route}", json=body, timeout=waits * self.timeout_s)
        except httpx.TimeoutException:
            times = "" if waits == 1 else f"{waits} x "
            raise ReplicaFailed(f"no answer within {times}rollout.server.timeout_s={self.timeout_s:g} s") from None
        except httpx.HTTPError as err:
            raise ReplicaFailed(f"{type(err).__name__}: {err}") from None
        try:
            data = r.json()
        except ValueError:
            raise ReplicaFailed(f"HTTP {r.status_code} with a body that is not JSON") from None
        if r.status_code != 200:
            message = data.get("error", {}).get("message") if isinstance(data, dict) else None
            raise ReplicaFailed(f"HTTP {r.status_code}: {message or data}", r.status_code)
        return data

    # ------------------------------------------------------------------ rotation
    @property
    def alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def _drop(self, replica: Replica, what: str, reason: str) -> None:
        """Take ``replica`` out of rotation; stop the run when too few remain."""
        replica.alive, replica.reason = False, f"{what}: {reason}"
        self.stats.replicas_lost += 1
        self.stats.replicas_alive = len(self.alive)
        replica.stop()
        left = len(self.alive)
        self.log(f"inference: {replica.name} failed {what} ({reason}); out of rotation, {left} of "
                 f"{len(self.replicas)} replicas left")
        if left == 0 or left < self.min_replicas * len(self.replicas):
            raise RunStopped(f"{left} of {len(self.replicas)} inference replicas left, below rollout.server.min_replicas="
                             f"{self.min_replicas:g} (the last: {replica.name} failed {what}: {reason})")

    def check(self) -> None:
        """Every replica answers and serves the trainer's model (``UserError`` naming the one that does not)."""
        for replica in self.replicas:
            try:
                info = self._call(replica, "GET", "/v1/weights")
            except ReplicaFailed as err:
                raise UserError(f"inference {replica.name} does not answer GET /v1/weights ({err}); start it with "
                                "`turnforge serve MODEL --port P` or fix rollout.server.urls") from None
            if info.get("fingerprint") != self.fingerprint:
                raise UserError(f"inference {replica.name} serves another model or tokenizer (fingerprint "
                                f"{info.get('fingerprint')}, the trainer's {self.fingerprint}); serve the run's model "
                                "(model.path) there, or leave it out of rollout.server.urls")
            replica.push = int(info.get("push", 0))

    # ------------------------------------------------------------------ weights
    def invalidate(self) -> None:
        """The policy's weights changed without a version bump (behaviour cloning): push them before the next sample."""
        self._loaded = None
        self.sync.invalidate()

    def push(self, model: torch.nn.Module, version: int) -> WeightPush | None:
        """Publish ``model`` at ``version`` and have every replica in rotation load it, unless
        they hold it already (the same model, or a copy of it, ``copies_weights_of``, at the
        same version); returns the push (None when nothing was pushed)."""
        if self._holds(model, version):
            return None
        source = getattr(model, "_turnforge_weights_of", model)
        pushed = self.sync.publish(model, version, self.fingerprint)
        t0 = time.perf_counter()
        st = self.stats
        st.pushes, st.full_pushes = st.pushes + 1, st.full_pushes + (pushed.kind == "full")
        st.push_bytes, st.push_seconds, st.last_push = st.push_bytes + pushed.bytes, st.push_seconds + pushed.seconds, pushed
        load = functools.partial(self._load, expect=pushed.push)
        for replica, failed in self.sync.deliver(pushed, self.alive, load).items():
            if failed is None:
                replica.push = pushed.push
            else:
                self._drop(replica, f"to load push {pushed.push} (version {version}) over {self.sync.transport}", failed)
        st.regroups = getattr(self.sync, "regroups", 0)
        st.last_load_seconds = time.perf_counter() - t0
        st.load_seconds += st.last_load_seconds
        self._loaded = (source, version)
        return pushed

    def _load(self, replica: Replica, body: dict, expect: int) -> concurrent.futures.Future:
        """``POST /v1/weights`` of ``body`` on ``replica``, started; unless the body joins a group,
        the answer must say the replica holds push ``expect``."""
        def call() -> dict:  # joining a group or receiving a broadcast: the replica's own waits end first
            held = self._call(replica, "POST", "/v1/weights", body, waits=1 if "path" in body else 2)
            if "group" not in body and int(held.get("push", -1)) != expect:
                raise ReplicaFailed(f"it holds push {held.get('push')} after loading push {expect}")
            return held

        return self._pool.submit(call)

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """On several trainer ranks, called by every rank alike where the weights changed (see the
        module docstring): the replicas any rank found failed leave the rotation (counted once,
        their requests and retried rows added to rank 0's counters), rank 0 pushes ``model`` at
        ``version``, and every rank learns what each replica holds; ``RunStopped`` on every rank
        when too few replicas are left. A world of one: nothing (the next ``sample`` pushes when
        the weights it is given are not the replicas'; the asynchronous rollout thread samples with
        older weights than the trainer holds)."""
        w = world()
        if not w.distributed:
            return
        with self._lock:
            seen = gather(([r.index for r in self.replicas if not r.alive and r.reason is not None],
                           self.stats.requests, self.stats.retried_rows, [r.reason for r in self.replicas]))
            stopped = None
            try:
                for rank, (lost, _, _, reasons) in enumerate(seen):
                    for i in lost:
                        if self.replicas[i].alive:
                            self._drop(self.replicas[i], f"on rank {rank}", reasons[i])
            except RunStopped as err:
                stopped = str(err)
            if w.main:
                self.stats.requests += sum(n for _, n, _, _ in seen[1:])
                self.stats.retried_rows += sum(n for _, _, n, _ in seen[1:])
                if stopped is None:
                    self._loaded = None  # the weights changed, whatever the version says (behaviour cloning)
                    try:
                        self.push(model, version)
                    except RunStopped as err:
                        stopped = str(err)
            else:
                self.stats.requests = self.stats.retried_rows = 0  # reported to rank 0
            told = broadcast((stopped, [(r.alive, r.push, r.reason) for r in self.replicas],
                              self.stats.replicas_lost) if w.main else None)
            stopped, held, lost_count = told
            for replica, (alive, push, reason) in zip(self.replicas, held):
                replica.alive, replica.push, replica.reason = alive, push, reason
            self.stats.replicas_lost, self.stats.replicas_alive = lost_count, len(self.alive)
            if stopped is not None:
                raise RunStopped(stopped)
            self._loaded = (getattr(model, "_turnforge_weights_of", model), version)

    def _holds(self, model: torch.nn.Module, version: int) -> bool:
        """Whether the replicas hold ``model``'s weights at ``version`` (see ``push``)."""
        source = getattr(model, "_turnforge_weights_of", model)
        return self._loaded is not None and self._loaded[0] is source and self._loaded[1] == version

    # ------------------------------------------------------------------ sampling
    def sample(self, model: torch.nn.Module, version: int, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
               stop_ids: Sequence[int], temperature: float, keys: Sequence[str] = (),
               row_seeds: Sequence[int] | None = None) -> list[Generation]:
        """One generation per prompt, sampled on the replicas with ``model``'s weights at
        ``version`` (pushed first when they changed). ``stop_ids`` are the replicas' own (the
        fingerprint covers them)."""
        if not prompts:
            return []
        keys = list(keys) or [str(i) for i in range(len(prompts))]
        with self._lock:
            if not world().distributed:
                self.push(model, version)
            elif not self._holds(model, version):
                raise RuntimeError(f"sampling at policy version {version} on several trainer ranks before every rank "
                                   "published those weights (ServerSampler.publish, from sync_sampler)")
            out: list[Generation | None] = [None] * len(prompts)
            todo = list(range(len(prompts)))
            while todo:
                alive = self.alive
                deal: dict[int, list[int]] = {}
                for i in todo:
                    deal.setdefault(stable_hash("replica", keys[i]) % len(alive), []).append(i)
                futures = {alive[k]: (rows, self._pool.submit(self._call, alive[k], "POST", "/v1/generate", {
                    "prompts": [list(prompts[i]) for i in rows], "keys": [keys[i] for i in rows],
                    "row_seeds": None if row_seeds is None else [int(row_seeds[i]) for i in rows],
                    "max_new_tokens": max_new_tokens, "temperature": temperature, "push": alive[k].push,
                })) for k, rows in deal.items()}
                todo = []
                for replica, (rows, fut) in futures.items():
                    self.stats.requests += 1
                    try:
                        got = fut.result()
                        if int(got["push"]) != replica.push:
                            raise ReplicaFailed(f"it sampled with push {got['push']}, not {replica.push}")
                        for i, g in zip(rows, got["generations"], strict=True):
                            out[i] = Generation(tuple(g["ids"]), tuple(g["logprobs"]), bool(g["stopped"]))
                    except (ReplicaFailed, KeyError, TypeError, ValueError) as err:
                        self.stats.retried_rows += len(rows)
                        todo += rows
                        self._drop(replica, f"to sample {len(rows)} rows at push {replica.push} (version {version})", str(err))
            return out  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the replicas this run started."""
        self.sync.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
        for r in self.replicas:
            r.stop()
        for r in self.replicas:
            if r.process is not None:
                try:
                    r.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    r.process.kill()


def copies_weights_of(copy: torch.nn.Module, source: torch.nn.Module) -> None:
    """Declare that ``copy`` holds ``source``'s weights whenever their policies' versions are
    equal (the asynchronous rollout worker's copy, which loads the trainer's weights with their
    version), so the replicas are not pushed the same weights again when both sample in turn
    (an evaluation on the trainer's thread between the rollout thread's calls)."""
    object.__setattr__(copy, "_turnforge_weights_of", getattr(source, "_turnforge_weights_of", source))  # not a submodule


@dataclass(frozen=True)
class ReplicaSpec:
    """How to start a local replica: ``turnforge serve`` of ``model_dir``."""

    model_dir: Path
    context: int
    max_new_tokens: int
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 1
    prefix_cache: bool = False
    seed: int = 0
    log_dir: Path | None = None


def start_replicas(spec: ReplicaSpec, count: int, timeout_s: float) -> list[Replica]:
    """Start ``count`` ``turnforge serve`` processes on free local ports, all at once; each ends
    when this process does (``--parent-pid``). ``RunStopped`` naming the replica and its log when
    one does not print its URL within ``timeout_s``."""
    procs = []
    for i in range(count):
        cmd = [sys.executable, "-m", "turnforge.cli", "serve", str(spec.model_dir), "--port", "0",
               "--context", str(spec.context), "--max-tokens", str(spec.max_new_tokens), "--dtype", spec.dtype,
               "--device", spec.device, "--threads", str(spec.threads), "--seed", str(stable_hash(spec.seed, "replica", i)),
               "--parent-pid", str(os.getpid())] + (["--prefix-cache"] if spec.prefix_cache else [])
        log = None
        if spec.log_dir is not None:
            spec.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(spec.log_dir / f"replica-{i}.log", "w")  # noqa: SIM115 - the child owns it
        env = {**os.environ, "OMP_NUM_THREADS": str(spec.threads)} if spec.threads else None
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log or subprocess.DEVNULL, text=True, env=env))
        if log is not None:
            log.close()
    replicas, deadline = [], time.monotonic() + timeout_s
    for i, proc in enumerate(procs):
        url = _read_url(proc, deadline)
        if url is None:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            where = f"; its log: {spec.log_dir / f'replica-{i}.log'}" if spec.log_dir is not None else ""
            raise RunStopped(f"inference replica {i} did not start within rollout.server.timeout_s={timeout_s:g} s "
                             f"(exit code {proc.poll()}){where}")
        replicas.append(Replica(i, url, proc))
    return replicas


def _read_url(proc: subprocess.Popen, deadline: float) -> str | None:
    """The base URL in the first line ``turnforge serve`` prints (``serving ... on http://host:port/v1 ...``)."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(max(deadline - time.monotonic(), 0.0))
    found = re.search(r" on (http://\S+)/v1 ", line[0]) if line else None
    return found.group(1) if found else None


def check_urls(srv) -> None:
    """Every replica of ``srv.urls`` answers ``GET /v1/weights`` (``UserError`` naming the first
    that does not): asked before the run writes anything; whether it serves the run's model is
    checked once the model is loaded (``ServerSampler.check``)."""
    import httpx

    for i, url in enumerate(srv.urls):
        base = url.rstrip("/").removesuffix("/v1")
        try:
            httpx.get(f"{base}/v1/weights", timeout=srv.timeout_s).raise_for_status()
        except httpx.HTTPError as err:
            raise UserError(f"rollout.server.urls[{i}]: {base} does not answer GET /v1/weights ({type(err).__name__}: "
                            f"{err}); start `turnforge serve MODEL --port P` there, or fix the address") from None


#: How replicas start: ``(spec, count, timeout_s) -> replicas`` (``start_replicas``: processes; Ray actors:
#: ``turnforge.gateway.ray_replicas``, whose actor holds a gateway).
Launcher = Callable[[ReplicaSpec, int, float], list[Replica]]


def open_sampler(srv, policy, *, model_dir: Path, run: RunDir, context: int, max_new_tokens: int, dtype: str,
                 device: str, prefix_cache: bool, seed: int, launch: Launcher = start_replicas,
                 log: Callable[[str], None] | None = None) -> ServerSampler:
    """The run's ``ServerSampler`` (``srv``: ``rollout.server``): its replicas started from
    ``model_dir`` by ``launch`` (processes with their logs in ``RUN/logs/``, or Ray actors on a
    cluster) plus those of ``srv.urls``, every one checked to serve
    the policy's model; pushes under ``srv.weights_dir`` (default ``RUN/weights``). On several
    trainer ranks every rank calls it alike, and rank 0 starts the replicas; then ``publish``
    (every rank) before the first sample."""
    from turnforge.inference.weights import FileWeightSync, model_fingerprint

    fingerprint = model_fingerprint(policy.model, policy.tokenizer, policy.stop_ids)
    threads = srv.threads or max(1, (os.cpu_count() or 1) // max(srv.replicas, 1))
    started, failed = [], None
    if world().main and srv.replicas:  # on several trainer ranks rank 0 starts them, the others learn where
        spec = ReplicaSpec(model_dir, context, max_new_tokens, dtype, device, threads, prefix_cache, seed, run.logs)
        try:
            started = launch(spec, srv.replicas, srv.timeout_s)
        except RunStopped as err:
            failed = str(err)
    failed, urls = broadcast((failed, [r.url for r in started]))
    if failed is not None:
        raise RunStopped(failed)
    started = started or [Replica(i, url) for i, url in enumerate(urls)]
    given = [Replica(len(started) + i, url.rstrip("/").removesuffix("/v1")) for i, url in enumerate(srv.urls)]
    if srv.transport == "file":
        sync: WeightSync = FileWeightSync(Path(srv.weights_dir) if srv.weights_dir else run.weights)
    else:
        from turnforge.inference.collective import CollectiveWeightSync

        sync = CollectiveWeightSync(srv.transport, srv.group_host, srv.timeout_s)
    sampler = ServerSampler(started + given, sync, fingerprint, timeout_s=srv.timeout_s, min_replicas=srv.min_replicas,
                            log=log)
    try:
        sampler.check()
    except BaseException:
        sampler.close()
        raise
    return sampler
