"""Where the default job's time goes: wall seconds per stage and, inside each, per part.

    python benchmarks/profile_default_job.py                      # sokoban-tiny, seed 0, 2 threads
    python benchmarks/profile_default_job.py --recipe frozenlake-tiny threads=1 rl.iterations=10

Runs ``turnforge train RECIPE [KEY=VALUE ...]`` in this process (the very run a user's command
makes: same config, the CLI's kernel pin, same figures; ``summary.json`` is written as usual) with wall-clock timers
wrapped around the functions each part goes through. Stages are the run's steps in
``turnforge.app.run``: ``start`` (set-up after the checks, the frozen BC copy, the start's
checkpoint), ``bc`` (``run_bc``), ``flywheel`` (``flywheel_stage``), ``rl`` (``run_rl``) and
``final`` (``finish``); ``set-up`` is what comes before them (config, checks, loading the model).
Parts, each timed exclusively (a part inside another counts for the inner one only):

- ``generation``: ``PolicyActor.generate``, the one sampling path (prefill, decoding, sampling);
- ``env``: the env backend's ``send_*`` and ``recv`` (with env worker processes: handing over
  and waiting for results; with inline envs: the steps themselves);
- ``scoring``: ``score_samples`` and ``token_logprobs``, the forward passes that score sampled
  tokens for the loss (log-probabilities, the reference's too);
- ``backward``: ``torch.autograd.backward``; ``optimizer``: the optimizer's ``step`` and
  ``clip_grad_norm_``;
- ``I/O``: checkpoints (``save_model``, ``save_resumable``), trajectory files
  (``write_trajectories``), the run directory's JSON and text files (a plot's drawing, or the
  tiny model built into ``base_model``, is the stage's ``other``);
- ``other``: the rest of the stage (collation, the loss's own arithmetic, credit assignment,
  filters, Python between the parts).

Time inside ``Session.evaluate`` and ``Session.boundary`` (held-out evaluations, pass@k) is
reported apart as ``evaluation: <part>``, so "evaluation" is a part too. A part run on another
thread (the asynchronous engine's sampler) is counted on that thread, under the stage the main
thread is in: then the parts of a stage can sum to more than its wall time (the table says so).
Timers cost a ``perf_counter`` pair per call (measured: under 1% of the run). Writes
``profile_default_job.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
import platform
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from _runs import RESULTS

from turnforge.kernels import pin_cpu_kernels

pin_cpu_kernels()  # as `turnforge train` does, before torch is imported: the same kernels, the same figures

PARTS = ("generation", "env", "scoring", "backward", "optimizer", "I/O", "other")
STAGES = ("set-up", "start", "bc", "flywheel", "rl", "final")


class Profile:
    """Exclusive wall time per (stage, label); a thread-local stack of open timers."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.stage_wall: dict[str, float] = defaultdict(float)
        self.stages = ["set-up"]  # the main thread's open stages; the innermost is current
        self.local = threading.local()

    def _stack(self) -> list[list]:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    @contextlib.contextmanager
    def timing(self, kind: str, name: str):
        """``kind``: ``stage`` (switches the current stage), ``context`` (evaluation: prefixes
        the parts inside it) or ``part``."""
        stack = self._stack()
        frame = [kind, name, time.perf_counter(), 0.0, 0.0]  # kind, name, start, time of timers / of stages inside
        if kind == "stage":
            self.stages.append(name)
        stack.append(frame)
        try:
            yield
        finally:
            stack.pop()
            elapsed = time.perf_counter() - frame[2]
            if stack:
                stack[-1][3] += elapsed
            contexts = [f[1] for f in stack if f[0] == "context"]
            if kind == "stage":
                label = "other"
            elif kind == "context":
                label = f"{name}: other"
            else:
                label = f"{contexts[-1]}: {name}" if contexts else name
            if kind == "stage" and contexts:  # a stage opened inside an evaluation (none is): keep it in it
                label = f"{contexts[-1]}: other"
            key = (self.stages[-1], label)
            self.seconds[key] += elapsed - frame[3]
            self.calls[key] += 1
            if kind == "stage":  # its own wall time, the stages opened inside it apart
                self.stage_wall[name] += elapsed - frame[4]
                outer = [f for f in stack if f[0] == "stage"]
                if outer:
                    outer[-1][4] += elapsed
                self.stages.pop()

    def wrap(self, fn, kind: str, name: str):
        if inspect.isgeneratorfunction(fn):  # score_samples yields batch by batch: time each step
            @functools.wraps(fn)
            def timed_gen(*args, **kwargs):
                it = fn(*args, **kwargs)
                while True:
                    with self.timing(kind, name):
                        try:
                            item = next(it)
                        except StopIteration as stop:
                            return stop.value
                    yield item
            return timed_gen

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.timing(kind, name):
                return fn(*args, **kwargs)
        return timed


def patch(profile: Profile, owner, attr: str, kind: str, name: str) -> None:
    """Wrap ``owner.attr``, and every loaded turnforge module's name bound to the same function
    (``from x import f`` copies the reference)."""
    original = getattr(owner, attr)
    timed = profile.wrap(original, kind, name)
    setattr(owner, attr, timed)
    if inspect.isclass(owner):
        return
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("turnforge") and getattr(module, attr, None) is original:
            setattr(module, attr, timed)


