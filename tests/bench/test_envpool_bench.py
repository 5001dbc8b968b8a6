"""bench_envpool (benchmarks/envpool.py): every mode plays the same steps and resets, and the
result is plain JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from envpool import MODES, bench_envpool, to_markdown  # noqa: E402


def test_bench_envpool_modes_do_the_same_work():
    # max_steps=3 truncates every episode after 3 steps, so each env is reset mid-run.
    result = bench_envpool("sokoban", num_envs=4, num_workers=2, steps_per_env=7, env_kwargs={"max_steps": 3},
                           seed=1, repeats=2)
    assert json.loads(json.dumps(result)) == result
    assert list(result["modes"]) == list(MODES)
    assert set(result["ratios"]) >= {"envpool_async/single_process", "envpool_async/gymnasium_async"}

    steps = {mode: m["steps"] for mode, m in result["modes"].items()}
    assert all(s == [4 * 7, 4 * 7] for s in steps.values()), steps  # counted as results came back
    resets = {mode: m["resets"] for mode, m in result["modes"].items()}
    assert len({tuple(r) for r in resets.values()}) == 1 and resets["single_process"][0] >= 4, resets
    assert result["same_trajectories"], {mode: m["checksum"] for mode, m in result["modes"].items()}

    for mode, m in result["modes"].items():
        assert len(m["runs"]) == 2 and all(r > 0 for r in m["runs"]) and m["steps_per_s"] > 0, mode
        assert m["startup_s"] >= 0 and m["processes"] >= 1
        assert m["env_utilization"] is None if mode == "gymnasium_async" else 0 < m["env_utilization"] <= 1.01
    assert all(v > 0 for v in result["ratios"].values())

    table = to_markdown(result)
    assert all(f"| {mode} |" in table for mode in MODES)
