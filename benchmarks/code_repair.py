"""Solvability of the code-repair env: the oracle vs a uniformly random tool caller.

    python benchmarks/code_repair.py [--episodes 200] [--out runs/benchmarks/code_repair.json]

For each split, plays ``episodes`` tasks with the oracle expert and with ``random_action``
(max_steps of the env, default 14 turns), and reports the solve rates, the share of tasks by
bug kind, the time to build the mutant catalogue and the mean wall time of an episode.
Episodes are played directly on one env instance (``env.reset``/``env.step``): this measures the
env, not the rollout engine. Writes JSON (default ``runs/benchmarks/code_repair.json``) and a
Markdown table next to it.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from pathlib import Path

from _runs import RESULTS
from turnforge.envs import make
from turnforge.envs.code import repair


def play(env, policy, split: str, episodes: int) -> dict:
    wins, turns, t0 = 0, 0, time.perf_counter()
    for i in range(episodes):
        env.reset(task=env.task(split, i), seed=i)
        while not env.done:
            r = env.step(policy())
            turns += 1
        wins += r.success
    return {"solved": wins / episodes, "turns_per_episode": turns / episodes,
            "seconds_per_episode": (time.perf_counter() - t0) / episodes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--out", type=Path, default=RESULTS / "code_repair.json",
                    help="JSON result file, Markdown table next to it (default %(default)s)")
    args = ap.parse_args()
    env = make("code-repair")
    t0 = time.perf_counter()
    repair._CATALOGUE = None
    cat = repair.catalogue(env.sandbox)
    result = {"catalogue_mutants": len(cat), "catalogue_seconds": time.perf_counter() - t0,
              "kinds": dict(Counter(kind for _, kind, _ in cat)), "episodes": args.episodes, "splits": {}}
    rng = random.Random(0)
    for split in ("train", "heldout"):
        result["splits"][split] = {"oracle": play(env, env.expert_action, split, args.episodes),
                                   "random": play(env, lambda: env.random_action(rng), split, args.episodes)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"Code repair, {args.episodes} tasks per split; catalogue: {len(cat)} mutants built in "
             f"{result['catalogue_seconds']:.1f} s ({', '.join(f'{k} {v}' for k, v in sorted(result['kinds'].items()))}).", "",
             "| split | policy | solved | turns / episode | s / episode |", "|---|---|---|---|---|"]
    for split, by_policy in result["splits"].items():
        for name, r in by_policy.items():
            lines.append(f"| {split} | {name} | {r['solved']:.3f} | {r['turns_per_episode']:.1f} | {r['seconds_per_episode']:.3f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
