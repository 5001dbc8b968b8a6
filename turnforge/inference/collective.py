"""Weight pushes by broadcast (``rollout.server.transport=gloo`` on CPUs, ``nccl`` on GPUs).

The trainer and the replicas in rotation form a process group of their own, outside the
trainer's ranks' group (``turnforge.dist``): the trainer is its rank 0 and holds the rendezvous
store (a ``TCPStore`` on a free port of ``rollout.server.group_host``); replica i of the list is
rank i + 1. A push carries what a file push carries (``push_tensors``: the plain weights of a
full push, the adapter of a LoRA push, the same kinds and numbering as ``FileWeightSync``), but
tensor by tensor over the group instead of through a file: the trainer asks every replica to
receive push n (``POST /v1/weights`` with ``{"collective": ...}``: the push's description and
its tensors' names, shapes and dtypes, in the order sent) and broadcasts them from its own
weights, one tensor at a time (gloo from the CPU, NCCL from the GPU the model is on).
A replica receives a full push's tensors straight into its weights and an adapter's into fresh
buffers, so neither side holds a second copy of the model.

Never hang: the group's every operation, and its forming, has ``rollout.server.timeout_s``. When
a broadcast or a forming fails (a replica died or hung), the group is dropped; the replicas that
still answer (the trainer's HTTP call came back with the failure) form a new group at once and
receive the push again; those that do not answer fail the push and leave the rotation
(``ServerSampler``). A replica whose full push was cut off mid-way holds torn weights: it says
it holds no push (``push`` -1) until a whole one lands, so no request is sampled on them.

Where it departs from peers: prime-rl, verl and TRL build their NCCL weight-update group with
vLLM's ``StatelessProcessGroup``; here the group is torch's own (``ProcessGroupGloo`` /
``ProcessGroupNCCL`` over a ``PrefixStore`` per group), so the same code runs on a CPU.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch

from turnforge.inference.weights import (
    LoadedWeights,
    PushError,
    PushSequence,
    PushTensors,
    ReplicaFailed,
    WeightPush,
    check_names,
    check_push,
    loaded,
    push_tensors,
)

#: The error code of a replica's answer when a broadcast it was receiving failed (it is alive).
TORN = "collective_failed"


def new_group(backend: str, store: Any, rank: int, size: int, timeout_s: float) -> Any:
    """A ``ProcessGroupGloo`` or ``ProcessGroupNCCL`` of ``size`` members on ``store`` (a
    ``PrefixStore`` per group); returns once every member joined, or raises after ``timeout_s``."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def broadcast(group: Any, tensor: torch.Tensor, timeout_s: float) -> None:
    """``tensor`` from the group's rank 0 to every member (in place on the others)."""
    import torch.distributed as dist

    group.broadcast([tensor], dist.BroadcastOptions()).wait(timedelta(seconds=timeout_s))


#: Tensors under ``SMALL_BYTES`` travel together: consecutive ones of one dtype are flattened into
#: a bucket of at most ``BUCKET_BYTES``, one broadcast each (a LoRA adapter is hundreds of small
#: tensors; one broadcast apiece costs a round trip each). Larger tensors go alone, in place.
#: Measured on SmolLM2 over gloo (2 cores): a LoRA push 0.12-0.15 s in buckets against 0.22-0.26 s
#: tensor by tensor; the full push is the same at 256 KB, and slower (0.50 s against 0.29-0.36 s)
#: with a limit of 1 MB, which also bucketed its 442 KB projections.
SMALL_BYTES = 256 << 10
BUCKET_BYTES = 16 << 20


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def buckets(described: Sequence[Sequence]) -> list[list[int]]:
    """Which of the ``[name, shape, dtype]`` tensors travel together (indices, in order); the
    trainer sends this plan with the push, so both ends cut the stream alike."""
    out: list[list[int]] = []
    current: list[int] = []
    size, kind = 0, None
    for i, (_, shape, dtype) in enumerate(described):
        nbytes = math.prod(shape) * _dtype(dtype).itemsize
        if current and (nbytes >= SMALL_BYTES or dtype != kind or size + nbytes > BUCKET_BYTES):
            out.append(current)
            current, size = [], 0
        if nbytes >= SMALL_BYTES:
            out.append([i])
            continue
        current.append(i)
        size, kind = size + nbytes, dtype
    return out + ([current] if current else [])


def send(group: Any, tensors: dict[str, torch.Tensor], plan: list[list[int]], timeout_s: float) -> None:
    """Broadcast ``tensors`` from rank 0, bucket by bucket of ``plan`` (``buckets``)."""
    items = list(tensors.values())
    for bucket in plan:
        flat = items[bucket[0]] if len(bucket) == 1 else torch.cat([items[i].reshape(-1) for i in bucket])
        broadcast(group, flat, timeout_s)


