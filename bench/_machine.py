"""What the benchmarks print about the machine they ran on."""

from __future__ import annotations

import threading
import time

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


def memory_read_rate(threads: int, mb: int = 512) -> float:
    """GB/s reading a float32 array far larger than the caches, split over `threads`
    threads (numpy releases the GIL in its reductions): the faster of numpy's sum and of
    each part's dot product with itself (BLAS; it reads the part once), best of 5 each.
    On an AMD Zen 5 numpy's sum is bound by its additions, not by the memory (2 threads:
    52.7-55.3 GB/s against 85.3-86.0 for the dot product), which made the float32 decode
    read "143 %" of the ceiling; where the sum keeps up with the memory the two agree."""
    import numpy as np

    a = np.ones(mb * 1024 * 1024 // 4, dtype=np.float32)
    parts = np.array_split(a, threads)
    best = 0.0
    for read in (np.add.reduce, lambda p: np.dot(p, p)):
        for _ in range(5):
            ts = [threading.Thread(target=read, args=(p,)) for p in parts]
            t = time.perf_counter()
            for x in ts:
                x.start()
            for x in ts:
                x.join()
            best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best
