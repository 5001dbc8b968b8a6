"""The golden and reproducibility tests under every CPU kernel path this machine can run: a
stand-in for the CPUs we do not own.

    python benchmarks/kernel_matrix.py                     # every combination below
    python benchmarks/kernel_matrix.py --capabilities avx2 --threads 1 --cbwr unset
        [--out runs/benchmarks/kernel_matrix.json]

Each combination runs ``pytest tests/golden tests/test_kernels.py`` plus the bit-for-bit resume
test (``tests/e2e/test_train_tiny.py::test_resume_ends_with_the_same_weights``) in a fresh
process with

- ``ATEN_CPU_CAPABILITY`` = ``default``, ``avx2``, ``avx512`` (the last where the CPU has
  AVX-512F): which of ATen's vectorised kernels run (an AMD and an Intel CPU differ here when
  nothing pins it, and in MKL's choice when something does);
- ``TURNFORGE_GOLDEN_THREADS`` = 1, 2: torch's threads while the golden scenarios are played and
  the golden run trains (a reduction split over more threads adds in another order);
- ``MKL_CBWR`` unset or ``COMPATIBLE`` (MKL's conditional bitwise reproducibility: the same
  code branch on every x86 CPU).

It records pass/fail counts and wall time per combination, and from each golden test whether
its result equalled the stored file bit for bit and the largest float difference
(``TURNFORGE_GOLDEN_REPORT``): the combinations that differ in the last bits from the stored
files are the ones that simulate another CPU. Prints a Markdown table; writes JSON to ``--out``
(default ``runs/benchmarks/kernel_matrix.json``) with the table next to it (``.md``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from turnforge.kernels import cpu_identity  # noqa: E402

TESTS = ["tests/golden", "tests/test_kernels.py", "tests/e2e/test_train_tiny.py::test_resume_ends_with_the_same_weights"]


def run_one(capability: str, threads: int, cbwr: str) -> dict:
    """One combination in a fresh pytest process (the kernel path is chosen when torch loads)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "TURNFORGE_GOLDEN_THREADS": str(threads)}
    env.pop("MKL_CBWR", None)
    if cbwr != "unset":
        env["MKL_CBWR"] = cbwr
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as report:
        env["TURNFORGE_GOLDEN_REPORT"] = report.name
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=ROOT,
                              env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        golden = [json.loads(line) for line in Path(report.name).read_text().splitlines()]
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", tail)}
    return {"capability": capability, "threads": threads, "mkl_cbwr": cbwr, "returncode": proc.returncode,
            "passed": counts.get("passed", 0), "failed": counts.get("failed", 0) + counts.get("error", 0)
            + counts.get("errors", 0), "skipped": counts.get("skipped", 0), "seconds": round(seconds, 1),
            "summary_line": tail, "golden": golden,
            "failures": [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]}


def table(rows: list[dict], cpu: dict) -> str:
    out = [f"CPU: {cpu['model_name']} ({cpu['vendor']}, family/model {cpu['family_model']}; "
           f"{' '.join(cpu['flags'])}); {os.cpu_count()} cores", "",
           "| ATEN_CPU_CAPABILITY | threads | MKL_CBWR | passed | failed | s | scenarios bit for bit as stored "
           "| largest logprob difference | training run bit for bit | its largest float difference "
           "| its weights' largest difference / norm |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        scenarios = [g for g in r["golden"] if g["name"] != "train"]
        train = next((g for g in r["golden"] if g["name"] == "train"), None)
        largest = max((g["largest_float_difference"] for g in scenarios), default=0.0)
        run = ("yes" if train["bitwise"] else "no", f"{train['largest_float_difference']:.2g}",
               f"{train['weights_share_of_norm']:.2g}") if train else ("-", "-", "-")
        out.append(f"| {r['capability']} | {r['threads']} | {r['mkl_cbwr']} | {r['passed']} | {r['failed']} | "
                   f"{r['seconds']:.0f} | {sum(g['bitwise'] for g in scenarios)} of {len(scenarios)} | {largest:.2g} | "
                   + " | ".join(run) + " |")
    return "\n".join(out)


def main() -> int:
    has_avx512 = "avx512f" in cpu_identity()["flags"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capabilities", nargs="+", default=["default", "avx2", *(["avx512"] if has_avx512 else [])])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--cbwr", nargs="+", default=["unset", "COMPATIBLE"], help="MKL_CBWR values ('unset': none)")
    ap.add_argument("--out", type=Path, default=Path("runs/benchmarks/kernel_matrix.json"))
    args = ap.parse_args()
    cpu = cpu_identity()
    rows = []
    for capability, threads, cbwr in itertools.product(args.capabilities, args.threads, args.cbwr):
        rows.append(run_one(capability, threads, cbwr))
        r = rows[-1]
        print(f"{capability} threads={threads} MKL_CBWR={cbwr}: {r['summary_line']} ({r['seconds']:.0f} s)", flush=True)
    md = table(rows, cpu)
    print(md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))
    args.out.with_suffix(".md").write_text(md + "\n")
    return 0 if all(r["returncode"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
