"""Time to first token for a long prompt, three ways, side by side on the default model:

    python bench/bench_reuse.py [--threads N] [--rounds 5] [--tokens 2000] [--quantized]

  cold          a fresh cache: the whole prompt is prefilled
  from file     kvcandle.load_cache() of the prompt's prefix saved earlier, then the rest
  PromptCache   PromptCache.lookup() of the prefix (a fork, in memory), then the rest

The prompt is a shared prefix (the document, ``--tokens`` long) and a short question
that differs per round, so only the question runs in the last two. Ways take turns
(A B C A B C ...); figures are medians. Also printed: the cache file's size against the
minimum (keys and values of the positions held), the save time, the CPU's SIMD features
and the thread count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--tokens", type=int, default=2000)
ap.add_argument("--quantized", action="store_true")
ARGS = ap.parse_args()
os.environ["RAYON_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402

import kvcandle  # noqa: E402
from kvcandle._platform import cpu_description  # noqa: E402


def main() -> None:
    print(f"cpu: {cpu_description()}")
    print(f"threads: {ARGS.threads}; kvcandle {kvcandle.__version__}")
    model = kvcandle.load(quantized=ARGS.quantized)
    tok = model.tokenizer
    text = "The committee met on Tuesday to review the budget, the schedule and the staffing plan. "
    doc = (tok.encode(text) * (ARGS.tokens // len(tok.encode(text)) + 1))[: ARGS.tokens]
    questions = [tok.encode(f" Question {i}: what did the committee review?") for i in range(ARGS.rounds)]

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "doc.kvcache.safetensors"
        base = model.new_cache()
        model.forward(doc, base)
        model.fingerprint  # the weights' hash, once per model, not in the save time
        t = time.perf_counter()
        base.save(path)
        save_s = time.perf_counter() - t
        size, minimum = path.stat().st_size, base.nbytes
        pc = kvcandle.PromptCache(model, max_bytes=1 << 32)
        pc.insert(base)

        def cold(q):
            return model.sync(doc + q, model.new_cache())

        def from_file(q):
            return model.sync(doc + q, kvcandle.load_cache(path, model))

        def prompt_cache(q):
            return model.sync(doc + q, pc.lookup(doc + q))

        ways = {"cold": cold, "from file": from_file, "PromptCache": prompt_cache}
        times: dict[str, list[float]] = {k: [] for k in ways}
        ran: dict[str, int] = {}
        logits: dict[str, np.ndarray] = {}
        for q in questions:
            for name, fn in ways.items():
                t = time.perf_counter()
                s = fn(q)
                times[name].append(time.perf_counter() - t)
                ran[name] = s.ran
                logits[name] = s.logits
            agree = {int(np.argmax(v)) for v in logits.values()}
            assert len(agree) == 1, f"the three ways disagree on the next token: {logits}"

    print(f"\nprompt: {len(doc)} shared tokens + a {len(questions[0])}-token question; {model.dtype}{' quantized' if model.quantized else ''}")
    print(f"cache file: {size / 1e6:.2f} MB for {len(doc)} positions; minimum (keys + values) {minimum / 1e6:.2f} MB "
          f"(+{(size - minimum) / 1e3:.1f} KB header and token ids); saved in {save_s * 1e3:.0f} ms\n")
    print("| way | TTFT ms (median) | tokens run | vs cold |")
    print("|---|---|---|---|")
    cold_ms = statistics.median(times["cold"]) * 1e3
    for name in ways:
        ms = statistics.median(times[name]) * 1e3
        print(f"| {name} | {ms:.1f} | {ran[name]} | {cold_ms / ms:.1f}x faster |" if name != "cold" else f"| {name} | {ms:.1f} | {ran[name]} | 1.0x |")
    print(f"\nmedians of {ARGS.rounds} rounds, ways in turns; TTFT = bringing the cache in line with the prompt and the last position's logits")


if __name__ == "__main__":
    main()
