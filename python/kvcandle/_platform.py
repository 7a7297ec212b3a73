"""The machine a result was measured on, for test reports and benchmarks."""

from __future__ import annotations

import os
import platform

_SIMD_PREFIXES = ("avx", "fma", "f16c", "amx", "asimd", "sve", "neon")


def cpu_description() -> str:
    """The architecture, processor name and SIMD features the OS reports (Linux:
    /proc/cpuinfo), e.g. ``"x86_64 Intel(R) ... SIMD: avx2 avx512f fma"``."""
    flags: set[str] = set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    break
    simd = sorted(f for f in flags if f.startswith(_SIMD_PREFIXES))
    return f"{platform.machine()} {platform.processor() or ''} SIMD: {' '.join(simd) or 'unknown'}"
