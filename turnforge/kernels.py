"""Pin torch's CPU kernel path so float results do not depend on which x86 CPU a run lands on.

ATen picks its vectorised kernels by CPU at start-up (AVX2, AVX-512, ...); another path gives
other float results, and a behaviour-cloning stage amplifies them into other figures
(docs/log.md, 2026-11-23). The figures and the golden files were recorded on the AVX2 path, so
on an x86 CPU that has AVX2 (AVX-512 ones included) it is pinned there unless the user set
``ATEN_CPU_CAPABILITY`` themselves. Must run before torch is imported; imports nothing heavy.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def pin_cpu_kernels() -> None:
    """``ATEN_CPU_CAPABILITY=avx2`` on x86 CPUs with AVX2, unless already set."""
    if "ATEN_CPU_CAPABILITY" in os.environ or platform.machine().lower() not in ("x86_64", "amd64"):
        return
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return
    if " avx2" in flags:
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