def receive(group: Any, described: Sequence[Sequence], plan: list[list[int]], into: Callable[[str], torch.Tensor | None],
            put: Callable[[str, torch.Tensor], None], device: str, timeout_s: float) -> None:
    """Receive what ``send`` broadcasts with the same ``plan``: a tensor that travels alone lands
    in ``into(name)`` when that is a tensor of its shape and dtype (then nothing more), else in a
    fresh one handed to ``put(name, tensor)``, as is every tensor of a bucket (a view of it)."""
    for bucket in plan:
        if len(bucket) == 1:
            name, shape, dtype = described[bucket[0]]
            target = into(name)
            direct = (target is not None and target.dtype == _dtype(dtype) and target.is_contiguous()
                      and list(target.shape) == list(shape))
            buffer = target if direct else torch.empty(shape, dtype=_dtype(dtype), device=device)
            broadcast(group, buffer, timeout_s)
            if not direct:
                put(name, buffer)
            continue
        sizes = [math.prod(described[i][1]) for i in bucket]
        flat = torch.empty(sum(sizes), dtype=_dtype(described[bucket[0]][2]), device=device)
        broadcast(group, flat, timeout_s)
        for i, piece in zip(bucket, flat.split(sizes)):
            put(described[i][0], piece.view(described[i][1]))


def _described(tensors: dict[str, torch.Tensor] | None) -> list | None:
    return None if tensors is None else [[k, list(t.shape), str(t.dtype)] for k, t in tensors.items()]


class CollectiveWeightSync:
    """The trainer's side (see the module docstring). ``load(replica, body)`` starts the HTTP
    call ``POST /v1/weights`` on a replica and returns its future (``ServerSampler``'s); its
    failures are ``ReplicaFailed``, with ``status`` the HTTP status when the replica answered."""

    def __init__(self, backend: str, host: str, timeout_s: float) -> None:
        self.transport, self.host, self.timeout_s = backend, host, timeout_s
        self.sequence = PushSequence()
        self._store: Any = None  # the rendezvous, made at the first group
        self._group: Any = None
        self._members: list[Any] = []  # the replicas of the current group, in rank order (rank i + 1)
        self._groups = 0
        self._staged: tuple[WeightPush, PushTensors] | None = None
        self.regroups = 0  # groups formed again after a failure

    def invalidate(self) -> None:
        self.sequence.invalidate()

    def publish(self, model: torch.nn.Module, version: int, fingerprint: str) -> WeightPush:
        """Stage a push of ``model`` (nothing moves until ``deliver``)."""
        t0 = time.perf_counter()
        n, kind, base = self.sequence.next(model)
        carried = push_tensors(model, kind, on_cpu=self.transport == "gloo")  # NCCL sends from the GPU
        push = WeightPush(n, version, kind, base, "", carried.bytes, time.perf_counter() - t0, fingerprint)
        self.sequence.done(model, push)
        self._staged = (push, carried)
        return push

    def deliver(self, push: WeightPush, replicas: Sequence[Any],
                load: Callable[[Any, dict], concurrent.futures.Future]) -> dict[Any, str | None]:
        """Broadcast the staged ``push`` to ``replicas``; per replica None (it holds the push) or
        why not. A failed broadcast is tried once more with the replicas that still answer."""
        staged = self._staged
        assert staged is not None and staged[0] is push, "deliver() the push publish() staged"
        carried = staged[1]
        outcome: dict[Any, str | None] = {}
        todo = list(replicas)
        for attempt in range(2):
            if not todo:
                break
            joined = self._form(todo, load, outcome)
            full, adapter = _described(carried.full), _described(carried.adapter)
            plans = [buckets(full or []), buckets(adapter or [])]
            body = {"collective": {"group": self._groups, "push": asdict(push), "full": full, "adapter": adapter,
                                   "scales": carried.scales, "plans": plans}}
            futures = {r: load(r, body) for r in joined}
            failed = None
            if joined:
                try:
                    for part, plan in zip((carried.full, carried.adapter), plans):
                        send(self._group, part or {}, plan, self.timeout_s)
                except RuntimeError as err:
                    failed = f"{self.transport} broadcast failed: {str(err).splitlines()[0][:200]}"
                    self._drop_group()
            todo = []
            for replica, fut in futures.items():
                try:
                    fut.result()
                    outcome[replica] = None
                except ReplicaFailed as err:
                    if failed is not None and err.status == 409 and attempt == 0:
                        todo.append(replica)  # alive, its copy torn: in the next group
                    else:
                        outcome[replica] = str(err) if failed is None else f"{failed}; the replica: {err}"
            if todo:
                self.regroups += 1
        for replica in todo:
            outcome[replica] = "a second broadcast failed"
        self._staged = None
        return outcome

    def _form(self, replicas: list[Any], load: Callable[[Any, dict], concurrent.futures.Future],
              outcome: dict[Any, str | None]) -> list[Any]:
        """The group of the trainer and ``replicas`` (the current one when it has exactly them);
        returns the replicas in it. One that does not answer its call to join fails the push
        (``outcome``); the others form a group without it, once."""
        import torch.distributed as dist

        if self._group is not None and self._members == replicas:
            return replicas
        self._drop_group()
        if self._store is None:
            self._store = dist.TCPStore(self.host, 0, None, True, timeout=timedelta(seconds=self.timeout_s),
                                        wait_for_workers=False)
        members = list(replicas)
        for attempt in range(2):
            self._groups += 1
            spec = {"id": self._groups, "host": self.host, "port": self._store.port, "size": len(members) + 1,
                    "backend": self.transport, "timeout_s": self.timeout_s}
            futures = {r: load(r, {"group": {**spec, "rank": i + 1}}) for i, r in enumerate(members)}
            why = None
            try:
                group = new_group(self.transport, dist.PrefixStore(f"group-{self._groups}", self._store), 0,
                                  len(members) + 1, self.timeout_s)
            except RuntimeError as err:
                group, why = None, f"forming the {self.transport} group failed: {str(err).splitlines()[0][:200]}"
            answered = []
            for replica, fut in futures.items():
                try:
                    fut.result()
                    answered.append(replica)
                except ReplicaFailed as err:
                    if err.status == 409:  # it answered: alive, the group failed elsewhere
                        answered.append(replica)
                    else:
                        outcome[replica] = f"to join the {self.transport} group ({why or 'formed without it'}): {err}"
            if group is not None and answered == members:
                self._group, self._members = group, members
                return members
            if attempt == 0:
                self.regroups += 1
            members = answered
        for replica in members:
            outcome[replica] = "the group failed to form twice"
        return []

    def _drop_group(self) -> None:
        """Leave the current group (its members leave theirs when their next receive or join fails or comes)."""
        self._group, self._members = None, []

    def close(self) -> None:
        self._drop_group()
        self._store = None


