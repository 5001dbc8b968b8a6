"""The ``miniwob`` env's speed and robustness: step latency, the scripted experts' success, and
browsers in parallel on env workers through the rollout engine.

    python benchmarks/miniwob_env.py                     # 300 single-env steps, 1,000 parallel episodes
    python benchmarks/miniwob_env.py --episodes 100      # quicker

1. Latency: one env in this process, the experts playing held-out tasks; each ``step`` (the
   action in the page, then the new element list) and each ``reset`` (a fresh page load) timed.
2. Parallel: ``--episodes`` train episodes of the experts on the rollout engine with
   ``--workers`` env worker processes and ``--slots`` env slots (a headless Chromium each),
   counting infrastructure failures (crashed or hung browsers) and worker restarts.

Targets (issue 35): a step under 150 ms median; 4 browsers in parallel on 2 cores without a
failure over 1,000 episodes; the experts >= 95%. Writes ``miniwob_env.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

from _runs import RESULTS, cpu


def latency(steps: int) -> dict:
    from turnforge.envs import make

    env = make("miniwob")
    step_s, reset_s, solved, episodes = [], [], 0, 0
    try:
        i = 0
        while len(step_s) < steps:
            t0 = time.perf_counter()
            env.reset(env.task("heldout", i), i)
            reset_s.append(time.perf_counter() - t0)
            for _ in range(8):
                action = env.expert_action()
                t0 = time.perf_counter()
                result = env.step(action)
                step_s.append(time.perf_counter() - t0)
                if result.terminated:
                    break
            solved += result.success
            episodes += 1
            i += 1
    finally:
        env.close()
    return {"steps": len(step_s), "step_ms_median": 1000 * statistics.median(step_s),
            "step_ms_p90": 1000 * statistics.quantiles(step_s, n=10)[-1], "reset_ms_median": 1000 * statistics.median(reset_s),
            "episodes": episodes, "expert_success": solved / episodes}


def parallel(episodes: int, workers: int, slots: int) -> dict:
    from turnforge.app.config import load_config
    from turnforge.rollout.actors import ExpertActor
    from turnforge.rollout.engine import EpisodeRequest, make_engine

    cfg = load_config("miniwob-tiny", [f"engine.env_workers={workers}", f"engine.env_slots={slots}", f"rl.group_size={min(2, slots)}"])
    engine = make_engine(cfg, None)
    try:
        env = engine.env
        requests = [EpisodeRequest(env.task("train", i), i, f"g{i}", f"bench-{i}") for i in range(episodes)]
        t0 = time.perf_counter()
        trajectories, _ = engine.play(requests, ExpertActor(), tokens=False)
        seconds = time.perf_counter() - t0
        pool = engine.pool_stats()
    finally:
        engine.close()
    failed = [t for t in trajectories if t.infra_failure is not None]
    ok = [t for t in trajectories if t.infra_failure is None]
    by_task = Counter(t.task.data["task"] for t in ok if not t.success)
    return {"episodes": episodes, "workers": workers, "browsers": slots, "seconds": seconds,
            "episodes_per_s": episodes / seconds, "infra_failures": len(failed),
            "first_failure": failed[0].infra_failure if failed else None,
            "restarts": pool.restarts if pool else 0, "timeouts": pool.timeouts if pool else 0,
            "expert_success": sum(t.success for t in ok) / max(1, len(ok)), "unsolved_by_task": dict(by_task)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--out", type=Path, default=RESULTS / "miniwob_env.json")
    args = ap.parse_args()
    lat = latency(args.steps)
    par = parallel(args.episodes, args.workers, args.slots)
    lines = [f"miniwob env, {cpu()}", "",
             "| measure | value |", "|---|---|",
             f"| step (action + new element list), median / p90 | {lat['step_ms_median']:.0f} ms / {lat['step_ms_p90']:.0f} ms "
             f"({lat['steps']} steps) |",
             f"| reset (fresh page load), median | {lat['reset_ms_median']:.0f} ms |",
             f"| scripted experts, held-out | {lat['expert_success']:.3f} ({lat['episodes']} episodes) |",
             f"| {par['browsers']} browsers on {par['workers']} env workers, {par['episodes']} episodes | "
             f"{par['infra_failures']} infrastructure failures, {par['restarts']} worker restarts, "
             f"{par['episodes_per_s']:.1f} episodes/s, experts {par['expert_success']:.3f} |"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": cpu(), "latency": lat, "parallel": par}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
