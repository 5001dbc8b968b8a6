"""Credit-assignment ablation: the default tiny Sokoban setup trained with each RL method
from the same behaviour-cloning start, at an equal env-step budget, over several seeds.

    python benchmarks/algorithms.py                       # all methods, 3 seeds
    python benchmarks/algorithms.py --methods grpo gigpo --seeds 0 1 --jobs 2

Per seed, the BC stage of the default recipe runs once (``WORK/bc-<seed>/``); every method then
starts RL from that checkpoint (``model.path=.../checkpoints/bc``, ``bc.enabled=false``)
with the same seed, so methods differ only in credit assignment (``benchmarks/_runs.py``).
RL stops at ``--env-steps`` policy env steps (value-pretraining episodes count; Monte-Carlo
critic rollouts are counted apart as ``mc_env_steps``, they are simulator steps without the
policy). Run directories go to ``--work`` (default ``runs/benchmarks/algorithms/``,
``<method>-<seed>/`` with a ``.log`` next to each; finished runs are reused), results to
``--out`` (default ``runs/benchmarks/``; past measurements are in ``docs/results/``):

- ``algorithms.json``: one record per run ``{method, seed, heldout_success, env_steps,
  wall_seconds, ...}`` plus its held-out learning curve;
- ``algorithms.md``: held-out success mean ± std over seeds, env steps and wall time to
  the success threshold (median over the seeds that reached it);
- ``algorithms.png``: mean held-out success against env steps per method.

``--set KEY=VALUE ...`` adds overrides to every run (BC starts included), e.g. a smoke test:
``--methods grpo --seeds 0 --env-steps 200 --set bc.num_demos=40 bc.epochs=1 eval.episodes=20``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _runs import RESULTS, Job, bc_starts, from_bc, run_all
from turnforge.train.metrics import RunMetrics, read_metrics

METHODS: dict[str, list[str]] = {
    "grpo": [],
    "grpo_shaped": ["rl.shaping=potential", "rl.shaping_coef=0.5"],
    "gigpo": ["rl.advantage=gigpo"],
    "ppo_gae": ["rl.advantage=gae", "critic.enabled=true", "rl.gae.lam_critic=0.95"],
    "ppo_vapo": [
        "rl.advantage=gae", "critic.enabled=true", "rl.gae.lam_critic=1.0", "rl.gae.length_adaptive=true",
        "critic.pretrain_episodes=256",
    ],
    "mc_critic": ["rl.advantage=gae", "critic.mc_weight=1.0", "critic.mc_rollouts=4"],
    "mc_grpo": ["rl.advantage=mc_grpo", "rl.mc_grpo.states=128", "critic.mc_rollouts=4"],
}
LABELS = {
    "grpo": "GRPO (Dr.GRPO centring)",
    "grpo_shaped": "GRPO + potential shaping (c = 0.5)",
    "gigpo": "GiGPO",
    "ppo_gae": "PPO + GAE (critic)",
    "ppo_vapo": "PPO + decoupled, length-adaptive GAE + value pretraining",
    "mc_critic": "PPO + GAE on MC-critic values (random rollouts)",
    "mc_grpo": "MC-GRPO (Q_MC of G actions per state)",
}


def _start_time(metrics: RunMetrics) -> float:
    """Time of the run's first record (curves count seconds from it)."""
    records = [*metrics.bc_epochs, *metrics.evals, *metrics.iterations, *metrics.warnings,
               *(r for r in (metrics.bc, metrics.value_pretrain) if r is not None)]
    return min((r.time for r in records), default=0.0)