def install(profile: Profile) -> None:
    import torch

    import turnforge.app.run as app_run
    from turnforge.data import store
    from turnforge.envpool.inline import InlineEnvs
    from turnforge.envpool.pool import BasePool
    from turnforge.policy import generate
    from turnforge.rollout.actors import PolicyActor
    from turnforge.runs import RunDir
    from turnforge.train import common
    from turnforge.train.run_dir import checkpoint
    from turnforge.train.session import Session

    for fn, stage in (("warm_start", "start"), ("flywheel_stage", "flywheel"), ("run_rl", "rl"), ("finish", "final"),
                      ("run_bc", "bc")):
        patch(profile, app_run, fn, "stage", stage)
    patch(profile, Session, "evaluate", "context", "evaluation")
    patch(profile, Session, "boundary", "context", "evaluation")
    patch(profile, PolicyActor, "generate", "part", "generation")
    for cls in (InlineEnvs, BasePool):
        for method in ("send_reset", "send_restore", "send_step", "recv"):
            patch(profile, cls, method, "part", "env")
    patch(profile, common, "score_samples", "part", "scoring")
    patch(profile, generate, "token_logprobs", "part", "scoring")
    patch(profile, torch.autograd, "backward", "part", "backward")
    patch(profile, torch.nn.utils, "clip_grad_norm_", "part", "optimizer")
    patch(profile, torch.optim.AdamW, "step", "part", "optimizer")
    for fn in ("save_model", "save_resumable"):
        patch(profile, checkpoint, fn, "part", "I/O")
    patch(profile, store, "write_trajectories", "part", "I/O")
    for method in ("write_text", "write_json"):
        patch(profile, RunDir, method, "part", "I/O")


def table(profile: Profile, total: float) -> dict:
    """Per stage: wall seconds, and seconds per part (evaluation apart)."""
    out = {}
    for stage in STAGES:
        wall = total - sum(profile.stage_wall.values()) if stage == "set-up" else profile.stage_wall.get(stage, 0.0)
        parts = {label: round(sec, 3) for (st, label), sec in sorted(profile.seconds.items()) if st == stage}
        if stage == "set-up":  # everything outside the stages: what no timer took
            parts["other"] = round(wall - sum(v for k, v in parts.items() if k != "other"), 3)
        if wall > 0 or parts:
            out[stage] = {"wall_s": round(wall, 3), "parts_s": parts}
    return out


def to_markdown(r: dict) -> str:
    labels = sorted({label for s in r["stages"].values() for label in s["parts_s"]},
                    key=lambda x: (x.startswith("evaluation"), PARTS.index(x.split(": ")[-1])))
    lines = [f"# Where the time goes: `turnforge train {' '.join(r['args'])}`", "",
             (f"{r['cpu']}; torch {r['torch']}, {r['threads']} threads; load before {r['load_before']:.2f}; "
             f"wall {r['wall_s']:.1f} s; held-out success {r['held_out']} (summary.json as written by the run). "
             "Seconds, exclusive: a part inside another counts for the inner one."), "",
             "| stage | wall s | " + " | ".join(labels) + " |", "|---|---:|" + "---:|" * len(labels)]
    for stage, s in r["stages"].items():
        lines.append(f"| {stage} | {s['wall_s']:.1f} | " + " | ".join(f"{s['parts_s'].get(x, 0.0):.1f}" for x in labels) + " |")
    sums = {x: sum(s["parts_s"].get(x, 0.0) for s in r["stages"].values()) for x in labels}
    lines.append(f"| **all** | {r['wall_s']:.1f} | " + " | ".join(f"{sums[x]:.1f}" for x in labels) + " |")
    lines += ["", "Share of the run's wall time: " + ", ".join(
        f"{x} {sums[x] / r['wall_s']:.0%}" for x in sorted(labels, key=lambda x: -sums[x]) if sums[x] / r["wall_s"] >= 0.005)]
    return "\n".join(lines) + "\n"


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="sokoban-tiny")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE, as for turnforge train")
    ap.add_argument("--run-dir", type=Path, default=None, help="the run directory (default: OUT/profile-run, replaced)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    import shutil

    import torch

    from turnforge.app.config import load_config
    from turnforge.app.run import train

    cfg = load_config(args.recipe, list(args.overrides))  # a bad key: one line, exit 2, before any work
    run_dir = args.run_dir or args.out / "profile-run"
    if run_dir.exists() and (run_dir / "config.yaml").exists():
        shutil.rmtree(run_dir)
    profile = Profile()
    install(profile)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    summary = train(cfg, run_dir, live=False)
    wall = time.perf_counter() - t0
    after = summary.eval_after_rl.success_rate if summary is not None else None
    result = {"args": [args.recipe, *args.overrides], "cpu": cpu_name(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "load_before": load_before, "wall_s": round(wall, 3),
              "held_out": after, "run_dir": str(run_dir), "stages": table(profile, wall)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_default_job.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "profile_default_job.md").write_text(to_markdown(result))
    print(to_markdown(result))


if __name__ == "__main__":
    main()
