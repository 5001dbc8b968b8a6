"""Episodic memory on and off: the whole recipe (BC, then its flywheel) with and without the run's
past successes shown at reset, at an equal env-step budget, over several seeds.

    python benchmarks/episodic_memory.py                        # sokoban-tiny, variants off on, seeds 0 1
    python benchmarks/episodic_memory.py --seeds 0 --episodes 200 --variants off on on_k2

One run of the recipe per variant and seed: BC from the same demonstrations (the same expert
labels), evaluated at the recipe's ``eval.bc_temperatures`` (each variant's own baseline: with
memory, BC's prompts already hold past demonstrations), then the recipe's flywheel rounds (each
with the same env-step budget), then ``--episodes`` held-out episodes. Variants:

- ``off``: the recipe as it is;
- ``on``: ``memory.enabled=true``: one past success per episode, recalled from the
  demonstrations (played in waves, so BC sees memory blocks) and the policy's own plain and
  retried successes of train tasks, added after each round;
- ``on_k2``: two past successes per episode (``memory.k=2``, ``memory.max_tokens=256``).

The evaluations of a run with memory recall from what its training added (held-out tasks are
never added). Outputs (``--out``, default ``runs/benchmarks/episodic_memory.json`` and ``.md``):
held-out success after BC at its best temperature and after the flywheel, per seed and the mean,
with the memory's size and the share of held-out episodes that were shown a past success.
Finished runs in ``--work`` are reused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from _runs import RESULTS, Job, cpu, run_all
from memory_contexts import _metrics

VARIANTS = {
    "off": (),
    "on": ("memory.enabled=true",),
    "on_k2": ("memory.enabled=true", "memory.k=2", "memory.max_tokens=256"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="sokoban-tiny")
    ap.add_argument("--variants", nargs="+", default=["off", "on"], choices=list(VARIANTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--episodes", type=int, default=500, help="Held-out episodes per evaluation (default %(default)s)")
    ap.add_argument("--jobs", type=int, default=1, help="Runs at once (default %(default)s)")
    ap.add_argument("--work", type=Path, default=RESULTS / "episodic_memory")
    ap.add_argument("--out", type=Path, default=RESULTS / "episodic_memory.json")
    args = ap.parse_args()
    t0 = time.time()
    common = (f"eval.episodes={args.episodes}",)
    jobs = [Job(args.recipe, (f"seed={s}", *common, *VARIANTS[v]), args.work / f"{v}-{s}")
            for s in args.seeds for v in args.variants]
    rows = []
    for job, summary in zip(jobs, run_all(jobs, args.jobs)):
        variant, seed = job.out_dir.name.rsplit("-", 1)
        if summary is None:
            rows.append({"variant": variant, "seed": int(seed), "failed": True})
            continue
        best = summary.eval_bc_best_temperature
        bc_best = best.eval.success_rate if best else summary.eval_before_rl.success_rate
        rounds = [m for m in _metrics(job.out_dir) if m.get("event") == "flywheel_round"]
        evals = [m for m in _metrics(job.out_dir) if m.get("event") == "eval" and m["tag"] == "after-rl"]
        rows.append({
            "variant": variant, "seed": int(seed), "overrides": list(job.overrides), "bc_best": bc_best,
            "final": summary.eval_after_rl.success_rate, "gain_over_bc_best_points": round(100 * (summary.eval_after_rl.success_rate - bc_best), 1),
            "env_steps": summary.env_steps, "wall_seconds": round(summary.wall_seconds),
            "rounds": [m["eval"]["success_rate"] for m in rounds],
            "memory_tasks": rounds[-1].get("memory_entries", 0) if rounds else 0,
            "plain_success_per_round": [round(m["plain"][1] / max(m["plain"][0], 1), 3) for m in rounds],
            "heldout_recall_share": (evals[-1]["result"].get("memory_recall_rate") if evals else None),
        })
    ok = [r for r in rows if not r.get("failed")]
    table = [f"`{args.recipe}`: {args.episodes} held-out episodes per evaluation, seeds {args.seeds}; {cpu()}, "
             f"{round(time.time() - t0)} s", "",
             "| variant | BC (best T) per seed | after the flywheel per seed | gain over BC best, points (mean) | "
             "plain success per round (seed 0) | remembered tasks | held-out episodes shown a memory |",
             "|---|---|---|---|---|---|---|"]
    for v in args.variants:
        mine = [r for r in ok if r["variant"] == v]
        if not mine:
            table.append(f"| {v} | failed (see the logs) | | | | | |")
            continue
        recall = [r["heldout_recall_share"] for r in mine if r["heldout_recall_share"] is not None]
        bc = ", ".join(f"{r['bc_best']:.3f}" for r in mine)
        final = ", ".join(f"{r['final']:.3f}" for r in mine)
        table.append(
            f"| {v} | {bc} | {final} | "
            f"{statistics.mean(r['gain_over_bc_best_points'] for r in mine):+.1f} | {mine[0]['plain_success_per_round']} | "
            f"{', '.join(str(r['memory_tasks']) for r in mine)} | "
            f"{', '.join(f'{x:.2f}' for x in recall) if recall else '-'} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
