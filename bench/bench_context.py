"""kvcandle's greedy decode speed as the context grows, against its own short-context
speed (issue 9's target: >= 0.85x at 2,048 tokens, >= 0.75x at 4,096).

    python bench/bench_context.py [--contexts 5 2048 4096] [--steps 32] [--rounds 7] [--quantized]

Each context gets one cache, prefilled once (untimed). A round decodes ``--steps`` tokens
on every context in turn, then crops each cache back (O(1)), so the contexts share the
machine's state; the figures are medians over the rounds. Prints the CPU's SIMD features
and the thread count, so results can be read against the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import kvcandle
from kvcandle._platform import cpu_description


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[5, 2048, 4096])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quantized", action="store_true")
    args = ap.parse_args()

    model = kvcandle.load(quantized=args.quantized)
    print(f"cpu: {cpu_description()}")
    print(f"threads: RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS', '(kvcandle default)')}; {os.cpu_count()} CPUs")
    print(f"model: {model}")
    rng = np.random.default_rng(0)
    caches = {}
    for n in args.contexts:
        cache = model.new_cache()
        model.forward(rng.integers(100, 40000, n).tolist(), cache)  # prefill, untimed
        caches[n] = cache
    times: dict[int, list[float]] = {n: [] for n in args.contexts}
    for _ in range(args.rounds):
        for n, cache in caches.items():
            token = 1000
            t = time.perf_counter()
            for _ in range(args.steps):
                token = int(model.forward([token], cache).argmax())
            times[n].append(time.perf_counter() - t)
            cache.crop(n)
    base = args.steps / statistics.median(times[args.contexts[0]])
    print(f"\n| context | decode tok/s (median of {args.rounds}) | vs context {args.contexts[0]} |")
    print("|---|---|---|")
    for n in args.contexts:
        tps = args.steps / statistics.median(times[n])
        print(f"| {n} | {tps:.1f} | {tps / base:.2f} |")


if __name__ == "__main__":
    main()
