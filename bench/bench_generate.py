"""Side-by-side speed of kvcandle and transformers on the default model, same machine,
same run: prefill tok/s for a long prompt and greedy decode tok/s with a KV cache.

    python bench/bench_generate.py [--decode 64] [--prompt-tokens 256] [--repeat 3]

Prints each engine's best-of-N figures and kvcandle's ratio to transformers.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import kvcandle
from kvcandle import parity


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    kv = kvcandle.load()
    tf = parity.Transformers()
    torch = tf.torch
    print(f"machine: {os.cpu_count()} cores; torch threads {torch.get_num_threads()}; kvcandle {kvcandle.__version__} ({kv.dtype}, {kv.device})")
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(100, 40000, args.prompt_tokens).tolist()
    short = kv.tokenizer.encode(parity.PROMPT)

    kv_prefill = best(lambda: kv.forward(long_prompt, kv.new_cache()), args.repeat)
    tf_prefill = best(lambda: tf.logits(long_prompt, tf.new_cache()), args.repeat)

    def kv_decode() -> None:
        parity.kv_greedy(kv, short, args.decode)

    def tf_decode() -> None:
        tf.greedy(short, args.decode)

    # decode time = whole greedy run minus its prefill of the short prompt
    kv_short = best(lambda: kv.forward(short, kv.new_cache()), args.repeat)
    tf_short = best(lambda: tf.logits(short, tf.new_cache()), args.repeat)
    kv_dec = (best(kv_decode, args.repeat) - kv_short) / (args.decode - 1)
    tf_dec = (best(tf_decode, args.repeat) - tf_short) / (args.decode - 1)

    rows = [
        (f"prefill {args.prompt_tokens} tokens (tok/s)", args.prompt_tokens / kv_prefill, args.prompt_tokens / tf_prefill),
        (f"greedy decode, {args.decode} tokens (tok/s)", 1 / kv_dec, 1 / tf_dec),
    ]
    print(f"| {'measure':40} | {'kvcandle':>10} | {'transformers':>12} | {'kvcandle / transformers':>23} |")
    print(f"|{'-' * 42}|{'-' * 12}|{'-' * 14}|{'-' * 25}|")
    for name, a, b in rows:
        print(f"| {name:40} | {a:10.1f} | {b:12.1f} | {a / b:22.2f}x |")


if __name__ == "__main__":
    main()
