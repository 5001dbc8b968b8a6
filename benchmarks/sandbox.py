"""Start-up overhead of turnforge.sandbox: wall time of a trivial program run in the sandbox,
against the same program run directly with ``subprocess.run``.

    python benchmarks/sandbox.py             # 50 runs of each program in each mode
    python benchmarks/sandbox.py --runs 200

Programs: ``/bin/true`` and ``python3 -c pass`` (the sandbox's python3, the first on the sandbox
PATH, in every mode). Modes: ``direct`` (subprocess, output captured), ``unsafe-none`` (our
start script, prlimit, output pump; no isolation) and ``bwrap`` (the real sandbox). Runs are
interleaved across modes, after 3 warm-up runs each; the ``Sandbox()`` construction, which
checks bwrap once per process, is timed apart. Overhead = median(mode) - median(direct).
Writes ``sandbox.json`` and ``sandbox.md`` to the directory ``--out`` (default ``runs/benchmarks``;
past measurements are in ``docs/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

from _runs import RESULTS
from turnforge.sandbox import Sandbox
from turnforge.sandbox.bwrap import program_env

TARGET_MS = 50.0
WARMUP = 3


def _quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q * 100) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--out", type=Path, default=RESULTS, help="output directory (default %(default)s)")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    sandbox_path = program_env("/", "/")["PATH"]
    programs = {"/bin/true": ["/bin/true"], "python3 -c pass": [shutil.which("python3", path=sandbox_path), "-c", "pass"]}
    start = time.perf_counter()
    bwrap = Sandbox()
    construct_ms = (time.perf_counter() - start) * 1000
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unsafe = Sandbox(backend="unsafe-none")
    modes = {
        "direct": lambda argv: subprocess.run(argv, capture_output=True, check=True),
        "unsafe-none": lambda argv: unsafe.run(argv),
        "bwrap": lambda argv: bwrap.run(argv),
    }

    # 1. time: interleaved, so that drift on a shared machine hits every mode alike
    times: dict[tuple[str, str], list[float]] = {(p, m): [] for p in programs for m in modes}
    for i in range(WARMUP + args.runs):
        for prog, argv in programs.items():
            for mode, run in modes.items():
                t0 = time.perf_counter()
                result = run(argv)
                elapsed = (time.perf_counter() - t0) * 1000
                assert getattr(result, "returncode", getattr(result, "exit_code", 1)) == 0, result
                if i >= WARMUP:
                    times[prog, mode].append(elapsed)

    # 2. summarise
    rows = []
    for (prog, mode), xs in times.items():
        direct = statistics.median(times[prog, "direct"])
        rows.append({
            "program": prog, "mode": mode, "runs": len(xs),
            "median_ms": round(statistics.median(xs), 2), "p10_ms": round(_quantile(xs, 0.1), 2),
            "p90_ms": round(_quantile(xs, 0.9), 2), "mean_ms": round(statistics.fmean(xs), 2),
            "overhead_ms": round(statistics.median(xs) - direct, 2),
        })
    bwrap_version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    record = {
        "benchmark": "sandbox start-up overhead",
        "command": " ".join(["python", *sys.argv]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "bwrap": bwrap_version, "caller_uid": os.geteuid(),
                    "load_avg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
        "target_overhead_ms": TARGET_MS,
        "sandbox_construction_ms": round(construct_ms, 2),
        "results": rows,
    }

    # 3. write
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sandbox.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# Sandbox start-up overhead",
        "",
        f"`{record['command']}` on {record['date_utc']} UTC: {platform.platform()}, {os.cpu_count()} CPUs, "
        f"{bwrap_version}, caller uid {os.geteuid()}, 1-min load average {load_before:.2f} before and "
        f"{os.getloadavg()[0]:.2f} after (other work on the machine shows there). {args.runs} runs per cell after {WARMUP} warm-up runs, "
        f"modes interleaved. Overhead = median - median of `direct`; target <= {TARGET_MS:g} ms.",
        "",
        "| program | mode | median ms | p10 ms | p90 ms | overhead ms |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
        *(f"| `{r['program']}` | {r['mode']} | {r['median_ms']} | {r['p10_ms']} | {r['p90_ms']} | {r['overhead_ms']} |" for r in rows),
        "",
        f"`Sandbox()` construction (finds bwrap, checks once per process that it can start a sandbox): {construct_ms:.1f} ms.",
        "",
    ]
    (args.out / "sandbox.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
