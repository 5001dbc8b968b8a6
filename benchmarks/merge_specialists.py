"""Merging a Sokoban specialist and a FrozenLake specialist (``turnforge merge``), against one
policy trained on the mix of both (``mix-tiny``) at equal env steps.

    python benchmarks/merge_specialists.py                        # seed 0, 500 held-out episodes per env
    python benchmarks/merge_specialists.py --smoke                # minutes: tiny budgets, to check the pipeline

1. The base: one tiny model whose tokenizer is trained on both envs' text
   (``model.tiny.corpus_envs=[sokoban, frozenlake]``), so every run shares it.
2. Setting A, specialists from scratch: ``sokoban-tiny`` and ``frozenlake-tiny`` from that base
   (``model.path``), each its recipe as shipped (BC, then its flywheel rounds or GRPO); merges of
   the two final checkpoints: a ``--sweep`` of ``linear`` (t = 0, 0.25, ... 1) and single merges
   with each task-vector method against the base, each evaluated on both envs with the
   specialist's own run config (``turnforge eval --config``).
3. The multi-task baseline: ``mix-tiny`` from the same base, with the specialists' demonstrations
   together (``bc.num_demos`` = their sum, drawn half and half) and flywheel rounds sized so its
   env steps match the two specialists' together; evaluated on each env alone
   (``env.kwargs.weights=[1,0]`` / ``[0,1]``: exactly the specialists' held-out tasks).
4. Setting B, RL specialists of a shared start (what RAM is written for: sparse RL updates of one
   pretrained model): the mix run's BC checkpoint is the start; ``sokoban-tiny``'s flywheel and
   ``frozenlake-tiny``'s GRPO each continue from it without BC (``bc.enabled=false``), and their
   finals are merged against it (linear 0.5 and every task-vector method).

The target (issue 34): a merge keeps >= 90% of each specialist's success on its own env and
beats each specialist on the other env. Outputs (``--out``, default ``runs/benchmarks/``):
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
    from turnforge.app.config import load_config
    from turnforge.config import TinyModelConfig
    from turnforge.policy.tiny import build_tiny_model
    from turnforge.train.metrics import read_summary

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
    summaries = {env: read_summary(runs[env]) for env in ENVS}
    budget = _Budget.of(summaries.values())

    # 3. the multi-task baseline at equal env steps
    rounds = 1 if args.smoke else 4
    per_round = max(1000, (budget.env_steps - budget.demo_actions) // rounds)
    demos = sum(load_config(str(runs[env] / "config.yaml")).bc.num_demos for env in ENVS)
    mix_job = Job("mix-tiny", (*common, f"bc.num_demos={demos}", f"flywheel.rounds={rounds}",
                               f"flywheel.env_steps_per_round={per_round}"), args.work / f"mix-{args.seed}")
    if run_all([mix_job])[0] is None:
        raise SystemExit("the mix run failed; see its log")
    mix = mix_job.out_dir
    table["mix run (one policy)"] = {e: evaluate_mix(mix / "checkpoints" / "final", e, args.episodes, evals / f"mix-on-{e}.json")
                                     for e in ENVS}
    budgets = {"specialists together": budget, "mix run": _Budget.of([read_summary(mix)])}

    # 4. setting B: RL specialists of the mix run's BC checkpoint, merged against it
    start = mix / "checkpoints" / "bc"
    rl_common = (f"model.path={start.resolve()}", f"seed={args.seed}", f"eval.episodes={args.episodes}", "bc.enabled=false", *extra)
    rl_jobs = [Job(recipe, rl_common, args.work / f"rl-{env}-{args.seed}") for env, recipe in ENVS.items()]
    if any(x is None for x in run_all(rl_jobs)):
        raise SystemExit("an RL specialist run failed; see its log")
    rl_runs = {env: job.out_dir for env, job in zip(ENVS, rl_jobs)}
    table_b = {"shared start (mix BC)": {e: evaluate(start, runs[e], args.episodes, evals / f"start-on-{e}.json") for e in ENVS}}
    for env in ENVS:
        table_b[f"{env} RL specialist"] = {e: evaluate(rl_runs[env] / "checkpoints" / "final", runs[e], args.episodes,
                                                       evals / f"rl-{env}-on-{e}.json") for e in ENVS}
    rl_finals = [rl_runs[env] / "checkpoints" / "final" for env in ENVS]
    for method in ("linear", *METHODS):
        merged = args.work / f"rl-merge-{method}"
        if not (merged / "merge.json").exists():
            turnforge("merge", *rl_finals, *(() if method == "linear" else ("--base", start)), "--method", method, "--out", merged)
        table_b[method] = {e: evaluate(merged, runs[e], args.episodes, evals / f"rl-{method}-on-{e}.json") for e in ENVS}
    table_b["mix run (one policy)"] = table["mix run (one policy)"]
    budgets["RL specialists together"] = _Budget.of([read_summary(r) for r in rl_runs.values()])

    rows = _rows(table, "sokoban specialist", "frozenlake specialist")
    rows_b = _rows(table_b, "sokoban RL specialist", "frozenlake RL specialist")
    head = (f"seed {args.seed}, {args.episodes} held-out episodes per env{' (smoke budgets: not a figure)' if args.smoke else ''}; "
            f"{cpu()}, {round(time.time() - t0)} s")
    lines = [f"A. Sokoban + FrozenLake specialists trained from one tiny base, their merges and the mix run; {head}", "",
             *_table(rows), "", "B. RL specialists continued from the mix run's BC checkpoint, merged against it", "",
             *_table(rows_b), "", "| runs | env steps | expert labels |", "|---|---|---|"]
    lines += [f"| {name} | {b.env_steps:,} | {b.expert_queries:,} |" for name, b in budgets.items()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"seed": args.seed, "episodes": args.episodes, "smoke": args.smoke, "rows": rows,
                                    "rows_shared_start": rows_b, "budgets": {k: vars(v) for k, v in budgets.items()}},
                                   indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


class _Budget:
    """Env steps and expert labels of some runs together."""

    def __init__(self, env_steps: int, demo_actions: int, expert_queries: int) -> None:
        self.env_steps, self.demo_actions, self.expert_queries = env_steps, demo_actions, expert_queries

    @classmethod
    def of(cls, summaries) -> "_Budget":
        s = list(summaries)
        return cls(sum(x.env_steps for x in s), sum(x.expert_queries.demonstration_actions for x in s),
                   sum(x.expert_queries.total for x in s))


def evaluate_mix(model: Path, env: str, episodes: int, out: Path) -> float:
    """Held-out success of a mix run's ``model`` on one member env (its held-out tasks exactly)."""
    if not out.exists():
        weights = "[1,0]" if env == list(ENVS)[0] else "[0,1]"
        turnforge("eval", model, f"env.kwargs.weights={weights}", "--episodes", str(episodes), "--out", out)
    return json.loads(out.read_text())["success_rate"]


def _rows(table: dict, first: str, second: str) -> list[dict]:
    """Each model's success on both envs, whether it keeps >= 90% of each specialist's success on
    the specialist's env and beats the other specialist there."""
    spec = {"sokoban": table[first]["sokoban"], "frozenlake": table[second]["frozenlake"]}
    other = {"sokoban": table[second]["sokoban"], "frozenlake": table[first]["frozenlake"]}
    return [{"model": name, **{e: res[e] for e in ENVS}, "keeps_90": all(res[e] >= 0.9 * spec[e] for e in ENVS),
             "beats_other": all(res[e] > other[e] for e in ENVS)} for name, res in table.items()]


def _table(rows: list[dict]) -> list[str]:
    return ["| model | sokoban | frozenlake | keeps >= 90% of each specialist | beats the other specialist on both |",
            "|---|---|---|---|---|"] + [f"| {r['model']} | {r['sokoban']:.3f} | {r['frozenlake']:.3f} | "
                                       f"{'yes' if r['keeps_90'] else 'no'} | {'yes' if r['beats_other'] else 'no'} |" for r in rows]


if __name__ == "__main__":
    main()
