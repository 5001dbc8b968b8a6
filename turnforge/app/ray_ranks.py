"""Trainer ranks placed by Ray (``cluster=ray`` with ``dist.nproc > 1``).

The ranks are Ray actors in one placement group (a bundle per rank: ``threads / nproc`` CPUs,
a GPU with ``model.device=cuda``, and ``dist.ray_resources``), packed onto as few nodes as
fit. Each actor sets the variables torch's launcher would (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of rank 0's node) and
runs the same training program as ``torch.distributed.run`` would start (``turnforge.dist``),
so Ray only places and watches; the collectives are torch's. The env workers of each rank's
engine are Ray actors too (``engine.env_workers``, ``engine.ray_env_resources``), wherever
the cluster has room for them.

Why placement groups and not Ray Train's ``TorchTrainer``: it needs ``ray[train]`` (more
dependencies), brings its own checkpoint and result layer beside the run directory, and sets
up the process group itself; here the process group, checkpoints and failure reports are the
same as under torchrun, one code path.

The run directory is written by rank 0's actor and read by the others: on several machines it
must be on a shared filesystem. A rank whose actor dies, or whose training raises, ends the
run: the other actors are killed, one line names each rank and its cause, as under torchrun
(``turnforge.app.launch``), and one says where to resume.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any


class TrainerRank:
    """One trainer rank in a Ray actor (``launch_on_ray``)."""

    def where(self) -> tuple[str, str, int]:
        """(node id, node address, a free port there) for rank 0's rendezvous."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port

    def run(self, cfg_data: dict[str, Any], run_dir: str, resume: bool, env: dict[str, str]) -> tuple[int, str]:
        """Train as the rank ``env`` names; returns (exit status, one line: the cause, or '')."""
        os.environ.update(env)
        from turnforge.app.config import config_from_dict
        from turnforge.app.run import train
        from turnforge.dist import LOST_PEER, shutdown
        from turnforge.errors import Interrupted, RunStopped, UserError

        done = False
        try:
            train(config_from_dict(cfg_data), Path(run_dir), resume=resume, live=False)
            done = True
            return 0, ""
        except UserError as err:
            return 2, f"error: {err}"
        except (RunStopped, Interrupted) as err:
            return 1, f"error: {err}"
        except Exception as err:  # noqa: BLE001 - reported as the rank's one line, the traceback in its log
            if any(k in str(err) for k in LOST_PEER):
                return 1, f"error: another trainer rank went away ({type(err).__name__})"
            import traceback

            traceback.print_exc()
            return 1, f"internal error: {type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"
        finally:
            shutdown(wait=done)


def launch_on_ray(cfg, run_dir: Path, *, resume: bool, place_timeout_s: float = 120.0) -> int:
    """Run the training job on ``cfg.dist.nproc`` trainer ranks placed by Ray (see the module
    docstring); returns the exit status. Prints where the ranks run, then, when a rank fails,
    one line per rank: the first failure (an actor that died, or the cause a rank reported),
    then the others' ("stopped because rank 1 died"), then where to resume (``resume_lines``)."""
    import ray
    from ray.exceptions import RayActorError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from turnforge.envpool.ray_pool import connect_ray
    from turnforge.errors import UserError
    from turnforge.runs import resume_lines

    connect_ray(cfg.engine.ray_address)
    n, threads = cfg.dist.nproc, max(1, cfg.threads // cfg.dist.nproc)
    gpu = 1 if cfg.model.device.startswith("cuda") else 0
    bundle = {"CPU": threads, **({"GPU": gpu} if gpu else {}), **cfg.dist.ray_resources}
    total = ray.cluster_resources()
    short = {k: v * n for k, v in bundle.items() if total.get(k, 0.0) < v * n}
    if short:  # never placeable: say so now rather than after the wait
        raise UserError(f"the Ray cluster has no room for dist.nproc={n} trainer ranks of {bundle} each (it has "
                        f"{ {k: total.get(k, 0.0) for k in short} } of {short}); add nodes or lower dist.nproc, threads or "
                        "dist.ray_resources")
    pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=place_timeout_s)
    except Exception:  # noqa: BLE001 - GetTimeoutError: the cluster cannot hold the ranks
        remove_placement_group(pg)
        raise UserError(f"the Ray cluster has no room for dist.nproc={n} trainer ranks of {bundle} each "
                        f"(after {place_timeout_s:.0f} s); add nodes or lower dist.nproc, threads or dist.ray_resources") from None
    remote = ray.remote(TrainerRank)
    actors = [remote.options(num_cpus=threads, num_gpus=gpu, resources=dict(cfg.dist.ray_resources), max_restarts=0,
                             scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
              for i in range(n)]
    try:
        places = ray.get([a.where.remote() for a in actors])
        nodes = [p[0] for p in places]
        _, master, port = places[0]
        print(f"training on Ray: {n} ranks on {len(set(nodes))} node(s); rank 0 on {master}; run directory {run_dir}",
              file=sys.stderr, flush=True)
        futures = {}
        for i, actor in enumerate(actors):
            env = {"RANK": str(i), "WORLD_SIZE": str(n), "LOCAL_RANK": str(nodes[:i].count(nodes[i])),
                   "LOCAL_WORLD_SIZE": str(nodes.count(nodes[i])), "MASTER_ADDR": master, "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": str(threads)}
            futures[actor.run.remote(cfg.model_dump(), str(run_dir), resume, env)] = i
        results: dict[int, tuple[int, str]] = {}
        died: set[int] = set()  # the ranks whose actor died (rather than reporting a failure)
        pending = list(futures)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            rank = futures[done[0]]
            try:
                results[rank] = ray.get(done[0])
            except RayActorError as err:
                results[rank] = (1, f"its actor died ({type(err).__name__}: killed, out of memory, or its node left)")
                died.add(rank)
            if results[rank][0] != 0 and pending:  # the first failure ends the run: the others would wait in a collective
                first = rank
                for r, a in enumerate(actors):
                    if r not in results:
                        ray.kill(a)
                        results[r] = (1, f"stopped because rank {first} {'died' if first in died else 'failed'}")
                for r in [first] + sorted(set(results) - {first}):
                    if results[r][0] != 0:
                        print(f"rank {r}: {results[r][1]}", file=sys.stderr)
                code = results[first][0]
                if code != 2:  # (a user error: fix it first; its line says what)
                    for line in resume_lines(run_dir):
                        print(line, file=sys.stderr)
                return code
        failed = {r: res for r, res in results.items() if res[0] != 0}
        for r, (_, line) in sorted(failed.items()):
            print(f"rank {r}: {line}", file=sys.stderr)
        return min((code for code, _ in failed.values()), default=0)
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)
