"""Inference replicas as Ray actors (``rollout.server.launch=ray``).

Each replica is a Ray actor that loads the run's model and serves ``turnforge serve``'s gateway
(``open_replica``: the same routes, weight pushes and timeouts as a replica process) on a free
port of its node, listening on every interface; the trainer reaches it at the node's address.
Ray places the actors anywhere on the cluster (``engine.ray_address``; a local instance when it
is None): each asks for ``rollout.server.threads`` CPUs, a GPU with ``model.device=cuda``, and
``rollout.server.ray_resources``. They end with the trainer's process (Ray's own ownership of
actors), or when the sampler takes one out of rotation (``ray.kill``). Nothing else changes:
``ServerSampler`` talks HTTP to them as to processes.

On several machines the model the replicas load (the run's base model or checkpoint) and a file
push's directory must be on a shared filesystem; a broadcast push (``transport=gloo``) needs
only ``rollout.server.group_host`` reachable from the actors' nodes.
"""

from __future__ import annotations

import time
from pathlib import Path

from turnforge.envpool.ray_pool import connect_ray
from turnforge.errors import RunStopped
from turnforge.gateway.server import open_replica
from turnforge.inference.client import Replica, ReplicaSpec
from turnforge.seeding import stable_hash


class _ReplicaBody:
    """The actor: one gateway on this node."""

    def start(self, model_dir: str, max_tokens: int, context: int, dtype: str, device: str, seed: int, threads: int,
              prefix_cache: bool) -> str:
        """Load the model, start serving; returns the URL (``http://node-address:port``)."""
        import ray

        self.gateway = open_replica(Path(model_dir), host="0.0.0.0", port=0, max_tokens=max_tokens, context=context,
                                    dtype=dtype, device=device, seed=seed, threads=threads, prefix_cache=prefix_cache)
        self.gateway.start()
        return f"http://{ray.util.get_node_ip_address()}:{self.gateway.port}"


def start_ray_replicas(spec: ReplicaSpec, count: int, timeout_s: float, address: str | None,
                       resources: dict[str, float]) -> list[Replica]:
    """``count`` replica actors of ``spec``, all started at once; ``RunStopped`` naming the first
    that did not serve within ``timeout_s`` (all are killed). With ``address`` and ``resources``
    bound (``functools.partial``) it is an ``inference.client.Launcher``."""
    import ray

    connect_ray(address)
    actor = ray.remote(max_restarts=0, max_task_retries=0)(_ReplicaBody)
    gpus = 1 if str(spec.device).startswith("cuda") else 0
    actors = [actor.options(num_cpus=spec.threads, num_gpus=gpus, resources=dict(resources)).remote()
              for _ in range(count)]
    calls = [a.start.remote(str(spec.model_dir), spec.max_new_tokens, spec.context, spec.dtype, spec.device,
                            stable_hash(spec.seed, "replica", i), spec.threads, spec.prefix_cache)
             for i, a in enumerate(actors)]
    deadline = time.monotonic() + timeout_s
    replicas = []
    for i, (handle, call) in enumerate(zip(actors, calls)):
        try:
            url = ray.get(call, timeout=max(deadline - time.monotonic(), 0.0))
        except Exception as err:  # noqa: BLE001 - GetTimeoutError, an actor that died, no room on the cluster
            for a in actors:
                ray.kill(a)
            why = type(err).__name__ + (f": {str(err).strip().splitlines()[-1][:200]}" if str(err).strip() else "")
            raise RunStopped(f"inference replica {i} (a Ray actor) did not start within rollout.server.timeout_s="
                             f"{timeout_s:g} s ({why}); check the cluster has {spec.threads} CPUs"
                             f"{' and a GPU' if gpus else ''} free per replica, plus rollout.server.ray_resources") from None
        replicas.append(Replica(i, url, actor=handle))
    return replicas
