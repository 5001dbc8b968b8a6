"""The CPU kernel path is pinned to AVX2 on x86 CPUs that have it (AVX-512 ones included),
unless the user chose one: the golden files and figures were recorded on that path."""

from __future__ import annotations

import subprocess
import sys

import pytest

from turnforge import kernels


@pytest.mark.parametrize("machine, flags, expected", [
    ("x86_64", "flags : fpu avx avx2 avx512f avx512bw\n", "avx2"),  # an AVX-512 CPU takes the AVX2 path
    ("x86_64", "flags : fpu sse4_2 avx\n", None),  # no AVX2: torch's own choice
    ("aarch64", "Features : fp asimd sve\n", None),
])
def test_pin_cpu_kernels(monkeypatch, tmp_path, machine, flags, expected):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setattr(kernels.platform, "machine", lambda: machine)
    (tmp_path / "cpuinfo").write_text(flags)
    monkeypatch.setattr(kernels, "Path", lambda p: tmp_path / "cpuinfo")
    kernels.pin_cpu_kernels()
    assert kernels.os.environ.get("ATEN_CPU_CAPABILITY") == expected


def test_a_users_choice_is_kept(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    kernels.pin_cpu_kernels()
    assert kernels.os.environ["ATEN_CPU_CAPABILITY"] == "default"


def test_the_cli_pins_before_torch_loads():
    code = ("import os; os.environ.pop('ATEN_CPU_CAPABILITY', None); import turnforge.cli, torch; "
            "print(os.environ.get('ATEN_CPU_CAPABILITY'), torch.backends.cpu.get_cpu_capability())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    if out[0] == "avx2":  # an x86 CPU with AVX2: torch runs that path
        assert out[1] == "AVX2"


INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse4_2 fma avx avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
vendor_id\t: SomethingElse
"""


def test_cpu_identity_reads_the_first_cpu_and_the_flags_that_pick_kernels():
    cpu = kernels.cpu_identity(INTEL)
    assert cpu == {"vendor": "GenuineIntel", "model_name": "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
                   "family_model": "6/143",
                   "flags": ("fma", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")}
    assert kernels.cpu_identity("")["flags"] == ()  # no /proc/cpuinfo (macOS): nothing invented


def test_kernel_env_names_only_what_is_set(monkeypatch):
    for key in kernels.KERNEL_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    assert kernels.kernel_env() == {"MKL_CBWR": "COMPATIBLE"}
