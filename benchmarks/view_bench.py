"""``turnforge view`` on a large run: the overview of the self-contained page (file mode) and a
trajectory page served by ``--serve``, each timed in Debian's Chromium.

    python benchmarks/view_bench.py                     # 10,000 samples, 5 loads of each page
    python benchmarks/view_bench.py --samples 100000 --loads 3

The run is synthetic but written by the real store writer (``write_trajectories``): RL
iterations of GRPO groups of 8 on FrozenLake-like tasks, one sample per turn (window context),
each a ChatML prompt (a 4x4 grid and ``--obs-words`` random words) and a one-word action,
tokenized by the tiny model's tokenizer (about 210 tokens a sample at the default 60 words),
sampling logprobs on the action tokens, 1% infrastructure failures, truncations at ``max_turns``; plus ``metrics.jsonl`` (one ``rl_iter`` and one ``eval`` record per iteration),
``config.yaml`` and the tokenizer in ``base_model/``. ``synthesize_run`` is also the tests'
source of runs with judge verdicts and gateway splits (``tests/view``).

Timed (targets from issue 32):

- file mode: ``turnforge view RUN -o page.html`` (wall time of the command, reported), then
  loading ``page.html`` until its overview is drawn; target < 3 s;
- serve mode: ``turnforge view RUN --serve --port 0``, then loading
  ``http://127.0.0.1:PORT/#traj?...`` (page, overview and trajectory requests, token rendering)
  until the trajectory is drawn; target < 1 s.

A load is a fresh page in one browser; its time is the page's own ``performance.now()`` when it
marks itself ready (``body[data-ready-at]``: milliseconds from navigation start). Medians over
``--loads`` loads, after one warm-up load of each. Writes ``view.json`` and ``view.md`` to
``--out`` (default ``runs/benchmarks``; past measurements are in ``docs/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from turnforge.data.store import write_trajectories
from turnforge.types import JudgeRecord, Sample, Task, Trajectory, Turn

TARGET_OVERVIEW_S = 3.0
TARGET_TRAJECTORY_S = 1.0
ACTIONS = ("Up", "Down", "Left", "Right")
WORDS = ("the", "agent", "sees", "a", "hole", "at", "row", "two", "and", "the", "goal", "in", "corner", "moves", "left",
         "wall", "box", "target", "observation", "reward", "tool", "call", "returned", "error", "value", "42", "3.14")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


@dataclass(frozen=True)
class SyntheticRun:
    """What ``synthesize_run`` wrote."""

    path: Path
    samples: int
    tokens: int
    episodes: int
    iterations: int
    infra_failures: int
    first_trajectory: tuple[str, int, str]  # (stage, iteration, trajectory id) of a scored episode


def _grid(rng: random.Random) -> str:
    cells = ["_"] * 16
    cells[rng.randrange(16)] = "P"
    cells[15] = "G"
    for _ in range(2):
        cells[rng.randrange(1, 15)] = "O"
    return "\n".join("".join(cells[r * 4:(r + 1) * 4]) for r in range(4))


def synthesize_run(out: Path, tokenizer_dir: Path, samples: int = 10_000, group_size: int = 8, max_turns: int = 8,
                   groups_per_iteration: int = 16, judge: bool = False, splits: bool = False, text: str = "",
                   obs_words: int = 0, seed: int = 0) -> SyntheticRun:
    """Write a run directory at ``out`` with at least ``samples`` training samples (see the
    module docstring); ``judge`` gives every episode a judge verdict, ``splits`` writes two
    gateway splits for the first episode, ``text`` and ``obs_words`` random words are added
    to every observation."""
    from tokenizers import Tokenizer

    rng = random.Random(seed)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    end = encode("<|im_end|>")
    action_ids = {a: encode(a) + end for a in ACTIONS}
    out.mkdir(parents=True, exist_ok=False)
    (out / "base_model").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / "base_model" / name)
    written = tokens = episodes = failures = it = 0
    first = None
    metrics = []
    while written < samples:
        trajs, advantages = [], {}
        for g in range(groups_per_iteration):
            task = Task("frozenlake", "train", rng.randrange(10**6))
            group = []
            for a in range(group_size):
                tid = f"rl-{it}-{g}-{a}"
                n_turns = rng.randint(1, max_turns)
                success = n_turns < max_turns and rng.random() < 0.5
                failed = rng.random() < 0.01
                turns, smp = [], []
                for t in range(n_turns):
                    obs = _grid(rng) + text + "".join(" " + rng.choice(WORDS) for _ in range(obs_words))
                    prompt = encode(f"<|im_start|>user\n{obs}<|im_end|>\n<|im_start|>assistant\n")
                    action = rng.choice(ACTIONS)
                    ids = np.array(prompt + action_ids[action], dtype=np.int64)
                    mask = np.zeros(len(ids), dtype=np.int8)
                    mask[len(prompt):] = 1
                    logprobs = np.full(len(ids), np.nan, dtype=np.float32)
                    logprobs[len(prompt):] = -np.array([rng.expovariate(2.0) for _ in action_ids[action]], dtype=np.float32)
                    versions = np.where(mask == 1, it, -1).astype(np.int32)
                    smp.append(Sample(ids, mask, logprobs, versions, tid, t))
                    tokens += len(ids)
                    last = t == n_turns - 1
                    turns.append(Turn(obs, action, 1.0 if (last and success) else 0.0, False, ""))
                reward = 1.0 if success else 0.0
                record = JudgeRecord(f"<|im_start|>user\nRate the episode {tid} from 0 to 10.<|im_end|>",
                                     f"Score: {7 if success else 2}", 0.7 if success else 0.2, reward) if judge else None
                traj = Trajectory(tid, task, f"{it}-{g}", rng.randrange(2**63), tuple(turns), tuple(smp), reward, success,
                                  success, not success and n_turns == max_turns,
                                  "max_turns" if not success and n_turns == max_turns else None, it,
                                  infra_failure="RuntimeError: simulated env crash\n  in step()" if failed else None,
                                  judge=record)
                group.append(traj)
                failures += failed
                written += n_turns
                if first is None and not failed:
                    first = ("rl", it, tid)
            scored = [t.episode_return for t in group if t.infra_failure is None]
            mean = float(np.mean(scored)) if scored else 0.0
            for t in group:
                if t.infra_failure is None:
                    advantages[t.trajectory_id] = [t.episode_return - mean] * t.num_turns
            trajs += group
        write_trajectories(out / "trajectories" / f"rl_{it:05d}.parquet", trajs, stage="rl", iteration=it, advantages=advantages)
        scored = [t for t in trajs if t.infra_failure is None]
        episodes += len(trajs)
        metrics.append({"event": "rl_iter", "iteration": it + 1, "reward": float(np.mean([t.episode_return for t in scored])),
                        "success": float(np.mean([t.success for t in scored])), "update": {"loss": rng.random(), "entropy": 1 - it / 100},
                        "env_steps": written, "time": 0.0})
        metrics.append({"event": "eval", "tag": f"rl-{it + 1}", "iteration": it + 1, "result": {"success_rate": rng.random()},
                        "env_steps": written, "time": 0.0})
        it += 1
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    config = {"recipe": "synthetic", "seed": seed, "model": {"path": "tiny"}, "env": {"id": "frozenlake"},
              "rollout": {"context": "window", "max_turns": max_turns}, "rl": {"group_size": group_size}}
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    if splits and first is not None:
        with (out / "gateway_splits.jsonl").open("w") as f:
            for call, reason in ((1, "rewritten"), (2, "retry")):
                f.write(json.dumps({"rollout": first[2], "call": call, "reason": reason, "position": 7,
                                    "expected": "<|im_start|>assistant\nUp<|im_end|>", "got": "<|im_start|>assistant\nDown"}) + "\n")
    assert first is not None
    return SyntheticRun(out, written, tokens, episodes, it, failures, first)


# ---------------------------------------------------------------------- timing
def _ready_ms(page, url: str, view: str) -> float:
    page.goto(url)
    page.wait_for_function(f"document.body.dataset.ready === {json.dumps(view)}", timeout=120_000)
    error = page.query_selector("[data-testid=error]")
    if error is not None:
        raise RuntimeError(f"the page shows an error: {error.inner_text()}")
    return float(page.evaluate("document.body.dataset.readyAt"))


def time_loads(browser, url: str, view: str, loads: int) -> list[float]:
    """Milliseconds from navigation start to ``view`` drawn, for one warm-up and ``loads`` loads."""
    times = []
    for k in range(loads + 1):
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        ms = _ready_ms(page, url, view)
        page.close()
        if k > 0:
            times.append(ms)
    return times


def serve(run: Path) -> tuple[subprocess.Popen, str]:
    """``turnforge view RUN --serve --port 0`` in a process; returns it and its URL."""
    proc = subprocess.Popen([sys.executable, "-m", "turnforge.cli", "view", str(run), "--serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    found = re.search(r"http://127\.0\.0\.1:\d+/", line)
    if not found:
        proc.kill()
        raise RuntimeError(f"turnforge view --serve did not start: {line}{proc.stderr.read()}")
    return proc, found.group(0)


def bench(work: Path, samples: int, loads: int, obs_words: int) -> dict:
    """Synthesize the run under ``work`` and time both pages (see the module docstring)."""
    from playwright.sync_api import sync_playwright

    from turnforge.policy.tiny import build_tiny_model

    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    build_tiny_model(work / "tiny")
    t0 = time.perf_counter()
    run = synthesize_run(work / "run", work / "tiny", samples=samples, obs_words=obs_words)
    synth_s = time.perf_counter() - t0

    page_path = work / "page.html"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "turnforge.cli", "view", str(run.path), "-o", str(page_path)], check=True,
                   capture_output=True, text=True)
    build_s = time.perf_counter() - t0

    stage, iteration, tid = run.first_trajectory
    proc, url = serve(run.path)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            overview = time_loads(browser, page_path.as_uri() + "#overview", "overview", loads)
            trajectory = time_loads(browser, f"{url}#traj?run=0&stage={stage}&iteration={iteration}&id={tid}", "traj", loads)
            served_overview = time_loads(browser, url + "#overview", "overview", loads)
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    med = lambda xs: round(statistics.median(xs) / 1000, 3)  # noqa: E731
    return {
        "run": {"samples": run.samples, "tokens": run.tokens, "episodes": run.episodes, "iterations": run.iterations,
                "infra_failures": run.infra_failures, "synthesize_seconds": round(synth_s, 2)},
        "page": {"bytes": page_path.stat().st_size, "build_seconds": round(build_s, 2)},
        "loads": loads,
        "file_overview_seconds": {"median": med(overview), "all": [round(x / 1000, 3) for x in overview], "target": TARGET_OVERVIEW_S},
        "serve_trajectory_seconds": {"median": med(trajectory), "all": [round(x / 1000, 3) for x in trajectory],
                                     "target": TARGET_TRAJECTORY_S},
        "serve_overview_seconds": {"median": med(served_overview), "all": [round(x / 1000, 3) for x in served_overview]},
    }


def to_markdown(record: dict) -> str:
    r, m = record["result"], record["machine"]
    fo, st, so = r["file_overview_seconds"], r["serve_trajectory_seconds"], r["serve_overview_seconds"]
    ok = lambda x: "yes" if x["median"] < x["target"] else "no"  # noqa: E731
    return "\n".join([
        "# `turnforge view` on a large run",
        "",
        f"`{record['command']}` on {record['date_utc']} UTC: {m['platform']}, {m['cpus']} CPUs ({m['cpu_model']}), "
        f"{m['chromium']}, 1-min load average {m['load_avg_1min_before_after'][0]} before and "
        f"{m['load_avg_1min_before_after'][1]} after (other work on the machine shows there).",
        "",
        f"A synthetic run of {r['run']['samples']:,} samples, {r['run']['tokens']:,} tokens ({r['run']['episodes']:,} episodes in {r['run']['iterations']} RL "
        f"iterations, {r['run']['infra_failures']} infrastructure failures) written by the store writer. The page: "
        f"{r['page']['bytes'] / 2**20:.1f} MB, built by `turnforge view RUN -o page.html` in {r['page']['build_seconds']} s. "
        f"Times from navigation start to the view drawn, medians of {r['loads']} fresh page loads in Chromium after a warm-up.",
        "",
        "| page | median s | all loads s | target s | met |",
        "| --- | ---: | --- | ---: | --- |",
        f"| overview, file mode | {fo['median']} | {', '.join(map(str, fo['all']))} | < {fo['target']:g} | {ok(fo)} |",
        f"| trajectory, serve mode | {st['median']} | {', '.join(map(str, st['all']))} | < {st['target']:g} | {ok(st)} |",
        f"| overview, serve mode | {so['median']} | {', '.join(map(str, so['all']))} | | |",
        "",
    ])


def main() -> None:
    from _runs import RESULTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--obs-words", type=int, default=60, help="random words added to each observation (sample length)")
    parser.add_argument("--work", type=Path, default=RESULTS / "view_bench_work", help="the synthetic run and page (replaced)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output directory (default %(default)s)")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    result = bench(args.work, args.samples, args.loads, args.obs_words)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    chromium = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True).stdout.strip()
    record = {
        "command": "python benchmarks/view_bench.py" + (f" --samples {args.samples}" if args.samples != 10_000 else "")
                   + (f" --loads {args.loads}" if args.loads != 5 else "")
                   + (f" --obs-words {args.obs_words}" if args.obs_words != 60 else ""),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu_model": cpu, "python": platform.python_version(),
                    "chromium": chromium, "load_avg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
        "result": result,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "view.json").write_text(json.dumps(record, indent=2) + "\n")
    text = to_markdown(record)
    (args.out / "view.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
