"""Aggregate decode speed of ``model.forward_batch`` against batch size, default model.

    python bench/bench_batch.py [--threads N] [--rounds 5] [--steps 8] [--plot batch.png]

For B = 1, 2, 4, 8 sequences (forks of one prompt, each fed its own tokens), float32 and
``quantized=True``, with a short prompt (16 tokens) and a 2,000-token one: the tokens
per second all sequences together decode, as a median over rounds, and the ratio to
B = 1 of the same run. Batch sizes take turns within each round. Printed with them:
the CPU's SIMD features and the thread count.

llama.cpp's batched decode (several sequence ids in one ``llama_batch``) is not in this
benchmark yet.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

BATCHES = (1, 2, 4, 8)


def cpu_features() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return " ".join(f for f in ["avx512f", "avx512_vnni", "avx2", "fma", "f16c", "amx_tile"] if f in flags)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    import numpy as np

    import kvcandle

    print(f"CPU features: {cpu_features()}; {args.threads} thread(s)")
    rng = np.random.default_rng(0)
    results: dict[tuple[str, int], dict[int, float]] = {}
    for quantized in (False, True):
        model = kvcandle.load(quantized=quantized)
        name = "quantized=True" if quantized else "float32"
        for context in (16, 2000):
            base = model.new_cache()
            model.forward(rng.integers(0, 49152, context).tolist(), base)
            rates: dict[int, list[float]] = {b: [] for b in BATCHES}
            for _ in range(args.rounds):
                for b in BATCHES:
                    caches = [base.fork() for _ in range(b)]
                    tokens = [[int(t)] for t in rng.integers(0, 49152, b)]
                    model.forward_batch(tokens, caches)  # each fork copies its block first
                    t = time.perf_counter()
                    for _ in range(args.steps):
                        model.forward_batch(tokens, caches)
                    rates[b].append(b * args.steps / (time.perf_counter() - t))
            med = {b: statistics.median(r) for b, r in rates.items()}
            results[(name, context)] = med
            print(f"{name}, {context}-token context: " + ", ".join(f"B={b} {med[b]:.1f} tok/s ({med[b] / med[1]:.2f}x)" for b in BATCHES))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for (name, context), med in results.items():
            ax.plot(BATCHES, [med[b] for b in BATCHES], marker="o", label=f"kvcandle {name}, {context} ctx")
        ax.set_xlabel("sequences in the batch (B)")
        ax.set_ylabel("aggregate decode tokens/s")
        ax.set_xticks(BATCHES)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