def _curve(run_dir: Path) -> list[dict]:
    """The run's evaluations: env steps, held-out success, seconds since its first record."""
    metrics = read_metrics(run_dir)
    start = _start_time(metrics)
    return [{"env_steps": e.env_steps, "success": e.result.success_rate, "seconds": round(e.time - start, 1)}
            for e in metrics.evals]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--env-steps", type=int, default=25_000, help="policy env steps of RL per run")
    ap.add_argument("--threshold", type=float, default=0.40, help="held-out success counted as reached")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (each with torch threads=1)")
    ap.add_argument("--work", type=Path, default=RESULTS / "algorithms", help="run directories (default %(default)s)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory of algorithms.json/.md/.png (default %(default)s)")
    ap.add_argument("--recipe", default="sokoban-tiny")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="extra",
                    help="more overrides for every run, BC starts included")
    ap.add_argument("--report-only", action="store_true", help="rewrite the table and plot from algorithms.json")
    args = ap.parse_args()
    work, out = args.work, args.out
    if args.report_only:
        records = json.loads((out / "algorithms.json").read_text())
        (out / "algorithms.md").write_text(markdown(records, args))
        plot(records, out / "algorithms.png", args.threshold)
        print(markdown(records, args))
        return
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    common = ["threads=1", "eval.every=5", f"rl.max_env_steps={args.env_steps}", "rl.iterations=1000", "flywheel.rounds=0"]

    t0 = time.time()
    # 1. one BC start per seed
    starts = bc_starts(work, args.recipe, ["threads=1", *args.extra], args.seeds, args.jobs)
    print(f"BC starts done in {time.time() - t0:.0f}s", flush=True)
    # 2. every method from each seed's BC checkpoint
    runs = [(m, s) for s in args.seeds if s in starts for m in args.methods]
    jobs = [
        Job(args.recipe, (f"seed={s}", *from_bc(starts[s]), *common, *METHODS[m], *args.extra), work / f"{m}-{s}")
        for m, s in runs
    ]
    summaries = run_all(jobs, args.jobs)

    records = []
    for (m, s), summary in zip(runs, summaries):
        if summary is None:
            continue
        curve = _curve(work / f"{m}-{s}")
        reached = next((p for p in curve if p["success"] >= args.threshold), None)  # first evaluation at or above
        records.append({
            "method": m,
            "seed": s,
            "heldout_success": summary.eval_after_rl.success_rate,
            "heldout_success_before_rl": summary.eval_before_rl.success_rate,
            "heldout_episodes": summary.eval_after_rl.episodes,
            "env_steps": summary.env_steps,
            "mc_env_steps": summary.mc_env_steps,
            "wall_seconds": summary.wall_seconds,
            "rl_iterations": summary.rl_iterations,
            "env_step_budget": args.env_steps,
            "threshold": args.threshold,
            "env_steps_to_threshold": reached["env_steps"] if reached else None,
            "seconds_to_threshold": reached["seconds"] if reached else None,
            "curve": curve,
        })
        print(f"{m:10s} seed {s}: {records[-1]['heldout_success_before_rl']:.3f} -> {records[-1]['heldout_success']:.3f} "
              f"({summary.wall_seconds:.0f}s)", flush=True)
    if not records:
        raise SystemExit(f"no run finished; see the .log files in {work}")
    (out / "algorithms.json").write_text(json.dumps(records, indent=1) + "\n")
    table = markdown(records, args)
    (out / "algorithms.md").write_text(table)
    plot(records, out / "algorithms.png", args.threshold)
    print(table)
    print(f"total {time.time() - t0:.0f}s; wrote {out}/algorithms.json, .md, .png")


def markdown(records: list[dict], args: argparse.Namespace) -> str:
    def med(xs: list) -> str:
        xs = [x for x in xs if x is not None]
        return f"{statistics.median(xs):,.0f}" if xs else "—"

    lines = [
        f"Held-out success on {args.recipe} ({records[0].get('heldout_episodes', 200)} held-out episodes per evaluation, "
        "sampled at T=1), "
        f"RL budget {records[0]['env_step_budget']:,} policy env steps, "
        f"seeds {', '.join(map(str, sorted({r['seed'] for r in records})))}; threshold {records[0]['threshold']:.2f}.",
        "",
        "| method | before RL | after RL (mean ± std) | gain, points (mean ± std over seeds) | env steps | MC env steps | "
        "RL wall s | env steps to threshold | wall s to threshold | reached |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in dict.fromkeys(r["method"] for r in records):
        rs = [r for r in records if r["method"] == m]
        after = [r["heldout_success"] for r in rs]
        before = [r["heldout_success_before_rl"] for r in rs]
        std = statistics.stdev(after) if len(after) > 1 else 0.0
        gains = [100 * (a - b) for a, b in zip(after, before)]  # paired: each seed against its own BC start
        gain_std = statistics.stdev(gains) if len(gains) > 1 else 0.0
        reached = [r for r in rs if r["env_steps_to_threshold"] is not None]
        lines.append(
            f"| {LABELS[m]} | {statistics.mean(before):.3f} | {statistics.mean(after):.3f} ± {std:.3f} | "
            f"{statistics.mean(gains):+.1f} ± {gain_std:.1f} | "
            f"{med([r['env_steps'] for r in rs])} | {med([r['mc_env_steps'] for r in rs])} | {med([r['wall_seconds'] for r in rs])} | "
            f"{med([r['env_steps_to_threshold'] for r in reached])} | {med([r['seconds_to_threshold'] for r in reached])} | "
            f"{len(reached)}/{len(rs)} |"
        )
    return "\n".join(lines) + "\n"


def plot(records: list[dict], path: Path, threshold: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for m in dict.fromkeys(r["method"] for r in records):
        curves = [r["curve"] for r in records if r["method"] == m]
        n = min(len(c) for c in curves)
        x = np.mean([[p["env_steps"] for p in c[:n]] for c in curves], axis=0)
        y = np.array([[p["success"] for p in c[:n]] for c in curves])
        ax.plot(x, y.mean(0), marker="o", label=LABELS[m])
        gain = 100 * (y - y[:, :1])  # points above each seed's own BC start
        bx.plot(x, gain.mean(0), marker="o", label=LABELS[m])
        if len(curves) > 1:
            bx.fill_between(x, gain.mean(0) - gain.std(0, ddof=1), gain.mean(0) + gain.std(0, ddof=1), alpha=0.08)
    ax.axhline(threshold, color="grey", ls=":", lw=1)
    ax.set_ylabel("held-out success (mean over seeds)")
    bx.axhline(0, color="grey", lw=1)
    bx.set_ylabel("gain over the seed's BC start, points")
    bx.set_title("mean over seeds; band = ±1 std", fontsize=9)
    for a in (ax, bx):
        a.set_xlabel("policy env steps (RL, incl. value pretraining)")
        a.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
