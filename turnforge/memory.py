"""Peak memory of a run: the resident-set high-water marks of its process and of its child
processes (env workers, sandboxed tools), as ``summary.json`` reports them (``PeakMemory``).

Linux counts them for us: ``getrusage(RUSAGE_SELF).ru_maxrss`` is this process's peak RSS
(the ``VmHWM`` of ``/proc/self/status``), ``RUSAGE_CHILDREN`` the largest of its ended and
reaped children, and ``/proc/PID/status`` ``VmHWM`` that of a child still running.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import psutil

MIB = 2**20


@dataclass(frozen=True)
class PeakMemory:
    """Peak resident memory (RSS high-water marks), MiB."""

    process_mib: float  # the run's own process (ru_maxrss)
    children_mib: float  # its child processes, an upper bound: the sum of the live ones' peaks plus the largest ended one's
    children: int  # child processes alive when measured
    ranks_mib: tuple[float, ...] = ()  # on several trainer ranks (turnforge.dist): each rank's process_mib, rank order


def _hwm_mib(pid: int) -> float:
    """``VmHWM`` of a running process, MiB (0 if it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / MIB
    except OSError:
        pass
    return 0.0


def peak_memory() -> PeakMemory:
    """This process's peak RSS and its children's (see ``PeakMemory``), now."""
    live = psutil.Process().children(recursive=True)
    ended = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / MIB  # ru_maxrss is in KiB on Linux
    return PeakMemory(
        process_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB, 1),
        children_mib=round(sum(_hwm_mib(p.pid) for p in live) + ended, 1),
        children=len(live),
    )
