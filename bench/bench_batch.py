"""Aggregate decode speed of ``model.forward_batch`` against batch size, default model.

    python bench/bench_batch.py [--threads N] [--rounds 5] [--steps 8] [--plot batch.png]

For B = 1, 2, 4, 8 sequences (forks of one prompt, each fed its own tokens), float32 and
``quantized=True``, with a short prompt (16 tokens) and a 2,000-token one: the tokens
per second all sequences together decode, as a median over rounds, and the ratio to
B = 1 of the same run. Batch sizes take turns within each round. Printed with them:
the CPU's SIMD features and the thread count.

Then the same small-M case inside one sequence: the time of a chunk of k = 2, 4, 8
tokens (rows of one step up to ``kvcandle.SMALL_CHUNK``) and of 16 (the prefill path)
after 300 tokens, in decode steps of the same run (chunk sizes in turns, medians).

And prompts: B prompts of n tokens each prefilled on fresh caches by one
``forward_batch`` (their rows stacked in every product) against one ``forward`` per
prompt (in turns), as prompt tokens per second; llama.cpp beside it with all B prompts
in one ``llama_batch`` (B sequence ids, one ``llama_decode``).

With llama-cpp-python installed, llama.cpp's batched decode runs beside it on the same
model (float32: the Q4_1 file written as an all-float32 GGUF by llama.cpp's quantizer;
``quantized=True``: the Q4_1 file): the prompt decoded on sequence 0 and its cache cells
copied to sequences 1..B-1, then one ``llama_batch`` of B tokens with B sequence ids per
``llama_decode``, in a process of its own per context (llama.cpp's default float16
cache, its unified cache for B sequences) that runs one round when asked: each round of
kvcandle's decode figures is followed by one of llama.cpp's, so the two engines take
turns (one engine's rounds after the other's put them in different minutes of these
machines' memory pace: one float32 sequence's ratio read 0.76x in such a run and 1.04-1.17x
in turns a minute later). Its first round, right after its setup, is not kept (the other
process ran slower then). With the 2,000-token context the float32
model runs a second time on a float16 cache, so that kvcandle's cache reads as many
bytes per step as llama.cpp's. After the float32 figures with the 16-token context, the
memory's read rate (``_machine.memory_read_rate``, measured at the start and there) gives
one sequence's float32 decode its ceiling (the weights' bytes once per token): each
engine's share of it, and so the largest lead over llama.cpp any engine could have here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from _machine import cpu_features, memory_read_rate  # bench/ is on the path when a script runs

BATCHES = (1, 2, 4, 8)
CHUNKS = (1, 2, 4, 8, 16, 32)
PROMPTS = ((8, 40), (8, 128), (2, 256))  # (B, tokens per prompt)


LLAMA_CPP = r"""
import json, sys, time
import numpy as np
import llama_cpp as L

path, context, steps, rounds, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
batches = json.loads(sys.argv[6])
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
rng = np.random.default_rng(0)
prompt = rng.integers(0, 49152, context).tolist()


def decode(ctx, batch, tokens, positions, seqs, logits):
    batch.n_tokens = len(tokens)
    for i, (t, p, s, lg) in enumerate(zip(tokens, positions, seqs, logits)):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, lg
        batch.seq_id[i][0] = s
    assert L.llama_decode(ctx, batch) == 0


# for each B, a context with the prompt decoded on sequence 0 and its cells copied to the others
runs = {}
for b in batches:
    params = L.llama_context_default_params()
    params.n_ctx = b * (context + steps * (rounds + 1) + 64)
    params.n_batch = 512
    params.n_ubatch = 512
    params.n_seq_max = b
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = True
    ctx = L.llama_init_from_model(model, params)
    batch = L.llama_batch_init(512, 0, b)
    for start in range(0, context, 512):
        chunk = prompt[start:start + 512]
        decode(ctx, batch, chunk, range(start, start + len(chunk)), [0] * len(chunk), [0] * len(chunk))
    mem = L.llama_get_memory(ctx)
    for s in range(1, b):
        L.llama_memory_seq_cp(mem, 0, s, -1, -1)
    runs[b] = [ctx, batch, context]