class GroupMember:
    """A replica's side (``turnforge serve``): the group it is in, and receiving pushes over it."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.group: Any = None
        self.group_id = 0
        self._store: Any = None
        self._store_at: tuple[str, int] | None = None

    def join(self, spec: dict) -> dict:
        """``POST /v1/weights`` with ``{"group": {id, host, port, rank, size, backend, timeout_s}}``:
        leave the current group, join this one (returns once every member joined)."""
        import torch.distributed as dist

        self.group, self.group_id = None, 0
        timeout_s = float(spec["timeout_s"])
        if self._store is None or self._store_at != (spec["host"], int(spec["port"])):
            self._store = dist.TCPStore(spec["host"], int(spec["port"]), None, False, timeout=timedelta(seconds=timeout_s))
            self._store_at = (spec["host"], int(spec["port"]))
        self.backend, self.timeout_s = spec["backend"], timeout_s
        try:
            self.group = new_group(spec["backend"], dist.PrefixStore(f"group-{int(spec['id'])}", self._store),
                                   int(spec["rank"]), int(spec["size"]), timeout_s)
        except RuntimeError as err:
            raise PushError(f"joining {spec['backend']} group {spec['id']} failed: {str(err).splitlines()[0][:200]}") from None
        self.group_id = int(spec["id"])
        return {"group": self.group_id}

    @torch.no_grad()
    def receive(self, model: torch.nn.Module, spec: dict, held: LoadedWeights,
                fingerprint: str) -> tuple[WeightPush, LoadedWeights]:
        """``POST /v1/weights`` with ``{"collective": ...}``: receive the push the trainer
        broadcasts into ``model`` and return it and what the model then holds. ``PushError``
        for another model's push, an adapter on another base, or another group; a broadcast cut
        off mid-way raises ``PushError`` too, and a full push's torn weights are held as push -1."""
        push = WeightPush(**spec["push"])
        check_push(push, held, fingerprint)
        group = self.group  # (a join while this receives replaces self.group, not this one)
        if group is None or int(spec["group"]) != self.group_id:
            raise PushError(f"push {push.push} comes over group {spec['group']}; this replica is in group {self.group_id}")
        own = model.state_dict()
        if spec["full"] is not None:
            check_names(push, own, [name for name, _, _ in spec["full"]])
        adapter: dict[str, torch.Tensor] = {}
        torn = spec["full"] is not None  # a full push lands in the weights as it comes
        try:
            full_plan, adapter_plan = spec["plans"]
            receive(group, spec["full"] or [], full_plan, own.get, lambda name, t: own[name].copy_(t), self.device,
                    self.timeout_s)
            receive(group, spec["adapter"] or [], adapter_plan, lambda name: None, adapter.__setitem__, self.device,
                    self.timeout_s)
        except RuntimeError as err:
            if self.group is group:
                self.group, self.group_id = None, 0
            why = f"the {self.backend} broadcast of push {push.push} failed: {str(err).splitlines()[0][:200]}"
            raise TornPush(why, LoadedWeights(-1, -1, 0, None) if torn else held) from None
        return push, loaded(model, push, held, adapter if spec["adapter"] is not None else None, spec["scales"])


class TornPush(PushError):
    """A broadcast cut off mid-way; ``held`` is what the replica holds now (torn weights: push -1)."""

    def __init__(self, message: str, held: LoadedWeights) -> None:
        super().__init__(message)
        self.held = held
