"""``turnforge bench rollout``: synchronous vs asynchronous RL, measured end to end.

First the BC warm start runs once, on plain ``sokoban`` (``rl.iterations=0``); every RL
run then starts from its weights (``model.path`` = that checkpoint, ``bc.enabled=false``).
For each env (``sokoban-slow``: Sokoban with lognormal step latency, median 20 ms, sigma
1.0, cap 1 s, see ``turnforge.envs.latency``; and plain ``sokoban``) it trains four times,
with the envs in ``EnvPool`` worker processes:

- ``sync``: the lock-step engine, trainer and rollouts alternate (verl-agent/RAGEN style);
- ``async_eta0``: the per-trajectory engine in a rollout thread, on-policy (eta = 0);
- ``async`` (eta = 4): the engine runs up to four versions ahead; decoupled PPO + truncated IS;
- ``async_equal_wall``: eta = 4 again, stopped at the wall-clock ``sync`` took.

``sync``, ``async_eta0`` and ``async`` get the same env-step budget (equal env steps).
Per run: trajectories/s over the RL stage, env utilisation of the pool (busy / wall /
workers), the trainer's idle ratio (time waiting for a batch / RL wall), staleness, and
held-out success of the final policy, evaluated greedily on plain ``sokoban`` held-out
levels (the same levels as ``sokoban-slow``, without the sleeps). The EnvPool-alone
comparison (``turnforge.bench.envpool``) is included when asked.

One seed per run: differences in held-out success of a few points are within noise
(the algorithms ablation measured a seed-to-seed std of ~3 points at this scale).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from turnforge.config import load_config
from turnforge.envs import make_batch
from turnforge.policy.model import load_policy
from turnforge.train.evaluate import evaluate
from turnforge.train.run import train

# The runs' shared shape: small iterations so a run takes about a minute on 2 cores.
BASE = [
    "rl.tasks_per_iteration=8", "rl.group_size=8", "rl.iterations=1000", "eval.every=0", "eval.episodes=8",
    "checkpoint_every=1000", "threads=2",
]
ENVS = {
    "sokoban-slow": ["env.id=sokoban-slow", "engine.env_workers=8"],
    "sokoban": ["env.id=sokoban", "engine.env_workers=2"],
}
MODES = {
    "sync": ["engine.mode=sync"],
    "async_eta0": ["engine.mode=async", "engine.eta=0"],
    "async": ["engine.mode=async", "engine.eta=4"],
}


def _rl_events(run_dir: Path) -> list[dict]:
    return [e for line in (run_dir / "metrics.jsonl").read_text().splitlines() if (e := json.loads(line))["event"] == "rl_iter"]


def bc_start(out_dir: Path) -> Path:
    """Train the BC warm start once (plain sokoban); returns its checkpoint directory."""
    run_dir = out_dir / "bc"
    final = run_dir / "checkpoints" / "final"
    if not final.exists():
        if run_dir.exists():
            shutil.rmtree(run_dir)
        train(load_config("sokoban-tiny", BASE + ["rl.iterations=0"]), run_dir, live=False)
    return final


def run_one(name: str, overrides: list[str], out_dir: Path, eval_episodes: int) -> dict:
    """Train once with ``overrides``; return throughput, utilisation, idle and success."""
    run_dir = out_dir / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cfg = load_config("sokoban-tiny", BASE + overrides)
    summary = train(cfg, run_dir, live=False)
    events = _rl_events(run_dir)
    trajectories = len(events) * cfg.rl.tasks_per_iteration * cfg.rl.group_size  # consumed by the trainer
    rl_seconds = summary["rl_seconds"]
    last = events[-1] if events else {}
    policy = load_policy(run_dir / "checkpoints" / "final")
    envs = make_batch("sokoban", min(eval_episodes, 256))
    t0 = time.time()
    result, _ = evaluate(policy, envs, cfg.rollout, episodes=eval_episodes, split="heldout", temperature=0.0, seed=cfg.seed)
    wait = sum(e.get("trainer_wait_seconds", e["rollout_seconds"]) for e in events)
    return {
        "overrides": overrides,
        "iterations": len(events),
        "trajectories": trajectories,
        "env_steps": summary["env_steps"],
        "rl_seconds": rl_seconds,
        "trajectories_per_s": trajectories / rl_seconds,
        "env_steps_per_s": summary["env_steps"] / rl_seconds,
        "env_utilization": last.get("env_utilization"),
        "trainer_idle_ratio": wait / rl_seconds,
        "staleness_mean": sum(e.get("staleness_mean", 0.0) for e in events) / max(len(events), 1),
        "staleness_max": max((e.get("staleness_max", 0.0) for e in events), default=0.0),
        "is_truncated_fraction": sum(e.get("is_truncated_fraction", 0.0) for e in events) / max(len(events), 1),
        "heldout_success": result.success_rate,
        "heldout_episodes": result.episodes,
        "eval_seconds": round(time.time() - t0, 1),
    }


RUNS = ("sync", "async_eta0", "async", "async_equal_wall")


def _aggregate(per_seed: list[dict]) -> dict:
    """Mean over seeds of every number, plus the per-seed values of the ones we compare."""
    out: dict = {"seeds": len(per_seed)}
    for key, value in per_seed[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            vals = [r[key] for r in per_seed if r[key] is not None]
            out[key] = float(np.mean(vals)) if vals else None
            if key in ("heldout_success", "trajectories_per_s", "env_steps", "rl_seconds"):
                out[f"{key}_runs"] = vals
                out[f"{key}_std"] = float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
        elif value is None:
            out[key] = None
    return out


def bench_rollout(out_dir: Path, env_steps: dict[str, int], eval_episodes: int = 200, envs: list[str] | None = None,
                  seeds: int = 1) -> dict:
    """All runs of all envs, ``seeds`` RL seeds each from the same BC start (see the module
    docstring); returns the JSON-ready result: per run the mean over seeds, the per-seed
    values, and paired (same seed) differences of held-out success to ``sync``."""
    result: dict = {"envs": {}, "env_steps_budget": env_steps, "eval_episodes": eval_episodes, "seeds": seeds}
    start = bc_start(out_dir)
    cfg = load_config("sokoban-tiny", BASE)
    result["heldout_success_bc"] = evaluate(load_policy(start), make_batch("sokoban", min(eval_episodes, 256)), cfg.rollout,
                                            episodes=eval_episodes, split="heldout", seed=cfg.seed)[0].success_rate
    for env in envs or list(ENVS):
        per_seed = []
        for seed in range(seeds):
            budget = [f"rl.max_env_steps={env_steps[env]}", f"model.path={start}", "bc.enabled=false", f"seed={seed}"]
            runs = {name: run_one(f"{env}-{name}-s{seed}", ENVS[env] + MODES[name] + budget, out_dir, eval_episodes) for name in MODES}
            wall = runs["sync"]["rl_seconds"]  # equal wall-clock: the same RL seconds sync took, any number of env steps
            runs["async_equal_wall"] = run_one(f"{env}-async_equal_wall-s{seed}",
                                               ENVS[env] + MODES["async"] + budget[1:] + [f"rl.max_seconds={wall:.1f}"],
                                               out_dir, eval_episodes)
            per_seed.append(runs)
        agg = {name: _aggregate([r[name] for r in per_seed]) for name in RUNS}
        for name in RUNS[1:]:
            gains = [r[name]["heldout_success"] - r["sync"]["heldout_success"] for r in per_seed]
            agg[name]["heldout_minus_sync"] = float(np.mean(gains))
            agg[name]["heldout_minus_sync_std"] = float(np.std(gains, ddof=1)) if len(gains) > 1 else 0.0
        ratios = [r["async"]["trajectories_per_s"] / r["sync"]["trajectories_per_s"] for r in per_seed]
        agg["async_over_sync_throughput"] = float(np.median(ratios))
        agg["async_over_sync_throughput_runs"] = ratios
        result["envs"][env] = agg
    # the keys the issue asks for, of the long-tail env (the first one run)
    first = next(iter(result["envs"].values()))
    keys = ("trajectories_per_s", "env_utilization", "trainer_idle_ratio", "heldout_success")
    result["sync"] = {k: first["sync"][k] for k in keys}
    result["async"] = {k: first["async"][k] for k in keys}
    return result


def to_markdown(result: dict) -> str:
    n = result["seeds"]
    rows = [f"Means over {n} RL seed(s) from one BC start; ± = std over seeds; Δ = paired difference to sync.", "",
            "| env | run | traj/s | env steps | RL s | env util | trainer idle | staleness mean/max | held-out success | Δ success vs sync |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for env, runs in result["envs"].items():
        for name in RUNS:
            r = runs[name]
            util = "-" if r["env_utilization"] is None else f"{r['env_utilization']:.2f}"
            delta = "" if name == "sync" else f"{100 * r['heldout_minus_sync']:+.1f} ± {100 * r['heldout_minus_sync_std']:.1f}"
            rows.append(
                f"| {env} | {name} | {r['trajectories_per_s']:.2f} | {r['env_steps']:.0f} | {r['rl_seconds']:.0f} | {util} | "
                f"{r['trainer_idle_ratio']:.2f} | {r['staleness_mean']:.2f}/{r['staleness_max']:.0f} | "
                f"{r['heldout_success']:.3f} ± {r['heldout_success_std']:.3f} | {delta} |"
            )
        rows.append(f"| {env} | BC start | | | | | | | {result['heldout_success_bc']:.3f} | |")
        rows.append(f"| {env} | async / sync throughput (median) | {runs['async_over_sync_throughput']:.2f}x | | | | | | | |")
    return "\n".join(rows)
