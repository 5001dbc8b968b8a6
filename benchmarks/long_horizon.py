"""Flat memory over long horizons: the same summarize run with 30-turn and with 300-turn
episodes, side by side: peak RSS and seconds per env step of each.

    python benchmarks/long_horizon.py                   # 30 vs 300 turns, keydoor-tiny
    python benchmarks/long_horizon.py --lengths 30 300 1000

Each length is one ``turnforge train`` run of ``--recipe`` in its own process (so the peak RSS
is that run's alone: ``summary.json``'s ``peak_memory``), with corridors of exactly that many
cells and no gates (an episode is that long whenever the policy walks on), a short BC stage
(32 demonstrations, 4 epochs: the policy walks),
a few RL iterations and a small evaluation. With ``rollout.context=summarize`` every context
stays under the budget, so memory and time per step should not grow with the episode. Results:
``--out`` (default ``runs/benchmarks/long_horizon.json``) and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _runs import RESULTS, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="keydoor-tiny")
    ap.add_argument("--lengths", nargs="+", type=int, default=[30, 300])
    ap.add_argument("--work", type=Path, default=RESULTS / "long_horizon")
    ap.add_argument("--out", type=Path, default=RESULTS / "long_horizon.json")
    args = ap.parse_args()
    rows = []
    for n in args.lengths:
        run_dir = args.work / f"len-{n}"
        overrides = [f"env.kwargs.min_length={n}", f"env.kwargs.max_length={n}", "env.kwargs.gate_every=0",
                     f"rollout.max_turns={n + 20}", "bc.num_demos=32", "bc.epochs=4", "flywheel.rounds=0", "rl.iterations=3",
                     "rl.tasks_per_iteration=4", "rl.group_size=2", "eval.episodes=8", "eval.bc_temperatures=[]",
                     "checkpoint_every=5"]
        if not (run_dir / "summary.json").exists():
            subprocess.run([sys.executable, "-m", "turnforge.cli", "train", args.recipe, *overrides, "--out", str(run_dir)],
                           check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL)
        summary = json.loads((run_dir / "summary.json").read_text())
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rl = [m for m in metrics if m.get("event") == "rl_iter"]
        steps = sum(m["rollout"]["turns"] for m in rl)
        seconds = sum(m["rollout_seconds"] + m["credit_seconds"] + m["update_seconds"] for m in rl)
        rows.append({
            "length": n, "peak_rss_mib": summary["peak_memory"]["process_mib"],
            "rl_seconds": round(seconds, 2), "rl_env_steps": steps,
            "seconds_per_rl_step": round(seconds / steps, 5) if steps else None,
            "summaries": sum(m["rollout"]["summaries"] for m in rl),
            "eval_mean_turns": summary["eval_after_rl"]["mean_turns"],
        })
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    table = [(f"`{args.recipe}` with corridors of {', '.join(map(str, args.lengths))} cells (one run each, in its own "
              f"process); {cpu()}, {time.strftime('%Y-%m-%d')}"), "",
             "| corridor | peak RSS (MiB) | vs shortest | RL seconds per env step | vs shortest | mean turns (eval) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        per = r["seconds_per_rl_step"]
        ratio = f"{per / base['seconds_per_rl_step']:.2f}x" if per and base["seconds_per_rl_step"] else "n/a"
        table.append(f"| {r['length']} | {r['peak_rss_mib']:.0f} | {r['peak_rss_mib'] / base['peak_rss_mib']:.2f}x | "
                     f"{per} | {ratio} | {r['eval_mean_turns']:.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
