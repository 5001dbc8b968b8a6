"""Peak RSS as summary.json reports it: this process's high-water mark and its children's."""

from __future__ import annotations

import subprocess
import sys

import psutil

from turnforge.memory import peak_memory

HOLD = "import sys, time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ok', flush=True); sys.stdin.read()"


def test_peak_memory_counts_this_process_and_a_live_child_and_an_ended_one():
    rss = psutil.Process().memory_info().rss / 2**20
    assert peak_memory().process_mib >= rss - 1  # a high-water mark is never below the current RSS
    child = subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ok"  # its 200 MiB are touched
        live = peak_memory()
        assert live.children >= 1 and live.children_mib >= 200
    finally:
        child.communicate("")
    ended = peak_memory()  # reaped: counted by RUSAGE_CHILDREN
    assert ended.children_mib >= 200