print("ready", flush=True)
# a line on stdin asks for one round: each B's tokens/s, printed as one JSON line
for _ in sys.stdin:
    out = {}
    for b in batches:
        ctx, batch, pos = runs[b]
        t = time.perf_counter()
        for _ in range(steps):
            decode(ctx, batch, [int(x) for x in rng.integers(0, 49152, b)], [pos] * b, range(b), [1] * b)
            pos += 1
        out[b] = b * steps / (time.perf_counter() - t)
        runs[b][2] = pos
    print(json.dumps(out), flush=True)
"""


LLAMA_CPP_PROMPTS = r"""
import json, sys, time, statistics
import numpy as np
import llama_cpp as L

path, rounds, threads, shapes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
rng = np.random.default_rng(0)
out = {}
for b, n in shapes:
    params = L.llama_context_default_params()
    params.n_ctx = b * n + 64
    params.n_batch = params.n_ubatch = b * n
    params.n_seq_max = b
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = True
    ctx = L.llama_init_from_model(model, params)
    batch = L.llama_batch_init(b * n, 0, b)
    rates = []
    for _ in range(rounds):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        batch.n_tokens = b * n
        for s in range(b):
            for j, t in enumerate(rng.integers(0, 49152, n).tolist()):
                i = s * n + j
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, j, 1, int(j == n - 1)
                batch.seq_id[i][0] = s
        t = time.perf_counter()
        assert L.llama_decode(ctx, batch) == 0
        rates.append(b * n / (time.perf_counter() - t))
    out[f"{b}x{n}"] = statistics.median(rates)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
print(json.dumps(out))
"""


def llama_cpp(script: str, path: str, *args: str) -> Optional[dict]:
    """What one of the llama.cpp scripts above prints, run in a process of its own, or None
    (with the reason printed)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama.cpp: skipped (pip install llama-cpp-python to compare)")
        return None
    run = subprocess.run([sys.executable, "-c", script, path, *args], capture_output=True, text=True)
    if run.returncode != 0:
        print(f"llama.cpp failed on {path} (exit {run.returncode}): {run.stderr.strip().splitlines()[-1:] }")
        return None
    return json.loads(run.stdout.strip().splitlines()[-1])


# seconds between one engine's turn and the other's (see LlamaTurns.round)
TURN_PAUSE = 0.5


