"""What a float16 and an 8-bit (q8_0) cache move, against a float32 one, on
``quantized=True`` and on the float32 model, beside what the int8 activations move.

    python bench/bench_cache_dtype.py [--tokens 2000] [--decode 200]

The text is this project's README, tokenized, cut to ``--tokens``; the last ``--decode``
tokens run as decode steps (teacher-forced), the rest as one prefill. Printed per phase:
the share of positions whose greedy token changes (1 - top-1 agreement) and the largest
and mean logit change, for each cache type against the float32 cache on the same model,
for the quantized model (float32 cache) against the float32 model on the same weights
(its int8 activations), and for the quantized model with each cache type against the
float32 model with its float32 cache.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import kvcandle


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--decode", type=int, default=200)
    args = ap.parse_args()
    quantized, float32 = kvcandle.load(quantized=True), kvcandle.load()
    ids = quantized.tokenizer.encode((Path(__file__).parent.parent / "README.md").read_text())[: args.tokens]
    head = len(ids) - args.decode

    def logits(model: kvcandle.Model, dtype: str) -> np.ndarray:
        cache = model.new_cache(dtype)
        rows = [model.forward(ids[:head], cache, all_logits=True)]
        rows += [model.forward([t], cache)[None, :] for t in ids[head:]]
        return np.concatenate(rows)

    dtypes = ("float32", "float16", "q8_0")
    q = {d: logits(quantized, d) for d in dtypes}
    f = {d: logits(float32, d) for d in dtypes}
    print(f"{len(ids)} tokens: {head} prefill, {len(ids) - head} decode; quantized=True's default cache: {quantized.default_cache_dtype}")
    pairs = [(f"float32 model, {d} cache vs float32 cache", f[d], f["float32"]) for d in dtypes[1:]]
    pairs += [(f"quantized, {d} cache vs float32 cache", q[d], q["float32"]) for d in dtypes[1:]]
    pairs += [(f"quantized ({d} cache) vs float32 model (float32 cache)", q[d], f["float32"]) for d in dtypes]
    for label, a, b in pairs:
        for phase, rows in (("prefill", slice(0, head)), ("decode", slice(head, None))):
            x, y = a[rows], b[rows]
            moved = float(np.mean(x.argmax(-1) != y.argmax(-1)))
            d = np.abs(x - y)
            print(f"{label}, {phase}: greedy token changed at {moved:.2%} of positions, logits max {d.max():.3g}, mean {d.mean():.3g}")

if __name__ == "__main__":
    main()
