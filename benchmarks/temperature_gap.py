"""Is RL's gain more than sharpening? Held-out success of checkpoints at several temperatures.

    python benchmarks/temperature_gap.py RUN_DIR [RUN_DIR ...] [--temperatures 1.0 0.3]
        [--episodes 500] [--checkpoints bc final] [--out runs/benchmarks/temperature_gap.json]

Each checkpoint plays the first ``episodes`` held-out levels with the env and rollout
settings of the run's ``config.yaml`` (the same levels and sampling seed for every
checkpoint), once per temperature. A lower temperature sharpens a policy without teaching
it anything; if the BC checkpoint sampled at T = 0.3 does as well as the RL checkpoint at
T = 1, RL's gain is what sharpening gives, and an RL checkpoint that does no better at
T = 0.3 than BC at T = 0.3 has not corrected BC's mistakes. Episodes are played by the
rollout engine, envs in this process (``turnforge.train.evaluate``). Writes JSON (default
``runs/benchmarks/temperature_gap.json``) and a Markdown table next to it.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

from _checkpoints import engine, load, parser, save, score
from turnforge.train.evaluate import evaluate


def success_by_temperature(run: Path, checkpoint: str, temperatures: list[float], episodes: int) -> dict[str, float]:
    cfg, policy = load(run, checkpoint)
    with closing(engine(cfg, policy, min(episodes, 256))) as eng:
        return {
            f"T={t:g}": evaluate(eng, policy, episodes=episodes, split="heldout", temperature=t, seed=0)[0].success_rate
            for t in temperatures
        }


def main() -> None:
    ap = parser(__doc__, "temperature_gap")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.3])
    ap.add_argument("--episodes", type=int, default=500)
    args = ap.parse_args()
    rows = score(args, lambda run, ck: success_by_temperature(run, ck, args.temperatures, args.episodes))
    keys = [f"T={t:g}" for t in args.temperatures]
    lines = [f"Held-out success ({args.episodes} episodes) by sampling temperature", "",
             "| run | checkpoint | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    lines += [f"| {r['run']} | {r['checkpoint']} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + " |" for r in rows]
    save(args.out, rows, lines)


if __name__ == "__main__":
    main()
