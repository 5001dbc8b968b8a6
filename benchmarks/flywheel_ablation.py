"""Flywheel ablation: each mechanism on and off, plain GRPO and plain BC with the same
expert labels, from the same BC start at an equal env-step budget, over several seeds.

    python benchmarks/flywheel_ablation.py                          # all variants, 3 seeds
    python benchmarks/flywheel_ablation.py --variants flywheel grpo --seeds 0 1 --jobs 2

Per seed, the BC stage of the recipe runs once (``WORK/bc-<seed>/``, or the BC checkpoints of
finished runs given with ``--bc-runs``; evaluated at every
temperature of ``--temperatures``: the baseline every figure is stated against is the BC
policy at its best temperature, not at T = 1). Every variant then starts from that
checkpoint with the same seed (``benchmarks/_runs.py``):

- ``flywheel``: the recipe's own flywheel (``flywheel.*`` of the recipe, ``--rounds`` rounds);
- ``no_replay``: without the buffer of earlier rounds' successes; ``guidance``, ``curriculum``,
  ``evolve``: with that mechanism added (``guidance_is``: guided successes trained with
  importance weights instead of as plain RFT); ``adaptive``: 2 probe rollouts per task, up to
  4 where the outcome is uncertain; ``rl_stage``: a GRPO update on the round's groups after
  the RFT epochs;
- ``grpo``: no flywheel, plain GRPO (the recipe's ``rl`` section) until the same env-step
  budget (``rounds x flywheel.env_steps_per_round``);
- ``bc_labels``: no RL at all: BC from scratch on as many demonstrations as give it the
  expert labels the ``guidance`` run of the seed consumed (the ``flywheel`` run's without
  it): its demonstration moves plus its hints, evaluated at its own best temperature.

Also measured, on the first ``--levels`` held-out levels with ``--samples`` episodes each at
the recipe's evaluation temperature: the share of levels never solved by the BC start and
by the final ``flywheel`` policy (``level_spread.py``'s measure).

Outputs (``--out``, default ``runs/benchmarks/``): ``flywheel_ablation.json`` (one record per
run: held-out success, its gain over the seed's BC at its best temperature, env steps, expert
queries, the entropy of each round), ``flywheel_ablation.md`` and ``flywheel_ablation.png``
(held-out success and entropy per round). Finished runs in ``--work`` are reused.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from _runs import RESULTS, Job, bc_starts, from_bc, run_all

from turnforge.app.config import load_config
from turnforge.train.metrics import RunSummary, read_metrics, read_summary

VARIANTS = ("flywheel", "guidance", "guidance_is", "no_replay", "curriculum", "anchor", "evolve", "adaptive", "rl_stage",
            "grpo", "bc_labels")
LABELS = {
    "flywheel": "flywheel (recipe)",
    "guidance": "with guidance (level 1), guided successes as RFT",
    "guidance_is": "with guidance (level 1), guided successes importance-weighted",
    "no_replay": "without replay (this round's successes only)",
    "curriculum": "with start-state curriculum",
    "anchor": "with solver-anchored rollouts (reverse curriculum per task)",
    "evolve": "with self-evolving tasks",
    "adaptive": "adaptive allocation (2 probes, up to 4 rollouts)",
    "rl_stage": "RFT, then a GRPO update per round",
    "grpo": "plain GRPO, same env steps",
    "bc_labels": "plain BC, same expert labels",
}


def variant_overrides(variant: str, recipe: str, rounds: int, extra: list[str]) -> list[str]:
    """The overrides of one variant on top of the BC start (``extra``: the ``--set`` ones)."""
    fw = load_config(recipe, extra).flywheel
    mech = list(fw.mechanisms)
    if variant == "grpo":
        return ["flywheel.rounds=0", "rl.iterations=100000", f"rl.max_env_steps={rounds * fw.env_steps_per_round}"]
    out = [f"flywheel.rounds={rounds}", "rl.iterations=0"]
    if variant == "no_replay":
        out.append(f"flywheel.mechanisms=[{','.join(m for m in mech if m != 'replay')}]")
    elif variant in ("guidance", "guidance_is", "curriculum", "anchor", "evolve"):
        name = variant.removesuffix("_is")
        out.append(f"flywheel.mechanisms=[{','.join(dict.fromkeys([*mech, name]))}]")
        if variant == "guidance_is":
            out.append("flywheel.guided_training=is")
    elif variant == "adaptive":
        out += ["flywheel.allocation=adaptive", "flywheel.probe_rollouts=2", "flywheel.group_size=4"]
    elif variant == "rl_stage":
        out.append("flywheel.stages=[rft,rl]")
    return out


def bc_labels_job(work: Path, recipe: str, extra: list[str], seed: int, temps: str, flywheel: RunSummary,
                  start: RunSummary) -> Job:
    """BC from scratch with as many demonstrations as give it the flywheel run's expert labels (its
    start's demonstrations, hints and expert moves along anchored tasks; a demonstration gives on
    average the start's expert moves per demonstration)."""
    demo_labels = start.expert_queries.demonstration_actions
    added = flywheel.expert_queries.hints + flywheel.expert_queries.anchor_moves
    n = math.ceil((demo_labels + added) / (demo_labels / start.bc.demonstrations))
    return Job(recipe, (*extra, f"seed={seed}", f"bc.num_demos={n}", "rl.iterations=0", "flywheel.rounds=0", temps),
               work / f"bc_labels-{seed}")


