"""The evaluations of the BC policy at each of ``eval.bc_temperatures``, timed side by side:
each evaluation prefilling every prompt itself (as before) against one ``PrefillCache`` shared
by them (``turnforge.app.run.evaluate_start``).

    python benchmarks/bc_temperatures.py RUN_DIR [--repeats 2] [--episodes N] [--threads T]
        [--out runs/benchmarks/bc_temperatures.json]

RUN_DIR is a run of a recipe with ``eval.bc_temperatures`` (e.g. ``turnforge train --out
runs/default``); its ``checkpoints/bc`` plays the run's evaluations: ``eval.episodes``
held-out tasks at ``eval.temperature`` (the evaluation before RL), then at each other of
``eval.bc_temperatures``, on an engine with the run's env slots (the same waves, so the same
numbers as the run). Both ways run in this process, alternating (plain, shared, shared,
plain, ...), and must give the same trajectories bit for bit (checked: token ids, sampling
logprobs, outcomes); the script stops if they do not. Reported: seconds per way (each
repeat and the median), the ratio, the success rate per temperature, the cache's hits and
misses (rows prefilled from the cache or by the model) and size, the CPU model, torch
threads and the load average before and after (a shared machine slows both ways alike;
compare the ratio, not the seconds). Writes JSON and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
from contextlib import closing
from pathlib import Path

import torch
from _checkpoints import save
from _runs import RESULTS, cpu_info

from turnforge.app.config import load_config
from turnforge.policy.model import load_policy, quiet_hf
from turnforge.rollout.engine import make_engine
from turnforge.train.evaluate import evaluate, prefill_cache


def digest(trajectories) -> str:
    """A hash of everything an evaluation produced: ids, sampling logprobs, masks, actions, outcomes."""
    h = hashlib.sha256()
    for t in trajectories:
        h.update(repr((t.trajectory_id, [turn.action_text for turn in t.turns], t.episode_return, t.success)).encode())
        for x in t.samples:
            h.update(x.token_ids.tobytes() + x.logprobs.tobytes() + x.loss_mask.tobytes())
    return h.hexdigest()


def stage(engine, policy, cfg, temperatures: list[float], episodes: int, shared: bool) -> dict:
    """The evaluations at ``temperatures``, each prefilling alone or all sharing one cache."""
    cache = prefill_cache(policy, cfg.eval.prefill_cache_mb) if shared else None
    if shared and cache is None:
        raise SystemExit("the run's policy samples with the prefix cache or vLLM, or eval.prefill_cache_mb=0: no prefill cache")
    t0 = time.perf_counter()
    results, digests = {}, []
    for t in temperatures:
        result, trajs = evaluate(engine, policy, episodes=episodes, split=cfg.eval.split, temperature=t, seed=cfg.seed,
                                 prefills=cache)
        results[f"T={t:g}"] = result.success_rate
        digests.append(digest(trajs))
    out = {"seconds": time.perf_counter() - t0, "success": results, "digest": digests}
    if cache is not None:
        out.update(hits=cache.hits, misses=cache.misses, cache_mb=round(cache.bytes / 2**20, 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--repeats", type=int, default=2, help="Timings of each way (default %(default)s)")
    ap.add_argument("--episodes", type=int, default=None, help="Held-out episodes per temperature (default: the run's eval.episodes)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the run's threads)")
    ap.add_argument("--out", type=Path, default=RESULTS / "bc_temperatures.json",
                    help="JSON result file, Markdown table next to it (default %(default)s)")
    args = ap.parse_args()
    quiet_hf()
    cfg = load_config(str(args.run / "config.yaml"))
    torch.set_num_threads(args.threads or cfg.threads)
    e = cfg.eval
    temperatures = [e.temperature] + [t for t in e.bc_temperatures if t != e.temperature]
    episodes = args.episodes or e.episodes
    policy = load_policy(args.run / "checkpoints" / "bc", cfg.model.dtype)
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {"plain": [], "shared": []}
    with closing(make_engine(cfg, policy)) as engine:
        for r in range(args.repeats):
            for way in (("plain", "shared") if r % 2 == 0 else ("shared", "plain")):
                got = stage(engine, policy, cfg, temperatures, episodes, shared=way == "shared")
                runs[way].append(got)
                print(f"repeat {r + 1} {way}: {got['seconds']:.1f}s", flush=True)
    first = runs["plain"][0]
    for got in runs["plain"] + runs["shared"]:
        if got["digest"] != first["digest"]:
            raise SystemExit("the evaluations with a shared prefill cache differ from those without it")
    plain = statistics.median(x["seconds"] for x in runs["plain"])
    shared = statistics.median(x["seconds"] for x in runs["shared"])
    last = runs["shared"][-1]
    row = {
        "run": str(args.run), "recipe": cfg.recipe, "episodes_per_temperature": episodes, "temperatures": temperatures,
        "env_slots": engine.num_envs, "torch_threads": torch.get_num_threads(), "repeats": args.repeats,
        "plain_seconds": [round(x["seconds"], 2) for x in runs["plain"]],
        "shared_seconds": [round(x["seconds"], 2) for x in runs["shared"]],
        "plain_median_s": round(plain, 2), "shared_median_s": round(shared, 2), "speedup": round(plain / shared, 3),
        "identical": True, "success": first["success"], "cache_hits": last["hits"], "cache_misses": last["misses"],
        "cache_mb": last["cache_mb"], "cpu": cpu_info(), "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "torch": torch.__version__,
    }
    c = row["cpu"]
    table = [
        f"BC policy of `{args.run}` at {len(temperatures)} temperatures, {episodes} held-out episodes each "
        f"({c['model_name']}, family {c['family']} model {c['model']}, {c['cores']} cores, torch threads "
        f"{row['torch_threads']}; load average {row['load_average_before'][0]} before, {row['load_average_after'][0]} after: "
        "a shared machine, compare the ratio)", "",
        "| way | seconds (each repeat) | median | prefills from the cache |", "|---|---|---|---|",
        f"| each evaluation prefills alone (before) | {', '.join(map(str, row['plain_seconds']))} | {row['plain_median_s']} | 0 |",
        f"| one shared prefill cache (after) | {', '.join(map(str, row['shared_seconds']))} | {row['shared_median_s']} | "
        f"{last['hits']} of {last['hits'] + last['misses']} rows ({last['cache_mb']} MB) |", "",
        f"Speed-up {row['speedup']}x; the trajectories of both ways are identical bit for bit. Success: "
        + ", ".join(f"{k} {v:.3f}" for k, v in first["success"].items()) + ".",
    ]
    save(args.out, [row], table)


if __name__ == "__main__":
    main()
