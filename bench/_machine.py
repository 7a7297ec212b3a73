"""What the benchmarks print about the machine they ran on."""

from __future__ import annotations

#: The instruction sets kvcandle's kernels and llama.cpp's builds choose between.
FEATURES = ["avx512f", "avx512_vnni", "avx2", "fma", "f16c", "amx_tile"]


def cpu_features() -> str:
    """The CPU's SIMD features among :data:`FEATURES` (Linux's /proc/cpuinfo; "unknown"
    elsewhere), and how kvcandle's kernels run: their level (the best the CPU runs, or
    the one ``KVCANDLE_SIMD`` forces), the float32 prefetch level and the rows a
    one-input product reads side by side (``KVCANDLE_PREFETCH``, ``KVCANDLE_ROWS``)."""
    import kvcandle

    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    listed = " ".join(f for f in FEATURES if f in flags) or "unknown"
    return f"{listed}; kvcandle kernels: {kvcandle.simd_level()}, prefetch {kvcandle.prefetch_level()}, one-input rows {kvcandle.one_input_rows()}"
