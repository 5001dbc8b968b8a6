"""Speed of the terminal box (``turnforge.sandbox.BwrapBox``): a command's round trip, a box's
start, snapshot and restore, and 64 boxes at once.

    python benchmarks/terminal_step.py                    # writes runs/benchmarks/terminal_step.json
    python benchmarks/terminal_step.py --commands 200 --boxes 64 --per-box 20 --out /tmp/t.json

Measures, on one box: ``exec("echo hi")`` (a builtin: the protocol's own cost) and ``exec("ls /")``
(a fork and exec in the box), ``--commands`` times each after 10 warm-up calls, median and p90;
the start of a box (``BwrapBox(spec)`` until its shell answered) and its ``close``, median of 10;
``snapshot`` and ``restore`` of a workspace of 200 files of 4 KiB and one of 1 MiB, median of 10.
Then ``--boxes`` boxes at once, one thread each: start, ``--per-box`` commands (``echo``, ``cd``,
``ls``, ``cat`` of a file written earlier, checked), close; the wall time, the failures (an
exception or a wrong output), and afterwards the leftovers: processes of the boxes still on
the host (a scan of /proc for the supervisor's script), children of this process, file
descriptors and ``turnforge*`` entries of the temp dir beyond those there before.

Prints the CPU model (``lscpu``'s "Model name") and a summary, and writes everything as JSON to
``--out`` (default ``runs/benchmarks/terminal_step.json``, so nothing lands in the source tree).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _runs import RESULTS

from turnforge.sandbox import BoxSpec, BwrapBox
from turnforge.sandbox.shell import SUPERVISOR

TARGET_MS = 50.0  # median round trip of a short command


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "unknown")


def stats_ms(xs: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in xs)
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 3),
            "p90_ms": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 3), "max_ms": round(ms[-1], 3)}


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def check(result, expected: str) -> None:
    if result.exit_code != 0 or result.output != expected:
        raise AssertionError(f"expected {expected!r}, got {result}")


def one_box_figures(n: int) -> dict:
    box = BwrapBox(BoxSpec())
    try:
        for _ in range(10):
            check(box.exec("echo hi"), "hi\n")
        echo = timed(lambda: check(box.exec("echo hi"), "hi\n"), n)
        listing = box.exec("ls /").output
        ls = timed(lambda: check(box.exec("ls /"), listing), n)
        files = {f"src/f{i:03d}.txt": os.urandom(2048).hex().encode() for i in range(200)}
        files["data/blob.bin"] = os.urandom(1 << 20)
        box.put(files)
        snap = box.snapshot()
        snapshot = timed(box.snapshot, 10)
        restore = timed(lambda: box.restore(snap), 10)
        check(box.exec("ls src | wc -l"), "200\n")
    finally:
        box.close()
    starts, closes = [], []
    for _ in range(10):
        t0 = time.perf_counter()
        b = BwrapBox(BoxSpec())
        t1 = time.perf_counter()
        b.close()
        starts.append(t1 - t0)
        closes.append(time.perf_counter() - t1)
    return {
        "exec_echo": stats_ms(echo), "exec_ls": stats_ms(ls), "start": stats_ms(starts), "close": stats_ms(closes),
        "snapshot": {**stats_ms(snapshot), "tar_bytes": len(snap.files)}, "restore": stats_ms(restore),
    }


def one_episode(i: int, per_box: int) -> tuple[bool, str]:
    try:
        with BwrapBox(BoxSpec()) as box:
            check(box.exec(f"echo {i} > note.txt && mkdir -p d && cd d"), "")
            for k in range(per_box - 1):
                step = k % 4
                if step == 0:
                    check(box.exec(f"echo {i}-{k}"), f"{i}-{k}\n")
                elif step == 1:
                    check(box.exec("cd /app && pwd"), "/app\n")
                elif step == 2:
                    check(box.exec("ls"), "d\nnote.txt\n")
                else:
                    check(box.exec("cat note.txt"), f"{i}\n")
        return True, ""
    except Exception as err:  # noqa: BLE001 - counted and reported, not raised: the benchmark measures failures
        return False, f"{type(err).__name__}: {err}"


def open_fds() -> set[int]:
    """This process's open fds (the one listdir used is closed by the time it is checked)."""
    return {int(fd) for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}")}


def leftovers(fds_before: set[int], tmp_before: set[str]) -> dict:
    marker = SUPERVISOR.strip().splitlines()[0].encode()
    processes = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    processes.append(int(entry.name))
            except OSError:
                pass
    children = [int(c) for t in os.listdir("/proc/self/task")
                for c in Path(f"/proc/self/task/{t}/children").read_text().split()]
    tmp = {n for n in os.listdir(tempfile.gettempdir())
           if n.startswith("turnforge") and not n.startswith("turnforge-start-gate")}
    return {"box_processes": processes, "child_processes": children,
            "new_fds": sorted(open_fds() - fds_before),
            "new_temp_entries": sorted(tmp - tmp_before)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=200, help="timed short commands (default %(default)s)")
    parser.add_argument("--boxes", type=int, default=64, help="boxes at once (default %(default)s)")
    parser.add_argument("--per-box", type=int, default=20, help="commands per box (default %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS / "terminal_step.json", help="JSON file (default %(default)s)")
    args = parser.parse_args()
    reason = BwrapBox.unavailable()
    if reason:
        sys.exit(f"the bwrap box cannot run here: {reason}")
    load_before = os.getloadavg()[0]
    fds_before = open_fds()
    tmp_before = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("turnforge")}

    # 1. one box
    single = one_box_figures(args.commands)

    # 2. many boxes at once
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.boxes) as pool:
        outcomes = list(pool.map(lambda i: one_episode(i, args.per_box), range(args.boxes)))
    wall = time.perf_counter() - t0
    errors = [msg for good, msg in outcomes if not good]
    time.sleep(0.2)
    left = leftovers(fds_before, tmp_before)

    # 3. report
    record = {
        "benchmark": "terminal box step",
        "command": " ".join(["python", *sys.argv]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "caller_uid": os.geteuid(),
                    "bwrap": subprocess.run(["bwrap", "--version"], capture_output=True, text=True,
                                            check=True).stdout.strip(),
                    "load_avg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
        "target_median_ms": TARGET_MS,
        "single_box": single,
        "concurrent": {"boxes": args.boxes, "commands_per_box": args.per_box, "wall_s": round(wall, 3),
                       "commands_per_s": round(args.boxes * args.per_box / wall, 1), "failures": len(errors),
                       "first_errors": errors[:3], "leftovers": left,
                       "clean": not any(left.values())},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    m = record["machine"]
    print(f"CPU: {m['cpu_model']} ({m['cpus']} CPUs), {m['platform']}, {m['bwrap']}, "
          f"1-min load before/after {m['load_avg_1min_before_after']}")
    for name in ("exec_echo", "exec_ls", "start", "close", "snapshot", "restore"):
        s = single[name]
        print(f"{name:>10}: median {s['median_ms']:8.2f} ms  p90 {s['p90_ms']:8.2f} ms  (n={s['n']})")
    print(f"snapshot size: {single['snapshot']['tar_bytes']} bytes")
    c = record["concurrent"]
    print(f"{c['boxes']} boxes x {c['commands_per_box']} commands at once: {c['wall_s']} s wall, "
          f"{c['commands_per_s']} commands/s, {c['failures']} failures, leftovers {left} -> clean={c['clean']}")
    print(f"median exec(echo hi) {single['exec_echo']['median_ms']} ms vs target {TARGET_MS:g} ms; wrote {args.out}")


if __name__ == "__main__":
    main()
