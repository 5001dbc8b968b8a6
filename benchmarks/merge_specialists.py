"""Merging a Sokoban specialist and a FrozenLake specialist of one base (``turnforge merge``).

    python benchmarks/merge_specialists.py                        # seed 0, 500 held-out episodes per env
    python benchmarks/merge_specialists.py --smoke                # minutes: tiny budgets, to check the pipeline

1. The base: one tiny model whose tokenizer is trained on both envs' text
   (``model.tiny.corpus_envs=[sokoban, frozenlake]``), so both specialists share it.
2. The specialists: ``sokoban-tiny`` and ``frozenlake-tiny`` from that base (``model.path``), each
   its recipe as shipped (BC, then its flywheel rounds or GRPO).
3. Merges of the two final checkpoints: a ``--sweep`` of ``linear`` (t = 0, 0.25, ... 1) and single
   merges with each task-vector method at its default weights (every task vector whole), each
   evaluated on both envs with the specialist's own run config (``turnforge eval --config``).

The target (issue 34): a merge keeps >= 90% of each specialist's success on its own env and
beats each specialist on the other env. Compared with a multi-env run at equal env steps: not
built (one run trains on one env). Outputs (``--out``, default ``runs/benchmarks/``):
``merge_specialists.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from _runs import RESULTS, Job, cpu, run_all

ENVS = {"sokoban": "sokoban-tiny", "frozenlake": "frozenlake-tiny"}
METHODS = ("task_arithmetic", "ties", "dare", "ram")
SMOKE = ("bc.num_demos=32", "bc.epochs=2", "flywheel.rounds=0", "rl.iterations=2", "eval.bc_temperatures=[]",
         "eval.pass_at_k_samples=0")


def turnforge(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "turnforge.cli", *map(str, args)], check=True, capture_output=True)


def evaluate(model: Path, run_dir: Path, episodes: int, out: Path) -> float:
    """Held-out success of ``model`` with the specialist run's config."""
    if not out.exists():
        turnforge("eval", model, "--config", run_dir / "config.yaml", "--episodes", str(episodes), "--out", out)
    return json.loads(out.read_text())["success_rate"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--episodes", type=int, default=500)
    ap.add_argument("--points", type=int, default=5, help="Linear sweep points")
    ap.add_argument("--smoke", action="store_true", help="Tiny budgets (pipeline check, not a figure)")
    ap.add_argument("--work", type=Path, default=RESULTS / "merge_specialists")
    ap.add_argument("--out", type=Path, default=RESULTS / "merge_specialists.json")
    args = ap.parse_args()
    t0 = time.time()
    from turnforge.config import TinyModelConfig
    from turnforge.policy.tiny import build_tiny_model

    base = args.work / "base"
    if not (base / "model.safetensors").exists():
        build_tiny_model(base, TinyModelConfig(corpus_envs=("sokoban", "frozenlake")))
    extra = SMOKE if args.smoke else ()
    common = (f"model.path={base.resolve()}", f"seed={args.seed}", f"eval.episodes={args.episodes}", *extra)
    jobs = [Job(recipe, common, args.work / f"{env}-{args.seed}") for env, recipe in ENVS.items()]
    if any(s is None for s in run_all(jobs)):
        raise SystemExit("a specialist run failed; see its log")
    runs = {env: job.out_dir for env, job in zip(ENVS, jobs)}
    finals = [runs[env] / "checkpoints" / "final" for env in ENVS]
    evals = args.work / "evals"
    evals.mkdir(exist_ok=True)
    table = {}
    for env in ENVS:  # each specialist on both envs
        table[f"{env} specialist"] = {e: evaluate(runs[env] / "checkpoints" / "final", runs[e], args.episodes,
                                                  evals / f"{env}-specialist-on-{e}.json") for e in ENVS}
    sweep = args.work / "sweep-linear"
    if not (sweep / "sweep.json").exists():
        turnforge("merge", *finals, "--method", "linear", "--sweep", str(args.points), "--episodes", str(args.episodes),
                  "--out", sweep)
    for point in json.loads((sweep / "sweep.json").read_text())["points"]:
        table[f"linear t={point['t']:g}"] = {e: point["results"][e]["success_rate"] for e in ENVS}
    for method in METHODS:
        merged = args.work / f"merge-{method}"
        if not (merged / "merge.json").exists():
            turnforge("merge", *finals, "--base", base, "--method", method, "--out", merged)
        table[method] = {e: evaluate(merged, runs[e], args.episodes, evals / f"{method}-on-{e}.json") for e in ENVS}
    spec = {e: table[f"{e} specialist"][e] for e in ENVS}
    other = {e: table[f"{o} specialist"][e] for e in ENVS for o in ENVS if o != e}
    rows = []
    for name, res in table.items():
        keeps = all(res[e] >= 0.9 * spec[e] for e in ENVS)
        beats = all(res[e] > other[e] for e in ENVS)
        rows.append({"model": name, **{e: res[e] for e in ENVS}, "keeps_90": keeps, "beats_other": beats})
    lines = [f"Sokoban + FrozenLake specialists of one tiny base, seed {args.seed}, {args.episodes} held-out episodes per env"
             f"{' (smoke budgets: not a figure)' if args.smoke else ''}; {cpu()}, {round(time.time() - t0)} s", "",
             "| model | sokoban | frozenlake | keeps >= 90% of each specialist | beats the other specialist on both |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['sokoban']:.3f} | {r['frozenlake']:.3f} | {'yes' if r['keeps_90'] else 'no'} | "
              f"{'yes' if r['beats_other'] else 'no'} |" for r in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"seed": args.seed, "episodes": args.episodes, "smoke": args.smoke, "rows": rows}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
