"""The block cache's figures on the default model (float32), in one run.

    python bench/bench_blocks.py [--threads N] [--rounds 5] [--against PYTHON]

Each figure is taken in a fresh process per environment:
- 8 forks of a 2,000-token prompt, each extended by 64 tokens: the resident memory they
  add (first in the process, so no freed memory is reused), against the allowance of 8 x
  64 positions plus one block per fork, and the bytes their blocks hold
  (``kvcandle.held_bytes``);
- at 4,095 positions, a fork's first append after another fork's (so it must copy what
  it shares), against the same append on an unshared cache: medians;
- decode step time at 2,048 and 4,096 positions of context, float32 and float16 caches,
  and a 2,048-token prefill.
With ``--against PYTHON`` (the interpreter of another environment, such as one with the
kvcandle of an earlier commit installed) every figure is taken there too, the two taking
turns in every decode round, and the decode ratios are printed: how the block cache
compares with the contiguous buffers it replaced, in the same run.

Each decode measurement prefills the context once, then times ``--steps`` steps,
cropping back after each, and keeps the median; rounds alternate the environments.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from _machine import cpu_features  # bench/ is on the path when a script runs

CONTEXTS = (2048, 4096)
DECODE = r"""
import json, os, statistics, sys, time
import numpy as np
import kvcandle
model = kvcandle.load()
steps = int(sys.argv[1])
out = {"version": kvcandle.__file__}
rng = np.random.default_rng(0)
for dtype in ("float32", "float16"):
    for ctx in json.loads(sys.argv[2]):
        cache = model.new_cache(dtype=dtype)
        model.forward(rng.integers(0, 49152, ctx).tolist(), cache)
        model.forward([0], cache)  # warm up
        cache.trim(1)
        times = []
        for i in range(steps):
            t = time.perf_counter()
            model.forward([int(i)], cache)
            times.append(time.perf_counter() - t)
            cache.trim(1)
        out[f"decode, {dtype} cache, {ctx}"] = statistics.median(times)
ids = rng.integers(0, 49152, 2048).tolist()
model.forward(ids[:64])  # warm up
t = time.perf_counter()
model.forward(ids)
out["prefill of 2,048 tokens"] = time.perf_counter() - t
print(json.dumps(out))
"""

FORKS = r"""
import gc, json, os, statistics, sys, time
import numpy as np
import kvcandle

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
model = kvcandle.load()
rng = np.random.default_rng(2)
out = {}
# 8 forks of a 2,000-token prompt, each extended by 64 tokens, first in the process (so
# no memory freed earlier is reused): the resident memory they add
base = model.new_cache()
model.forward(rng.integers(0, 49152, 2000).tolist(), base)
gc.collect()
before = rss()
caches = [base.fork() for _ in range(8)]
for c in caches:
    model.forward(rng.integers(0, 49152, 64).tolist(), c)
gc.collect()
out["added"] = rss() - before
out["per"] = base.bytes_per_token
if hasattr(kvcandle, "held_bytes"):
    out["held"] = kvcandle.held_bytes([base, *caches]) - base.held_bytes
del caches, base
# at 4,095 positions: a fork whose first append comes after another fork's (so it must
# copy what it shares), against the same append on an unshared cache
base = model.new_cache()
model.forward(rng.integers(0, 49152, 4095).tolist(), base)
fork_t, append_t, plain_t = [], [], []
for _ in range(int(sys.argv[1])):
    other = base.fork()
    model.forward([5], other)
    t = time.perf_counter()
    f = base.fork()
    fork_t.append(time.perf_counter() - t)
    t = time.perf_counter()
    model.forward([5], f)
    append_t.append(time.perf_counter() - t)
    del f, other
    t = time.perf_counter()
    model.forward([5], base)
    plain_t.append(time.perf_counter() - t)
    base.trim(1)
out["fork"], out["append"], out["plain"] = (statistics.median(x) for x in (fork_t, append_t, plain_t))
print(json.dumps(out))
"""


def forks(engines: dict[str, str], rounds: int) -> None:
    for name, python in engines.items():
        run = subprocess.run([python, "-c", FORKS, str(rounds * 4)], check=True, capture_output=True, text=True, env=os.environ)
        r = json.loads(run.stdout.strip().splitlines()[-1])
        held = f"; their new blocks hold {r['held'] / 2**20:.1f} MiB" if "held" in r else ""
        print(f"{name}: 8 forks of a 2,000-token prompt + 64 tokens each: resident memory +{r['added'] / 2**20:.1f} MiB{held} "
              f"(8 x (64 + 64) positions = {8 * 128 * r['per'] / 2**20:.1f} MiB; 8 x 2,064 positions = {8 * 2064 * r['per'] / 2**20:.1f} MiB)")
        print(f"{name}: at 4,095 positions: fork {r['fork'] * 1e6:.1f} us; its first append after another fork's "
              f"{r['append'] * 1e3:.2f} ms; the same append without a fork {r['plain'] * 1e3:.2f} ms "
              f"(fork + first append: {(r['fork'] + r['append'] - r['plain']) * 1e3:.2f} ms more than the append alone)")


def decode(python: str, steps: int) -> dict:
    out = subprocess.run([python, "-c", DECODE, str(steps), json.dumps(CONTEXTS)], check=True, capture_output=True, text=True, env=os.environ)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--against", default=None, help="another environment's python, measured in turns")
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    import kvcandle

    print(f"CPU features: {cpu_features()}; {args.threads} thread(s); block of {kvcandle.BLOCK_LEN} positions")
    engines = {"this": sys.executable} | ({"against": args.against} if args.against else {})
    forks(engines, args.rounds)
    results: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, python in engines.items():
            results[name].append(decode(python, args.steps))
    keys = [k for k in results["this"][0] if k != "version"]
    for k in keys:
        line = f"{k}: " + ", ".join(
            f"{name} {statistics.median(r[k] for r in rs) * 1e3:.2f} ms" for name, rs in results.items()
        )
        if args.against:
            ratio = statistics.median(a[k] / b[k] for a, b in zip(results["against"], results["this"]))
            line += f" (this is {ratio:.3f}x as fast, median of per-round ratios)"
        print(line)
    for name, rs in results.items():
        print(f"{name}: {rs[0]['version']}")


if __name__ == "__main__":
    main()
