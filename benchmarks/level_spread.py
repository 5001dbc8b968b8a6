"""Where RL's gain comes from: per-level success of checkpoints on the same held-out levels.

    python benchmarks/level_spread.py RUN_DIR [RUN_DIR ...] [--levels 100] [--samples 8]
        [--checkpoints bc final] [--out benchmarks/results/level_spread.json]

Each checkpoint plays ``samples`` sampled episodes (the run's temperature) on each of the
first ``levels`` held-out levels, with the env and rollout settings of the run's
``config.yaml``. Reported per checkpoint: the mean success, the share of levels never solved
and always solved, and a histogram of per-level success rates. A policy-gradient method
with a group baseline gets no signal from a level none of its G rollouts solve, so the
"never solved" share of the BC start bounds what GRPO can fix within its exploration.
Writes JSON and a Markdown table next to it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from _checkpoints import parser, save, score
from turnforge.config import load_config
from turnforge.envs import make
from turnforge.policy.model import load_policy
from turnforge.rollout.runner import EpisodeRequest, PolicyActor, rollout
from turnforge.train.common import generator

BINS = (0.0, 0.01, 0.26, 0.51, 0.76, 0.99, 1.01)
LABELS = ("0", "(0, 0.25]", "(0.25, 0.5]", "(0.5, 0.75]", "(0.75, 1)", "1")


def level_rates(run: Path, checkpoint: str, levels: int, samples: int, seed: int) -> np.ndarray:
    """Success rate of each of the first ``levels`` held-out levels over ``samples`` episodes."""
    cfg = load_config(str(run / "config.yaml"))
    policy = load_policy(run / "checkpoints" / checkpoint)
    envs = [make(cfg.env.id, **cfg.env.kwargs) for _ in range(64)]
    actor = PolicyActor(policy, cfg.rollout.max_new_tokens, cfg.eval.temperature, generator(seed, "level-spread"))
    requests = [
        EpisodeRequest(envs[0].task("heldout", i), env_seed=1_000_003 * j + i, group_id=f"level-{i}", trajectory_id=f"{i}-{j}")
        for i in range(levels) for j in range(samples)
    ]
    wins = np.zeros(levels)
    for b in range(0, len(requests), len(envs)):
        trajs, _ = rollout(actor, envs, requests[b:b + len(envs)], cfg.rollout, policy)
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
