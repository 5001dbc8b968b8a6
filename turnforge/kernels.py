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


#: CPU flags that decide which float kernels ATen, MKL and oneDNN run.
KERNEL_FLAGS = ("fma", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
#: Environment variables that pin a kernel path or the thread count.
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS",
              "MKL_NUM_THREADS", "MKL_DYNAMIC", "OMP_DYNAMIC")


def cpu_identity(cpuinfo: str | None = None) -> dict[str, str | tuple[str, ...]]:
    """The first CPU of ``/proc/cpuinfo``: vendor, model name, family/model numbers and those of
    ``KERNEL_FLAGS`` it has (empty strings where the file is missing, as on macOS)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "vendor": fields.get("vendor_id", platform.machine()),
        "model_name": fields.get("model name", platform.processor()),
        "family_model": f"{fields['cpu family']}/{fields['model']}" if "cpu family" in fields and "model" in fields else "",
        "flags": tuple(f for f in KERNEL_FLAGS if f in flags),
    }


def kernel_env() -> dict[str, str]:
    """Those of ``KERNEL_ENV`` that are set."""
    return {k: os.environ[k] for k in KERNEL_ENV if k in os.environ}