class LlamaTurns:
    """llama.cpp's batched decode (the script above) in a process of its own that runs one
    round when asked, so that its rounds take turns with kvcandle's; None-like (no rounds,
    no medians) when llama-cpp-python is missing or the process fails (the reason printed)."""

    def __init__(self, path: Optional[Path], context: int, steps: int, rounds: int, threads: int) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.rates: dict[int, list[float]] = {b: [] for b in BATCHES}
        if path is None:
            return
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama.cpp: skipped (pip install llama-cpp-python to compare)")
            return
        # its log (megabytes) to a file, not a pipe nobody reads while it runs
        self.log = tempfile.TemporaryFile(mode="w+")
        args = [str(path), str(context), str(steps), str(rounds), str(threads), json.dumps(BATCHES)]
        self.proc = subprocess.Popen([sys.executable, "-c", LLAMA_CPP, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.path = path
        if self._reply(lambda line: line == "ready") is None:
            self._fail()
            return
        # one round not kept: right after its setup the other process ran slower (one
        # float32 sequence 35.4-43.8 tok/s against 44.8-47.5 alone and 45.7-49.1 after
        # a round of llama.cpp's, 1 thread; docs/measurements.md)
        self.round()
        self.rates = {b: [] for b in BATCHES}

    def _reply(self, ok: Callable[[str], bool]) -> Optional[str]:
        """The first line of its output that `ok` accepts, or None at its end."""
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if ok(line.strip()):
                return line.strip()
        return None

    def _fail(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        code = self.proc.wait()
        self.log.seek(0)
        print(f"llama.cpp failed on {self.path} (exit {code}): {self.log.read().strip().splitlines()[-1:]}")
        self.proc = None

    def round(self) -> None:
        """One round: each B's tokens/s, kept for the medians. Both engines' threads may
        spin a while after their last step (kvcandle's team 2 ms; llama.cpp's threadpool
        polls for work before it sleeps), so each turn starts after a pause."""
        if self.proc is None:
            return
        assert self.proc.stdin is not None
        time.sleep(TURN_PAUSE)
        try:
            self.proc.stdin.write("round\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it ended: its log says why
            self._fail()
            return
        line = self._reply(lambda line: line.startswith("{"))
        time.sleep(TURN_PAUSE)
        if line is None:
            self._fail()
            return
        for b, rate in json.loads(line).items():
            self.rates[int(b)].append(rate)

    def medians(self) -> Optional[dict[int, float]]:
        """Each B's median tokens/s over the rounds run, and the process ended; or None."""
        if self.proc is None:
            return None
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()
        self.proc = None
        return {b: statistics.median(r) for b, r in self.rates.items()}


def prompt_rates(model, rng, rounds: int) -> dict[str, tuple[float, float]]:
    """For each (B, n) of PROMPTS: median prompt tokens/s of B prompts of n tokens
    prefilled by one forward_batch and by one forward each, in turns."""
    out = {}
    for b, n in PROMPTS:
        together, alone = [], []
        for _ in range(rounds):
            prompts = [rng.integers(0, 49152, n).tolist() for _ in range(b)]
            caches = [model.new_cache() for _ in range(b)]
            t = time.perf_counter()
            model.forward_batch(prompts, caches)
            together.append(b * n / (time.perf_counter() - t))
            caches = [model.new_cache() for _ in range(b)]
            t = time.perf_counter()
            for p, c in zip(prompts, caches):
                model.forward(p, c)
            alone.append(b * n / (time.perf_counter() - t))
        out[f"{b}x{n}"] = (statistics.median(together), statistics.median(alone))
    return out


def chunk_costs(model, rng, rounds: int) -> dict[int, float]:
    """Median seconds of a chunk of k tokens after 300, for each k in CHUNKS."""
    base = model.new_cache()
    model.forward(rng.integers(0, 49152, 300).tolist(), base)
    times: dict[int, list[float]] = {k: [] for k in CHUNKS}
    for _ in range(3 * rounds):
        for k in CHUNKS:
            cache = base.fork()
            ids = rng.integers(0, 49152, k).tolist()
            t = time.perf_counter()
            model.forward(ids, cache)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def print_ceiling(weight_bytes: int, rate: float, ours: float, theirs: Optional[float]) -> None:
    """One float32 sequence's decode reads every weight once per token, so the memory's
    read rate (GB/s, measured in this run) bounds it: each engine's share of that bound
    (llama.cpp's where it ran), and the most any engine reading the weights once could be
    ahead of llama.cpp here."""
    ceiling = rate * 1e9 / weight_bytes
    vs = f", llama.cpp {theirs / ceiling:.0%}; reading the weights once, no engine can be more than {ceiling / theirs:.2f}x llama.cpp here" if theirs else ""
    print(f"float32, B=1, 16-token context: {weight_bytes / 1e6:.0f} MB of weights per token, memory read rate {rate:.1f} GB/s "
          f"(this run), so at most {ceiling:.1f} tok/s: kvcandle {ours / ceiling:.0%} of it{vs}")


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
    read_rates = [memory_read_rate(args.threads)]
    rng = np.random.default_rng(0)
    results: dict[tuple[str, int], dict[int, float]] = {}
    src = kvcandle.default_model_path()
    llama_files: dict[bool, Optional[Path]] = {True: src, False: None}
    try:
        sys.path.insert(0, str(Path(__file__).parent))
        from _llamacpp import write_f32_gguf

        llama_files[False] = write_f32_gguf(src, args.threads)
    except ImportError:
        pass
    for quantized in (False, True):
        model = kvcandle.load(quantized=quantized)
        # each model's default cache (8-bit for quantized=True; the README's tables
        # were measured with float32 caches throughout)
        name = ("quantized=True" if quantized else "float32") + f", {model.default_cache_dtype} cache"
        cost = chunk_costs(model, rng, args.rounds)
        print(f"kvcandle {name}, a chunk of k tokens after 300, in decode steps ({cost[1] * 1e3:.1f} ms): "
              + ", ".join(f"k={k} {cost[k] / cost[1]:.2f}" for k in CHUNKS[1:]))
        prompts = prompt_rates(model, rng, args.rounds)
        theirs_p = llama_cpp(LLAMA_CPP_PROMPTS, str(llama_files[quantized]), str(args.rounds), str(args.threads), json.dumps(PROMPTS)) if llama_files[quantized] else None
        for shape, (together, alone) in prompts.items():
            vs = f"; llama.cpp {'Q4_1' if quantized else 'f32'} in one batch {theirs_p[shape]:.0f} (kvcandle {together / theirs_p[shape]:.2f}x)" if theirs_p else ""
            print(f"kvcandle {name}, {shape} prompt tokens: {together:.0f} tok/s in one forward_batch, {alone:.0f} one forward each ({together / alone:.2f}x){vs}")
        for context in (16, 2000):
            # llama.cpp's process first (its prompts decoded before kvcandle's, not during)
            theirs_turns = LlamaTurns(llama_files[quantized], context, args.steps, args.rounds, args.threads)
            # the float32 model with a 2,000-token context also on a float16 cache, as
            # llama.cpp's default cache is: the cache's bytes then match its
            dtypes = [model.default_cache_dtype] + (["float16"] if not quantized and context > 16 else [])
            bases = {}
            for dtype in dtypes:
                bases[dtype] = model.new_cache(dtype)
                model.forward(rng.integers(0, 49152, context).tolist(), bases[dtype])
            rates: dict[str, dict[int, list[float]]] = {dtype: {b: [] for b in BATCHES} for dtype in dtypes}
            # kvcandle's round (every cache type and B), then llama.cpp's: in turns
            for _ in range(args.rounds):
                for dtype in dtypes:
                    for b in BATCHES:
                        caches = [bases[dtype].fork() for _ in range(b)]
                        tokens = [[int(t)] for t in rng.integers(0, 49152, b)]
                        model.forward_batch(tokens, caches)  # each fork copies its block first
                        t = time.perf_counter()
                        for _ in range(args.steps):
                            model.forward_batch(tokens, caches)
                        rates[dtype][b].append(b * args.steps / (time.perf_counter() - t))
                theirs_turns.round()
            meds: dict[str, dict[int, float]] = {}
            for dtype in dtypes:
                row = name if dtype == model.default_cache_dtype else name.replace(f"{model.default_cache_dtype} cache", f"{dtype} cache")
                rows_med = {b: statistics.median(r) for b, r in rates[dtype].items()}
                results[(f"kvcandle {row}", context)] = rows_med
                print(f"kvcandle {row}, {context}-token context: " + ", ".join(f"B={b} {rows_med[b]:.1f} tok/s ({rows_med[b] / rows_med[1]:.2f}x)" for b in BATCHES))
                meds[dtype] = rows_med
            theirs = theirs_turns.medians()
            if theirs:
                results[(f"llama.cpp {'Q4_1' if quantized else 'f32'}", context)] = theirs
                for dtype, med in meds.items():
                    print(f"llama.cpp {'Q4_1' if quantized else 'f32'}, {context}-token context: "
                          + ", ".join(f"B={b} {theirs[b]:.1f} tok/s (kvcandle, {dtype} cache, {med[b] / theirs[b]:.2f}x)" for b in BATCHES))
            if not quantized and context == 16:
                read_rates.append(memory_read_rate(args.threads))
                print_ceiling(model.weight_bytes, statistics.median(read_rates), meds[model.default_cache_dtype][1], theirs[1] if theirs else None)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for (name, context), med in results.items():
            ax.plot(BATCHES, [med[b] for b in BATCHES], marker="o", linestyle="-" if name.startswith("kvcandle") else "--", label=f"{name}, {context} ctx")
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
