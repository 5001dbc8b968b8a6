"""The terminal env's speed and containment where a run sees them: an agent's step, and 64
concurrent episodes through the rollout engine.

    python benchmarks/terminal_env.py                 # writes runs/benchmarks/terminal_env.json
    python benchmarks/terminal_env.py --steps 200 --episodes 64 --workers 2

1. A step: ``TerminalEnv.step`` of a short command (``echo hi``, ``ls``, ``wc -l`` of a task file:
   the action parsed and syntax-checked, sent to the box's shell, run, the output rendered with its
   exit code and cwd), ``--steps`` times each after warm-up, median and p90 (target: median under
   50 ms). Also the first observation of a new episode (``reset``: a box started, the task's built
   workspace restored) and the verification at ``submit`` (a fresh box, the tests, the verdict).
2. ``--episodes`` episodes at once through ``RolloutEngine`` with as many env slots, the envs on
   ``--workers`` EnvPool worker processes (0: in this process), each played by the tasks' expert
   (the reference commands, then submit); the wall time, the successes, the infrastructure
   failures, and afterwards what is left on the host: box processes (a scan of /proc for the box
   supervisor) and ``turnforge`` entries of the temp directory beyond those there before.

Prints the CPU model and writes JSON to ``--out`` (default ``runs/benchmarks/terminal_env.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _runs import RESULTS

from turnforge.config import EngineConfig, RolloutConfig
from turnforge.envs import make
from turnforge.envpool import make_backend
from turnforge.rollout.actors import ExpertActor
from turnforge.rollout.engine import EpisodeRequest, RolloutEngine

TARGET_MS = 50.0


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "unknown")


def stats_ms(xs: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in xs)
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 3), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3)}


def step_figures(steps: int) -> dict:
    env = make("terminal", max_turns=10**6, command_timeout_s=10)
    task = env.task("train", 0)
    env.reset(task, 0)
    name = next(f.path for f in env.episode.task.files)
    out = {}
    for label, command in (("echo", "echo hi"), ("ls", "ls -la"), ("wc", f"wc -l {name}")):
        for _ in range(10):
            env.step(command)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            env.step(command)
            times.append(time.perf_counter() - t0)
        out[label] = stats_ms(times)
    resets, submits = [], []
    for i in range(10):
        t0 = time.perf_counter()
        env.reset(env.task("train", i), 0)
        resets.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        env.step("submit")
        submits.append(time.perf_counter() - t0)
    out["reset"], out["submit_and_verify"] = stats_ms(resets), stats_ms(submits)
    env.close()
    return out


def box_processes() -> int:
    count = 0
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if b"shell:%d" in (proc / "cmdline").read_bytes() or b"__tf_c" in (proc / "cmdline").read_bytes():
                    count += 1
            except OSError:
                pass
    return count


def concurrent_episodes(n: int, workers: int) -> dict:
    tmp_before = {p.name for p in Path(tempfile.gettempdir()).glob("turnforge*")}
    procs_before = box_processes()
    rollout = RolloutConfig(context="full_history", max_turns=6, max_new_tokens=48, max_context_tokens=1024)
    kwargs = {"max_turns": 6}
    backend = make_backend("terminal", kwargs, n, EngineConfig(env_workers=workers), on_ray=False)
    engine = RolloutEngine(backend, rollout, None, make("terminal", **kwargs))
    requests = [EpisodeRequest(engine.env.task("train", i), i, f"g{i}", f"t{i}") for i in range(n)]
    t0 = time.perf_counter()
    trajs, stats = engine.play(requests, ExpertActor())
    wall = time.perf_counter() - t0
    engine.close()
    time.sleep(0.5)
    return {"episodes": n, "env_workers": workers, "wall_s": round(wall, 2), "successes": sum(t.success for t in trajs),
            "infra_failures": sum(t.infra_failure is not None for t in trajs), "env_steps": sum(t.num_turns for t in trajs),
            "box_processes_left": box_processes() - procs_before,
            "temp_entries_left": sorted({p.name for p in Path(tempfile.gettempdir()).glob("turnforge*")} - tmp_before)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "terminal_env.json")
    args = parser.parse_args()
    result = {"cpu": cpu_model(), "steps": step_figures(args.steps),
              "concurrent": concurrent_episodes(args.episodes, args.workers)}
    s, c = result["steps"], result["concurrent"]
    print(f"CPU: {result['cpu']}")
    for label in ("echo", "ls", "wc"):
        print(f"step {label}: median {s[label]['median_ms']} ms, p90 {s[label]['p90_ms']} ms (target median < {TARGET_MS:g} ms)")
    print(f"reset {s['reset']['median_ms']} ms, submit + verification {s['submit_and_verify']['median_ms']} ms (medians)")
    print(f"{c['episodes']} concurrent episodes ({c['env_workers']} env workers): {c['wall_s']} s, {c['successes']} successes, "
          f"{c['infra_failures']} infrastructure failures, {c['box_processes_left']} box processes and "
          f"{len(c['temp_entries_left'])} temp entries left")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
