"""RL update time with and without merging repeated samples (``rl.merge_duplicates``).

    python benchmarks/merge_duplicates.py RUN_DIR [--iterations 0 10 20 30] [--reps 3]
        [--threads 2] [--out runs/benchmarks/merge_duplicates.json]

For each RL iteration named, the run's own samples and the advantages it trained on are read
back from ``RUN_DIR/trajectories/rl_*.parquet`` (groups whose advantages are all 0 left out,
as the run does), and turnforge's PPO update (``turnforge.train.update.ppo_update``, the run's
config) is timed on them from the run's BC checkpoint, merging off and on alternately,
``reps`` times each. Reported per iteration: samples, merged rows, median seconds of each
and their ratio. (The logged mean losses differ: minibatches hold other samples once copies
are merged; ``tests/train/test_merge.py`` checks that one batch's loss and gradients agree.)
Writes JSON (default ``runs/benchmarks/merge_duplicates.json``) and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from _checkpoints import save
from _runs import RESULTS

from turnforge.app.config import load_config
from turnforge.data.store import read_trajectories
from turnforge.optim import GuardedStep
from turnforge.policy.model import load_policy, quiet_hf
from turnforge.seeding import rng
from turnforge.train.metrics import UpdateStats
from turnforge.train.update import ppo_update
from turnforge.types import Sample


def load_samples(run: Path, iteration: int) -> list[tuple[Sample, float]]:
    rows = read_trajectories(run / "trajectories" / f"rl_{iteration:05d}.parquet").to_pylist()
    flat = {g for g in {r["group_id"] for r in rows} if all(abs(r["advantage"]) < 1e-8 for r in rows if r["group_id"] == g)}
    return [
        (
            Sample(
                np.asarray(r["token_ids"], np.int64), np.asarray(r["loss_mask"], np.int8),
                np.asarray([np.nan if v is None else v for v in r["logprobs"]], np.float32),
                np.asarray(r["versions"], np.int32), r["trajectory_id"], r["turn_index"],
            ),
            float(r["advantage"]),
        )
        for r in rows if r["group_id"] not in flat and r["infra_failure"] is None
    ]


def timed_update(run: Path, merge: bool, samples: list[tuple[Sample, float]], iteration: int) -> tuple[float, UpdateStats]:
    cfg = load_config(str(run / "config.yaml"), [f"rl.merge_duplicates={str(merge).lower()}"])
    policy = load_policy(run / "checkpoints" / "bc")
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=cfg.rl.lr)
    step = GuardedStep(policy.model, optimizer, cfg.rl.max_grad_norm, cfg.rl.max_bad_steps)
    t0 = time.perf_counter()
    stats = ppo_update(policy, samples, step, cfg.rl, temperature=cfg.rollout.temperature,
                       shuffle=rng(cfg.seed, "rl-shuffle", iteration))
    return time.perf_counter() - t0, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--iterations", type=int, nargs="+", default=[0, 10, 20, 30])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "merge_duplicates.json",
                    help="JSON result file, Markdown table next to it (default %(default)s)")
    args = ap.parse_args()
    quiet_hf()
    torch.set_num_threads(args.threads)
    rows = []
    for it in args.iterations:
        samples = load_samples(args.run, it)
        times: dict[bool, list[float]] = {False: [], True: []}
        stats: dict[bool, UpdateStats] = {}
        for _ in range(args.reps):
            for merge in (False, True):
                seconds, stats[merge] = timed_update(args.run, merge, samples, it)
                times[merge].append(seconds)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        rows.append({
            "iteration": it, "samples": len(samples), "merged_rows": round(stats[True].merged_row_fraction * len(samples)),
            "seconds_off": off, "seconds_on": on, "speedup": off / on,
            "tokens_off": stats[False].tokens, "tokens_on": stats[True].tokens,
        })
        print(rows[-1], flush=True)
    table = [
        f"Update time, merging off/on, run `{args.run}` ({args.threads} threads, median of {args.reps})",
        "",
        "| iteration | samples | merged rows | off (s) | on (s) | speed-up |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['iteration']} | {r['samples']} | {r['merged_rows']} | {r['seconds_off']:.2f} | {r['seconds_on']:.2f} "
            f"| {r['speedup']:.2f}x |"
            for r in rows
        ),
    ]
    save(args.out, rows, table)


if __name__ == "__main__":
    main()
