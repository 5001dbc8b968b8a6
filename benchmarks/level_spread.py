"""Where RL's gain comes from: per-level success of checkpoints on the same held-out levels.

    python benchmarks/level_spread.py RUN_DIR [RUN_DIR ...] [--levels 100] [--samples 8]
        [--checkpoints bc final] [--out runs/benchmarks/level_spread.json]

Each checkpoint plays ``samples`` sampled episodes (the run's temperature) on each of the
first ``levels`` held-out levels, with the env and rollout settings of the run's
``config.yaml`` (played by the rollout engine, 64 envs in this process). Reported per checkpoint: the mean success, the share of levels never solved
and always solved, and a histogram of per-level success rates. A policy-gradient method
with a group baseline gets no signal from a level none of its G rollouts solve, so the
"never solved" share of the BC start bounds what GRPO can fix within its exploration.
Writes JSON (default ``runs/benchmarks/level_spread.json``) and a Markdown table next to it.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import numpy as np

from _checkpoints import engine, load, parser, save, score
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest
from turnforge.seeding import generator

BINS = (0.0, 0.01, 0.26, 0.51, 0.76, 0.99, 1.01)
LABELS = ("0", "(0, 0.25]", "(0.25, 0.5]", "(0.5, 0.75]", "(0.75, 1)", "1")


def level_rates(run: Path, checkpoint: str, levels: int, samples: int, seed: int) -> np.ndarray:
    """Success rate of each of the first ``levels`` held-out levels over ``samples`` episodes."""
    cfg, policy = load(run, checkpoint)
    actor = PolicyActor(policy, cfg.rollout.max_new_tokens, cfg.eval.temperature, generator(seed, "level-spread"))
    wins = np.zeros(levels)
    with closing(engine(cfg, policy, 64)) as eng:
        requests = [
            EpisodeRequest(eng.env.task("heldout", i), env_seed=1_000_003 * j + i, group_id=f"level-{i}", trajectory_id=f"{i}-{j}")
            for i in range(levels) for j in range(samples)
        ]
        trajs, _ = eng.play(requests, actor)
    for t in trajs:
        wins[int(t.trajectory_id.split("-")[0])] += t.success
    return wins / samples


def main() -> None:
    ap = parser(__doc__, "level_spread")
    ap.add_argument("--levels", type=int, default=100)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    def row_of(run: Path, ck: str) -> dict:
        r = level_rates(run, ck, args.levels, args.samples, args.seed)
        return {
            "levels": args.levels, "samples": args.samples,
            "success": float(r.mean()), "never_solved": float(np.mean(r == 0)), "always_solved": float(np.mean(r == 1)),
            "histogram": dict(zip(LABELS, np.histogram(r, bins=BINS)[0].tolist())),
        }

    rows = score(args, row_of)
    lines = ["| run | checkpoint | success | never solved | always solved | levels by success rate " + " / ".join(LABELS) + " |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['run']} | {row['checkpoint']} | {row['success']:.3f} | {row['never_solved']:.2f} | "
                     f"{row['always_solved']:.2f} | {' / '.join(str(v) for v in row['histogram'].values())} |")
    save(args.out, rows, lines)


if __name__ == "__main__":
    main()
