"""Synchronous vs asynchronous RL, measured end to end.

    python benchmarks/rollout.py                          # both envs, 3 RL seeds, + EnvPool alone
    python benchmarks/rollout.py --env sokoban-slow --seeds 1 --no-envpool
    python benchmarks/rollout.py --out runs/benchmarks/rollout.json --runs-dir runs/benchmarks/rollout

First the BC warm start runs once, on plain ``sokoban`` (``RUNS_DIR/bc-0``, ``rl.iterations=0``);
every RL run then starts from its weights (``model.path`` = its ``checkpoints/bc``,
``bc.enabled=false``; ``benchmarks/_runs.py``). For each env (``sokoban-slow``: Sokoban with
lognormal step latency, median 20 ms, sigma 1.0, cap 1 s, see ``turnforge.envs.latency``; and
plain ``sokoban``) it trains four times per RL seed, with the envs in ``EnvPool`` worker
processes:

- ``sync``: the lock-step engine, trainer and rollouts alternate (verl-agent/RAGEN style);
- ``async_eta0``: the per-trajectory engine in a rollout thread, on-policy (eta = 0);
- ``async`` (eta = 4): the engine runs up to four versions ahead; decoupled PPO + truncated IS;
- ``async_equal_wall``: eta = 4 again, stopped at the wall-clock ``sync`` took.

``sync``, ``async_eta0`` and ``async`` get the same env-step budget (equal env steps).
Per run: trajectories/s over the RL stage, env utilisation of the pool (busy / wall /
workers), the trainer's idle ratio (time waiting for a batch / RL wall), staleness, and
held-out success of the final policy, evaluated greedily on plain ``sokoban`` held-out
levels (the same levels as ``sokoban-slow``, without the sleeps). With ``--envpool`` (the
default) the EnvPool-alone comparison (``benchmarks/envpool.py``) is added.

Runs go one at a time (they are timed) to ``--runs-dir`` (default ``runs/benchmarks/rollout/``,
``<env>-<run>-s<seed>/`` with a ``.log`` next to each); a run whose ``summary.json`` exists is
reused, so after changing a budget use a new ``--runs-dir``. The result goes to ``--out``
(default ``runs/benchmarks/rollout.json``) with a Markdown table next to it (``.md``); past
measurements are in ``docs/results/``. ``--set KEY=VALUE ...`` adds overrides to every run
(e.g. a smoke test: ``--set bc.num_demos=40 bc.epochs=1``).

Held-out success is noisy: with a few RL seeds, differences of a few points are within noise
(the algorithms ablation measured a seed-to-seed std of ~3 points at this scale).
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import closing
from pathlib import Path
from typing import Sequence

import numpy as np
from _runs import RESULTS, bc_start, from_bc, run

from turnforge.app.config import load_config
from turnforge.config import TrainConfig
from turnforge.policy.model import load_policy
from turnforge.rollout.engine import make_engine
from turnforge.train.evaluate import evaluate
from turnforge.train.metrics import read_metrics
from turnforge.types import EvalResult

RECIPE = "sokoban-tiny"
# The runs' shared shape: small iterations so a run takes about a minute on 2 cores.
BASE = [
    "rl.tasks_per_iteration=8", "rl.group_size=8", "rl.iterations=1000", "eval.every=0", "eval.episodes=8",
    "checkpoint_every=1000", "threads=2", "flywheel.rounds=0", "eval.bc_temperatures=[]",
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
RUNS = ("sync", "async_eta0", "async", "async_equal_wall")


def heldout(cfg: TrainConfig, checkpoint: Path, episodes: int, seed: int) -> EvalResult:
    """Greedy held-out evaluation of ``checkpoint`` with ``cfg``'s env and rollout settings
    (envs in this process)."""
    policy = load_policy(checkpoint)
    with closing(make_engine(cfg, policy, min(episodes, 256), workers=0)) as engine:
        result, _ = evaluate(engine, policy, episodes=episodes, split="heldout", temperature=0.0, seed=seed)
    return result


def run_one(name: str, overrides: list[str], out_dir: Path, eval_cfg: TrainConfig, eval_episodes: int) -> dict:
    """Train once with ``overrides``; return throughput, utilisation, idle and success."""
    run_dir = out_dir / name
    summary = run(RECIPE, BASE + overrides, run_dir)
    if summary is None:
        raise SystemExit(f"benchmark stopped: run {run_dir} failed (see {run_dir.with_suffix('.log')})")
    cfg = load_config(str(run_dir / "config.yaml"))
    iterations = read_metrics(run_dir).iterations
    trajectories = len(iterations) * cfg.rl.tasks_per_iteration * cfg.rl.group_size  # consumed by the trainer
    rl_seconds = summary.rl_seconds
    last_pool = iterations[-1].stream.env_pool if iterations else None
    staleness = [m.stream.staleness_mean for m in iterations if m.stream.staleness_mean is not None]
    truncated = [m.update.offpolicy.is_truncated_fraction if m.update.offpolicy is not None else 0.0 for m in iterations]
    t0 = time.time()
    result = heldout(eval_cfg, run_dir / "checkpoints" / "final", eval_episodes, cfg.seed)
    return {
        "overrides": overrides,
        "iterations": len(iterations),
        "trajectories": trajectories,
        "env_steps": summary.env_steps,
        "rl_seconds": rl_seconds,
        "trajectories_per_s": trajectories / rl_seconds,
        "env_steps_per_s": summary.env_steps / rl_seconds,
        "env_utilization": last_pool.env_utilization if last_pool is not None else None,
        "trainer_idle_ratio": sum(m.stream.trainer_wait_seconds for m in iterations) / rl_seconds,
        "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
        "staleness_max": max((m.stream.staleness_max or 0 for m in iterations), default=0),
        "is_truncated_fraction": float(np.mean(truncated)) if truncated else 0.0,
        "heldout_success": result.success_rate,
        "heldout_episodes": result.episodes,
        "eval_seconds": round(time.time() - t0, 1),
    }


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


def bench_rollout(out_dir: Path, env_steps: dict[str, int], eval_episodes: int = 200, envs: Sequence[str] | None = None,
                  seeds: int = 1, extra: Sequence[str] = ()) -> dict:
    """All runs of all envs, ``seeds`` RL seeds each from the same BC start (see the module
    docstring); returns the JSON-ready result: per run the mean over seeds, the per-seed
    values, and paired (same seed) differences of held-out success to ``sync``."""
    result: dict = {"envs": {}, "env_steps_budget": env_steps, "eval_episodes": eval_episodes, "seeds": seeds}
    extra = list(extra)
    start = bc_start(out_dir, RECIPE, BASE + extra, seed=0)
    eval_cfg = load_config(RECIPE, BASE + extra)  # plain sokoban, the runs' rollout settings
    result["heldout_success_bc"] = heldout(eval_cfg, start, eval_episodes, eval_cfg.seed).success_rate
    for env in envs or list(ENVS):
        per_seed = []
        for seed in range(seeds):
            budget = [f"rl.max_env_steps={env_steps[env]}", *from_bc(start), f"seed={seed}"]
            runs = {name: run_one(f"{env}-{name}-s{seed}", ENVS[env] + MODES[name] + budget + extra, out_dir, eval_cfg,
                                  eval_episodes) for name in MODES}
            wall = runs["sync"]["rl_seconds"]  # equal wall-clock: the same RL seconds sync took, any number of env steps
            runs["async_equal_wall"] = run_one(f"{env}-async_equal_wall-s{seed}",
                                               ENVS[env] + MODES["async"] + budget[1:] + [f"rl.max_seconds={wall:.1f}"] + extra,
                                               out_dir, eval_cfg, eval_episodes)
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
    # the headline keys, of the long-tail env (the first one run)
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


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "rollout.json",
                    help="JSON result file, Markdown next to it (default %(default)s)")
    ap.add_argument("--runs-dir", type=Path, default=RESULTS / "rollout",
                    help="where the training runs are written (default %(default)s)")
    ap.add_argument("--slow-env-steps", type=int, default=12000, help="env-step budget per run on sokoban-slow")
    ap.add_argument("--env-steps", type=int, default=12000, help="env-step budget per run on sokoban")
    ap.add_argument("--eval-episodes", type=int, default=200, help="held-out episodes per final evaluation")
    ap.add_argument("--env", action="extend", nargs="+", choices=list(ENVS), default=None,
                    help="only these envs (default: all of them)")
    ap.add_argument("--envpool", action=argparse.BooleanOptionalAction, default=True,
                    help="also benchmark the EnvPool alone (default: yes)")
    ap.add_argument("--seeds", type=int, default=3, help="RL seeds per run (from one BC start)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="extra",
                    help="more overrides for every run, the BC start included")
    args = ap.parse_args(argv)
    for name in ("slow_env_steps", "env_steps", "eval_episodes", "seeds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    from turnforge.policy.model import quiet_hf

    quiet_hf()
    t0 = time.time()
    result = bench_rollout(args.runs_dir, {"sokoban-slow": args.slow_env_steps, "sokoban": args.env_steps},
                           args.eval_episodes, args.env, args.seeds, args.extra)
    md = to_markdown(result)
    if args.envpool:
        from envpool import bench_envpool
        from envpool import to_markdown as envpool_md

        result["envpool"] = bench_envpool("sokoban-slow", num_envs=16, num_workers=8, steps_per_env=40)
        md += "\n\nEnvPool alone (sokoban-slow, 16 envs, 8 workers):\n\n" + envpool_md(result["envpool"])
    result["wall_seconds"] = round(time.time() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(md + "\n")
    print(md)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
