"""What the benchmarks print about the machine they ran on."""

from __future__ import annotations

#: The instruction sets kvcandle's kernels and llama.cpp's builds choose between.
FEATURES = ["avx512f", "avx512_vnni", "avx2", "fma", "f16c", "amx_tile"]


def cpu_features() -> str:
    """The CPU's SIMD features among :data:`FEATURES` (Linux's /proc/cpuinfo), or "unknown"."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return " ".join(f for f in FEATURES if f in flags)
