"""StartGate: at most N holders across threads and processes, the rest queued (never refused),
a dead holder's slot freed by the kernel, the queue time reported apart from the work."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from turnforge.errors import UserError
from turnforge.sandbox.gate import StartGate, check_slots, usable_cores


def test_at_most_n_threads_hold_a_slot_and_none_is_refused(tmp_path):
    gate = StartGate(2, tmp_path)
    holders, peak, done = [0], [0], []
    lock = threading.Lock()

    def work(i: int) -> None:
        with gate.slot():
            with lock:
                holders[0] += 1
                peak[0] = max(peak[0], holders[0])
            time.sleep(0.05)
            with lock:
                holders[0] -= 1
        done.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(done) == list(range(8))
    assert peak[0] == 2  # 8 threads each sleeping inside: two at once, never three


HOLD = """
import os, sys, time
from turnforge.sandbox.gate import StartGate
with StartGate(1, sys.argv[1]).slot():
    marker = os.path.join(sys.argv[1], "inside")
    open(marker, "w").close()
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    os.remove(marker)
"""


def _holder(directory, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_slot_held_by_another_process_queues_and_the_wait_is_reported(tmp_path):
    holder = _holder(tmp_path, 1.0)
    start = time.monotonic()
    with StartGate(1, tmp_path).slot() as ticket:
        assert not (tmp_path / "inside").exists()  # the other process was done before we got in
        assert 0.0 < ticket.waited_s <= time.monotonic() - start
    holder.wait()


def test_a_killed_holder_frees_its_slot(tmp_path):
    holder = _holder(tmp_path, 600)
    holder.kill()
    holder.wait()
    with StartGate(1, tmp_path).slot() as ticket:  # the kernel dropped the dead process's lock
        assert ticket.waited_s < 60


def test_slots_default_to_the_usable_cores_and_bad_counts_are_one_line():
    assert check_slots(None, "max_starting") == usable_cores() >= 1
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(UserError, match=r"^max_starting must be a whole number >= 1"):
            check_slots(bad, "max_starting")


def test_taskset_one_core_gives_one_slot():
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c",
                          "from turnforge.sandbox.gate import usable_cores; print(usable_cores())"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"