def record(variant: str, seed: int, summary: RunSummary, start: RunSummary, run_dir: Path) -> dict:
    best = start.eval_bc_best_temperature
    own_best = summary.eval_bc_best_temperature if variant == "bc_labels" else None
    after = own_best.eval.success_rate if own_best else summary.eval_after_rl.success_rate
    metrics = read_metrics(run_dir)
    rounds = [{"round": x.round, "success": x.eval.success_rate, "entropy": x.entropy, "env_steps": x.env_steps}
              for x in metrics.flywheel]
    grpo_entropy = [{"iteration": x.iteration, "entropy": x.update.entropy} for x in metrics.iterations if x.update]
    end = summary.boundary_after if variant != "bc_labels" else summary.boundary_start
    return {
        "variant": variant, "seed": seed,
        "heldout_success": after,
        "heldout_episodes": summary.eval_after_rl.episodes,
        "temperature": own_best.temperature if own_best else None,
        "bc_best": best.eval.success_rate, "bc_best_temperature": best.temperature,
        "bc_t1": start.eval_before_rl.success_rate,
        "gain_over_bc_best_points": round(100 * (after - best.eval.success_rate), 1),
        "env_steps": summary.env_steps,
        # the flywheel's own runs start from the BC checkpoint: their expert labels are the start's plus their own
        "expert_queries": (start.expert_queries.total + summary.expert_queries.hints + summary.expert_queries.anchor_moves
                           if variant != "bc_labels" and summary is not start and summary.expert_queries else
                           summary.expert_queries.total if summary.expert_queries else None),
        "hints": (summary.expert_queries.hints if summary.expert_queries else None),
        "anchor_moves": (summary.expert_queries.anchor_moves if summary.expert_queries else None),
        "wall_seconds": summary.wall_seconds,
        "rounds": rounds,
        "rl_entropy": grpo_entropy[:: max(len(grpo_entropy) // 12, 1)],
        # pass@k of the final policy (bc_labels: of its BC policy) at the pass@k temperature, and of the BC start
        "boundary": _boundary(end), "boundary_start": _boundary(start.boundary_start),
    }


def _boundary(b) -> dict | None:
    if b is None or not b.pass_at_k:
        return None
    return {"temperature": b.temperature, "tasks": b.tasks, "samples": b.samples_per_task,
            "pass_at_k": {str(p.k): p.value for p in b.pass_at_k}, "never_solved_at_8": b.never_solved_at_8,
            "entropy": b.entropy, "action_mi": b.action_mi}


def never_solved(run: Path, checkpoint: str, levels: int, samples: int) -> float:
    from level_spread import level_rates

    return float((level_rates(run, checkpoint, levels, samples, 0) == 0).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=None, help="flywheel rounds (default: the recipe's)")
    ap.add_argument("--temperatures", default="[1.0,0.7,0.5,0.3,0.1]", help="BC evaluation temperatures")
    ap.add_argument("--levels", type=int, default=200, help="held-out levels of the never-solved measure (0 = skip)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    ap.add_argument("--bc-runs", nargs="+", type=Path, default=[],
                    help="finished runs of the recipe (with eval.bc_temperatures) whose BC checkpoints are the starts, "
                         "instead of training BC per seed (their seeds replace --seeds)")
    ap.add_argument("--work", type=Path, default=RESULTS / "flywheel_ablation")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--recipe", default="sokoban-tiny")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="extra",
                    help="more overrides for every run, BC starts included")
    ap.add_argument("--report-only", action="store_true", help="rewrite the table and plot from flywheel_ablation.json")
    args = ap.parse_args()
    out, work = args.out, args.work
    if args.report_only:
        report(json.loads((out / "flywheel_ablation.json").read_text()), out, args)
        return
    rounds = args.rounds if args.rounds is not None else load_config(args.recipe, args.extra).flywheel.rounds
    if rounds < 1:
        raise SystemExit(f"--rounds: the recipe {args.recipe!r} has flywheel.rounds=0; give --rounds N (N >= 1)")
    temps = f"eval.bc_temperatures={args.temperatures}"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    threads = f"threads={args.threads}"
    if args.bc_runs:
        given = {read_summary(run).seed: run for run in args.bc_runs}
        bc_paths = {seed: run / "checkpoints" / "bc" for seed, run in given.items()}
    else:
        bc_paths = bc_starts(work, args.recipe, [threads, temps, *args.extra], args.seeds, args.jobs)
    starts = {s: read_summary(p.parent.parent) for s, p in bc_paths.items()}
    for s, start in starts.items():
        if start.eval_bc_best_temperature is None:
            raise SystemExit(f"the BC start of seed {s} ({bc_paths[s].parent.parent}) was not evaluated at several "
                             "temperatures (eval.bc_temperatures); nothing to state the gains against")
    print(f"BC starts done in {time.time() - t0:.0f}s", flush=True)

    # a --bc-runs run that already played the recipe's flywheel from that BC checkpoint is the
    # seed's `flywheel` variant (with its own thread count), not trained again
    reused = {s: p.parent.parent for s, p in bc_paths.items() if args.bc_runs and starts[s].flywheel_rounds == rounds}
    trained = [v for v in args.variants if v != "bc_labels"]
    runs = [(v, s) for s in starts for v in trained if not (v == "flywheel" and s in reused)]
    jobs = [Job(args.recipe, (threads, f"seed={s}", *from_bc(bc_paths[s]), "eval.bc_temperatures=[]",
                              *variant_overrides(v, args.recipe, rounds, args.extra), *args.extra), work / f"{v}-{s}")
            for v, s in runs]
    summaries = dict(zip(runs, run_all(jobs, args.jobs)))
    for s, run in reused.items():
        if "flywheel" in args.variants:
            summaries[("flywheel", s)] = starts[s]
    run_dir = {k: reused[k[1]] if k[0] == "flywheel" and k[1] in reused else work / f"{k[0]}-{k[1]}" for k in summaries}
    if "bc_labels" in args.variants:  # as many labels as the variant that asked the expert most (anchor or guidance)
        basis = next(v for v in ("anchor", "guidance", "flywheel") if v in args.variants or v == "flywheel")
        pairs = [(s, summaries.get((basis, s))) for s in starts]
        pairs = [(s, f) for s, f in pairs if f is not None and f.expert_queries is not None]
        label_jobs = [bc_labels_job(work, args.recipe, [threads, *args.extra], s, temps, f, starts[s]) for s, f in pairs]
        for (s, _), summary in zip(pairs, run_all(label_jobs, args.jobs)):
            summaries[("bc_labels", s)] = summary
    records = []
    for (v, s), summary in summaries.items():
        if summary is not None:
            records.append(record(v, s, summary, starts[s], run_dir.get((v, s), work / f"{v}-{s}")))
            print(f"{v:12s} seed {s}: {records[-1]['heldout_success']:.3f} "
                  f"({records[-1]['gain_over_bc_best_points']:+.1f} over BC at its best T)", flush=True)
    if not records:
        raise SystemExit(f"no run finished; see the .log files in {work}")
    if args.levels > 0:
        for s in starts:
            for v, run, ck in (("bc", bc_paths[s].parent.parent, "bc"), ("flywheel", reused.get(s, work / f"flywheel-{s}"), "final")):
                if (run / "checkpoints" / ck).exists():
                    records.append({"variant": f"never_solved:{v}", "seed": s, "levels": args.levels,
                                    "samples": args.samples, "never_solved": never_solved(run, ck, args.levels, args.samples)})
    out.mkdir(parents=True, exist_ok=True)
    (out / "flywheel_ablation.json").write_text(json.dumps(records, indent=1) + "\n")
    report(records, out, args)
    print(f"total {time.time() - t0:.0f}s; wrote {out}/flywheel_ablation.json, .md, .png")


def report(records: list[dict], out: Path, args: argparse.Namespace) -> None:
    runs = [r for r in records if "heldout_success" in r]
    seeds = sorted({r["seed"] for r in runs})
    ex = runs[0]
    lines = [
        f"Flywheel ablation on {args.recipe}: held-out success ({ex['heldout_episodes']} episodes) from the same BC "
        f"start per seed (seeds {', '.join(map(str, seeds))}), against the BC policy at its best sampling temperature.",
        "",
        "| variant | held-out success (mean ± std) | gain over BC at best T, points (mean ± std) | min gain | env steps | "
        "expert queries | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    bc = [r["bc_best"] for r in runs if r["variant"] == runs[0]["variant"]]
    lines.append(f"| BC at its best T (T in {args.temperatures}) | {statistics.mean(bc):.3f} ± {_std(bc):.3f} | 0 | | | | |")
    for v in dict.fromkeys(r["variant"] for r in runs):
        rs = [r for r in runs if r["variant"] == v]
        acc, gain = [r["heldout_success"] for r in rs], [r["gain_over_bc_best_points"] for r in rs]
        q = [r["expert_queries"] for r in rs if r["expert_queries"] is not None]
        queries = f"{statistics.median(q):,.0f}" if q else "—"
        lines.append(f"| {LABELS[v]} | {statistics.mean(acc):.3f} ± {_std(acc):.3f} | {statistics.mean(gain):+.1f} ± "
                     f"{_std(gain):.1f} | {min(gain):+.1f} | {statistics.median(r['env_steps'] for r in rs):,.0f} | "
                     f"{queries} | {statistics.median(r['wall_seconds'] for r in rs):.0f} |")
    ns = [r for r in records if r["variant"].startswith("never_solved")]
    if ns:
        lines += ["", f"Held-out levels never solved ({ns[0]['levels']} levels x {ns[0]['samples']} samples):", ""]
        for v in dict.fromkeys(r["variant"] for r in ns):
            xs = [r["never_solved"] for r in ns if r["variant"] == v]
            lines.append(f"- {v.split(':')[1]}: {statistics.mean(xs):.3f} (per seed {', '.join(f'{x:.3f}' for x in xs)})")
    ent = [r for r in runs if r["rounds"]]
    if ent:
        n = max(len(r["rounds"]) for r in ent)
        lines += ["", "Entropy of the policy on its own action tokens, before each round's update (mean over seeds):", "",
                  "| variant | " + " | ".join(f"round {i + 1}" for i in range(n)) + " |", "|---|" + "---|" * n]
        for v in dict.fromkeys(r["variant"] for r in ent):
            rs = [r for r in ent if r["variant"] == v]
            cells = [statistics.mean(r["rounds"][i]["entropy"] for r in rs if len(r["rounds"]) > i) for i in range(n)]
            lines.append(f"| {LABELS[v]} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    grpo = [r for r in runs if r["rl_entropy"]]
    if grpo:
        first = statistics.mean(r["rl_entropy"][0]["entropy"] for r in grpo)
        last = statistics.mean(r["rl_entropy"][-1]["entropy"] for r in grpo)
        lines += ["", f"Plain GRPO's update entropy: {first:.3f} at its first iteration, {last:.3f} at its last."]
    lines += _boundary_table(runs)
    table = "\n".join(lines) + "\n"
    (out / "flywheel_ablation.md").write_text(table)
    print(table)
    _plot(runs, out / "flywheel_ablation.png")


def _boundary_table(runs: list[dict]) -> list[str]:
    """pass@1, pass@N, the never-solved share at k=8 and the entropy of each variant's final policy
    (mean over seeds), beside the BC start's: sharpening raises pass@1 only, expansion pass@N too."""
    got = [r for r in runs if r.get("boundary")]
    if not got:
        return []
    b0 = got[0]["boundary"]
    n = max(int(k) for k in b0["pass_at_k"])
    lines = ["", f"What the policies solve: pass@k on {b0['tasks']} held-out tasks x {b0['samples']} samples at "
             f"T={b0['temperature']:g} (mean over seeds):", "",
             f"| policy | pass@1 | pass@8 | pass@{n} | never solved@8 | entropy |", "|---|---|---|---|---|---|"]

    def row(name: str, bs: list[dict]) -> str:
        def m(f):
            xs = [f(b) for b in bs if f(b) is not None]
            return f"{statistics.mean(xs):.3f}" if xs else ""
        return (f"| {name} | {m(lambda b: b['pass_at_k'].get('1'))} | {m(lambda b: b['pass_at_k'].get('8'))} | "
                f"{m(lambda b: b['pass_at_k'].get(str(n)))} | {m(lambda b: b['never_solved_at_8'])} | {m(lambda b: b['entropy'])} |")

    starts = {r["seed"]: r["boundary_start"] for r in got if r.get("boundary_start")}
    if starts:
        lines.append(row("BC start (T=1)", list(starts.values())))
    for v in dict.fromkeys(r["variant"] for r in got):
        lines.append(row(LABELS[v], [r["boundary"] for r in got if r["variant"] == v]))
    return lines


def _std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for v in dict.fromkeys(r["variant"] for r in runs if r["rounds"]):
        rs = [r for r in runs if r["variant"] == v]
        n = min(len(r["rounds"]) for r in rs)
        xs = list(range(n + 1))
        ax.plot(xs, [statistics.mean(r["bc_t1"] for r in rs)]
                + [statistics.mean(r["rounds"][i]["success"] for r in rs) for i in range(n)], marker="o", label=LABELS[v])
        bx.plot(xs[1:], [statistics.mean(r["rounds"][i]["entropy"] for r in rs) for i in range(n)], marker="o", label=LABELS[v])
    best = statistics.mean(r["bc_best"] for r in runs if r["variant"] == runs[0]["variant"])
    ax.axhline(best, color="grey", ls="--", lw=1, label="BC at its best T")
    for v in ("grpo", "bc_labels"):
        rs = [r for r in runs if r["variant"] == v]
        if rs:
            ax.axhline(statistics.mean(r["heldout_success"] for r in rs), ls=":", lw=1, label=LABELS[v])
    ax.set(xlabel="round (0 = BC start, T = 1)", ylabel="held-out success (mean over seeds)")
    bx.set(xlabel="round", ylabel="entropy on own action tokens (nats)")
    for a in (ax, bx):
        a.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
