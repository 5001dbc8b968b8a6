"""Context policies on a memory env: summarize (summaries trained or masked) against window and
full_history, each trained BC -> flywheel rounds at an equal env-step budget, over several seeds.

    python benchmarks/memory_contexts.py                                  # 4 variants, seeds 0 1
    python benchmarks/memory_contexts.py --variants summarize window --seeds 0 --episodes 200
    python benchmarks/memory_contexts.py --variants summarize_mask --seeds 0 --jobs 2 --set threads=1

Every variant runs the recipe (default ``keydoor-tiny``: a 100-300 cell corridor, the key's
colour shown once, a lock every 40 cells; a 512-token context budget) from the same
demonstrations (the same expert labels: ``bc.num_demos`` episodes of the same tasks) with its
own context policy, then the recipe's flywheel rounds (each round's budget is env steps, so
every variant plays as many), then ``--episodes`` held-out episodes. Variants:

- ``summarize``: the recipe (``rollout.context=summarize``, summaries trained);
- ``summarize_mask``: ``rollout.summary_loss=mask`` (the summaries' tokens get no gradient in BC
  or RL: the CompactionRL ablation);
- ``window``: the last ``--window`` turns (the key is out of sight after that), with
  ``--window-bc-epochs`` BC epochs (its per-turn samples repeat every turn's context);
- ``full_history``: the whole episode in one context (it overflows the budget).

Outputs (``--out``, default ``runs/benchmarks/``): ``memory_contexts.json`` (one record per
run) and ``memory_contexts.md`` (held-out success after BC at its best temperature and after
RL, per seed and the mean, locks opened, summaries and context overflows per episode). Runs
finished in ``--work`` are reused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from _runs import RESULTS, Job, cpu, run_all

VARIANTS = ("summarize", "summarize_mask", "window", "full_history")


def overrides(variant: str, window: int, window_epochs: int) -> tuple[str, ...]:
    return {
        "summarize": (),
        "summarize_mask": ("rollout.summary_loss=mask",),
        "window": ("rollout.context=window", f"rollout.history_window={window}", f"bc.epochs={window_epochs}"),
        "full_history": ("rollout.context=full_history",),
    }[variant]


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _last_line(log: Path) -> str | None:
    lines = [x for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    return lines[-1][-300:] if lines else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="keydoor-tiny")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--episodes", type=int, default=500, help="Held-out episodes per evaluation (default %(default)s)")
    ap.add_argument("--window", type=int, default=2, help="History turns of the window variant (default %(default)s)")
    ap.add_argument("--window-bc-epochs", type=int, default=2, help="BC epochs of the window variant (default %(default)s)")
    ap.add_argument("--jobs", type=int, default=1, help="Runs at once (default %(default)s)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="Overrides for every run, e.g. threads=1 with --jobs 2 on 2 cores")
    ap.add_argument("--work", type=Path, default=RESULTS / "memory_contexts")
    ap.add_argument("--out", type=Path, default=RESULTS / "memory_contexts.json")
    args = ap.parse_args()
    common = (f"eval.episodes={args.episodes}", *args.set)
    jobs = [Job(args.recipe, (f"seed={s}", *common, *overrides(v, args.window, args.window_bc_epochs)), args.work / f"{v}-{s}")
            for v in args.variants for s in args.seeds]
    t0 = time.time()
    summaries = run_all(jobs, args.jobs)
    rows = []
    for job, summary in zip(jobs, summaries):
        variant, seed = job.out_dir.name.rsplit("-", 1)
        if summary is None:  # e.g. the flywheel stops when no episode of a round succeeded: nothing to train on
            evals = [m for m in _metrics(job.out_dir) if m.get("event") == "eval"]
            bc = [m["result"]["success_rate"] for m in evals if m["tag"] in ("before-rl", "bc")]
            rows.append({"variant": variant, "seed": int(seed), "failed": True, "bc_best": max(bc) if bc else None,
                         "stopped": _last_line(job.out_dir.with_suffix(".log"))})
            continue
        metrics = _metrics(job.out_dir)
        best = summary.eval_bc_best_temperature
        rows.append({
            "variant": variant, "seed": int(seed), "overrides": list(job.overrides),
            "bc_best": best.eval.success_rate if best else summary.eval_before_rl.success_rate,
            "bc_best_temperature": best.temperature if best else None,
            "bc_t1": summary.eval_before_rl.success_rate, "final": summary.eval_after_rl.success_rate,
            "gain_over_bc_best_points": summary.gain_over_bc_best_points,
            "mean_turns": summary.eval_after_rl.mean_turns,
            "env_steps": summary.env_steps, "wall_seconds": round(summary.wall_seconds),
            "rounds": [m["eval"]["success_rate"] for m in metrics if m.get("event") == "flywheel_round"],
            "peak_rss_mib": summary.peak_memory.process_mib if summary.peak_memory else None,
        })
    ok = [r for r in rows if not r.get("failed")]
    table = [(f"`{args.recipe}`: {args.episodes} held-out episodes per evaluation, seeds {args.seeds}; {cpu()}, "
              f"{round(time.time() - t0)} s"), "",
             "| variant | BC (best T) per seed | after the flywheel per seed | mean BC | mean after |", "|---|---|---|---|---|"]
    for v in args.variants:
        mine = [r for r in ok if r["variant"] == v]
        if not mine:
            stopped = [r for r in rows if r["variant"] == v]
            bc = ", ".join("n/a" if r.get("bc_best") is None else f"{r['bc_best']:.3f}" for r in stopped)
            table.append(f"| {v} | {bc} | stopped before training (see the JSON) | | |")
            continue
        bc = ", ".join(f"{r['bc_best']:.3f}" for r in mine)
        final = ", ".join(f"{r['final']:.3f}" for r in mine)
        table.append(f"| {v} | {bc} | {final} | {statistics.mean(r['bc_best'] for r in mine):.3f} | "
                     f"{statistics.mean(r['final'] for r in mine):.3f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
