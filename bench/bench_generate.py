"""Side-by-side speed of kvcandle and the engines a user would compare it with, on the
default model, on this machine, in one run.

    python bench/bench_generate.py [--threads N] [--rounds 5] [--quick] [--plot decode.png]

Engines (each skipped, with the reason printed, when its package is missing):
  kvcandle f32            the GGUF dequantized to float32, kvcandle's own engine
  kvcandle Q4_1           kvcandle.load(quantized=True): the file's blocks, int8 activations,
                          with a float32 cache (new_cache(dtype="float32"))
  ..., f16 cache          the same with model.new_cache(dtype="float16"): keys and values
                          stored as float16 (llama.cpp's default), half the bytes per step
  ..., q8_0 cache         model.new_cache(dtype="q8_0"): keys and values in blocks of 32
                          int8 values and a float16 scale, 0.27 of float32's bytes
                          (quantized=True's default cache)
  candle upstream         candle-transformers' Llama + Cache as shipped (float32)
  transformers            eager float32 (torch), a plain loop over past_key_values
  llama.cpp f32 / Q4_1    llama-cpp-python; the f32 GGUF is written by this script from the
                          Q4_1 file with llama.cpp's own quantizer (type ALL_F32)

llama-cpp-python compiles llama.cpp when installed (about 5 minutes). On a CPU with AMX its
native build crashed decoding Q4_1 here; build it for AVX-512 without AMX instead:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=OFF
    -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install llama-cpp-python

Engines take turns (A B C A B C ...) inside every measurement and the figures are
medians over the rounds. Printed with them: the CPU's SIMD features, the thread count
every engine uses, and the memory read rate measured in the same run (before and after),
from which the float32 decode ceiling (bytes of weights per token / read rate) follows.

Figures: load time; prefill of 512 and 2,048 tokens; time to first token for a 512-token
prompt; greedy decode at 5, 512, 2,048 and 4,096 tokens of context; the lecture's
experiment (64 and 256 new tokens with and without the cache; ``--quick`` skips it and
the 4,096 context). ``--plot`` writes decode step time against context (matplotlib).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    ap.add_argument("--quick", action="store_true", help="skip the 4,096 context and the no-cache experiment")
    ap.add_argument("--no-lecture", action="store_true", help="skip the no-cache experiment only")
    ap.add_argument("--plot", default=None, help="write a PNG of decode step time against context")
    ap.add_argument("--engines", nargs="*", default=None, help="only these engines (names as printed)")
    ap.add_argument("--simd", default=None, help="force kvcandle's kernels to this SIMD level (KVCANDLE_SIMD: avx512, avx2, portable)")
    return ap.parse_args()


ARGS = parse()
# every engine gets the same thread count; kvcandle reads it when first used
os.environ["RAYON_NUM_THREADS"] = str(ARGS.threads)
if ARGS.simd is not None:
    os.environ["KVCANDLE_SIMD"] = ARGS.simd

import numpy as np  # noqa: E402

import kvcandle  # noqa: E402
from kvcandle._platform import cpu_description  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llamacpp import write_f32_gguf  # noqa: E402
from _machine import memory_read_rate  # noqa: E402


class Engine:
    """One engine's cache-holding session. `start(ids)` resets and runs a prompt;
    `step(token)` runs one token and returns the greedy next token; `mark()` remembers the
    current length and `rewind()` returns to it; `uncached_step(ids)` runs the whole
    sequence without a cache and returns the greedy next token."""

    name = ""
    max_context = 8192

    def start(self, ids: list[int]) -> int:
        raise NotImplementedError

    def step(self, token: int) -> int:
        raise NotImplementedError

    def mark(self) -> None:
        raise NotImplementedError

    def rewind(self) -> None:
        raise NotImplementedError

    def uncached_step(self, ids: list[int]) -> int:
        raise NotImplementedError


class Kvcandle(Engine):
    def __init__(self, quantized: bool, cache_dtype: Optional[str] = None) -> None:
        short = {"float16": "f16", "q8_0": "q8_0"}.get(cache_dtype or "")
        self.name = ("kvcandle Q4_1" if quantized else "kvcandle f32") + (f", {short} cache" if short else "")
        self.model = kvcandle.load(quantized=quantized)
        self.cache_dtype = cache_dtype
        self.cache = self.model.new_cache(dtype=cache_dtype)
        self.length = 0

    def start(self, ids: list[int]) -> int:
        self.cache.reset()
        return int(self.model.forward(ids, self.cache).argmax())

    def step(self, token: int) -> int:
        return int(self.model.forward([token], self.cache).argmax())

    def mark(self) -> None:
        self.length = len(self.cache)

    def rewind(self) -> None:
        self.cache.crop(self.length)

    def uncached_step(self, ids: list[int]) -> int:
        return int(self.model.forward(ids, self.model.new_cache(dtype=self.cache_dtype)).argmax())


class Upstream(Engine):
    name = "candle upstream"

    def __init__(self) -> None:
        self.model = kvcandle.load().upstream()
        self.cache = self.model.new_cache()
        self.pos = 0
        self.saved: Any = None

    def start(self, ids: list[int]) -> int:
        self.cache, self.pos = self.model.new_cache(), 0
        return self.step_many(ids)

    def step_many(self, ids: list[int]) -> int:
        logits = self.model.forward(ids, self.pos, self.cache)
        self.pos += len(ids)
        return int(np.asarray(logits).reshape(-1, logits.shape[-1])[-1].argmax())

    def step(self, token: int) -> int:
        return self.step_many([token])

    def mark(self) -> None:
        self.saved = (self.cache.clone(), self.pos)

    def rewind(self) -> None:
        cache, self.pos = self.saved
        self.cache = cache.clone()

    def uncached_step(self, ids: list[int]) -> int:
        logits = self.model.forward(ids, 0, self.model.new_cache(use_kv_cache=False))
        return int(np.asarray(logits).reshape(-1, logits.shape[-1])[-1].argmax())


class Transformers(Engine):
    name = "transformers"

    def __init__(self, threads: int) -> None:
        from kvcandle import parity

        self.tf = parity.Transformers()
        self.torch = self.tf.torch
        self.torch.set_num_threads(threads)
        self.model = self.tf.model
        self.past: Any = None
        self.length = 0

    def _run(self, ids: list[int], cache: Any, use_cache: bool = True) -> int:
        kw = {self.tf._cache_kw: cache, "use_cache": True} if use_cache else {"use_cache": False}
        with self.torch.inference_mode():
            out = self.model(input_ids=self.torch.tensor([ids]), **kw)
        self.past = cache  # a DynamicCache, extended in place
        return int(out.logits[0, -1].argmax())

    def start(self, ids: list[int]) -> int:
        return self._run(ids, self.tf.new_cache())

    def step(self, token: int) -> int:
        return self._run([token], self.past)

    def mark(self) -> None:
        self.length = self.past.get_seq_length()

    def rewind(self) -> None:
        extra = self.past.get_seq_length() - self.length
        if extra > 0:
            self.past.crop(-extra)  # transformers 5: a negative count drops that many

    def uncached_step(self, ids: list[int]) -> int:
        return self._run(ids, None, use_cache=False)


class LlamaCpp(Engine):
    def __init__(self, path: Path, label: str, threads: int) -> None:
        from llama_cpp import Llama

        self.name = f"llama.cpp {label}"
        self.max_context = 4200
        self.llm = Llama(model_path=str(path), n_ctx=self.max_context, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, logits_all=False, verbose=False)
        self.length = 0

    def _eval(self, ids: list[int]) -> int:
        self.llm.eval(ids)
        # only the last position has logits (logits_all=False); read them in place
        return int(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),)).argmax())

    def start(self, ids: list[int]) -> int:
        self.llm.reset()
        return self._eval(ids)

    def step(self, token: int) -> int:
        return self._eval([token])

    def mark(self) -> None:
        self.length = self.llm.n_tokens

    def rewind(self) -> None:
        self.llm.n_tokens = self.length  # eval() drops the KV cells past n_tokens

    def uncached_step(self, ids: list[int]) -> int:
        self.llm.reset()
        return self._eval(ids)


def timed(name: str, make: Callable[[], Engine]) -> tuple[Optional[Engine], float]:
    t = time.perf_counter()
    try:
        e = make()
    except ImportError as exc:
        print(f"{name}: skipped ({exc})")
        return None, 0.0
    return e, time.perf_counter() - t


def settle() -> None:
    """Before each timed turn: the previous engine's threads (OpenMP, kvcandle's team)
    spin for a while after their last job; let them go idle so they do not take this
    turn's cores."""
    gc.collect()
    time.sleep(0.05)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    args = ARGS
    threads = args.threads
    print(f"cpu: {cpu_description()}")
    print(f"threads: {threads} for every engine ({os.cpu_count()} CPUs); kvcandle {kvcandle.__version__}")
    print(f"kvcandle's kernels: {kvcandle.simd_level()} (this CPU runs {', '.join(kvcandle.simd_levels())}), prefetch {kvcandle.prefetch_level()}, one-input rows {kvcandle.one_input_rows()}")
    try:
        import llama_cpp

        print(f"llama.cpp {llama_cpp.__version__} built for: {llama_cpp.llama_print_system_info().decode().strip()}")
    except ImportError:
        pass
    rate_before = memory_read_rate(threads)
    print(f"memory read rate: {rate_before:.1f} GB/s ({threads} threads)")

    src = kvcandle.default_model_path()
    makers: list[tuple[str, Callable[[], Engine]]] = [
        ("kvcandle f32", lambda: Kvcandle(False)),
        ("kvcandle Q4_1", lambda: Kvcandle(True, "float32")),
        ("kvcandle f32, f16 cache", lambda: Kvcandle(False, "float16")),
        ("kvcandle Q4_1, f16 cache", lambda: Kvcandle(True, "float16")),
        ("kvcandle f32, q8_0 cache", lambda: Kvcandle(False, "q8_0")),
        ("kvcandle Q4_1, q8_0 cache", lambda: Kvcandle(True, "q8_0")),
        ("candle upstream", Upstream),
        ("transformers", lambda: Transformers(threads)),
    ]
    try:
        import llama_cpp  # noqa: F401

        f32 = write_f32_gguf(src, threads)
        if f32 is not None:
            makers.append(("llama.cpp f32", lambda: LlamaCpp(f32, "f32", threads)))
        makers.append(("llama.cpp Q4_1", lambda: LlamaCpp(src, "Q4_1", threads)))
    except ImportError:
        print("llama.cpp: skipped (pip install llama-cpp-python to compare)")
    engines: list[Engine] = []
    load: dict[str, float] = {}
    for name, make in makers:
        if args.engines and name not in args.engines:
            continue
        e, seconds = timed(name, make)
        if e is not None:
            engines.append(e)
            load[e.name] = seconds
    names = [e.name for e in engines]
    rng = np.random.default_rng(0)
    ids_for = {n: rng.integers(100, 40000, n).tolist() for n in (512, 2048, 4096)}
    reference = kvcandle.load()  # for the tokenizer and the parameter count
    ids_for[5] = reference.tokenizer.encode("The capital of France is")[:5]

    # prefill and time to first token: engines in turns
    prefill: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for n in (512, 2048):
            for e in engines:
                settle()
                t = time.perf_counter()
                e.start(ids_for[n])
                prefill.setdefault((e.name, n), []).append(time.perf_counter() - t)

    # decode at each context: every engine prefilled to it (untimed), then rounds of
    # `steps` tokens per engine in turn, each rewound to the context afterwards
    contexts = [5, 512, 2048] + ([] if args.quick else [4096])
    decode: dict[tuple[str, int], list[float]] = {}
    for n in contexts:
        live = [e for e in engines if n + args.steps <= e.max_context]
        first = {}
        for e in live:
            first[e.name] = e.start(ids_for[n])  # untimed
            e.mark()
        for _ in range(args.rounds):
            for e in live:
                token = first[e.name]
                settle()
                t = time.perf_counter()
                for _ in range(args.steps):
                    token = e.step(token)
                decode.setdefault((e.name, n), []).append((time.perf_counter() - t) / args.steps)
                e.rewind()

    rate_after = memory_read_rate(threads)
    rate = statistics.median([rate_before, rate_after])
    f32_bytes = reference.num_parameters * 4

    print(f"\nmemory read rate after: {rate_after:.1f} GB/s; float32 decode ceiling {rate * 1e9 / f32_bytes:.1f} tok/s "
          f"({f32_bytes / 1e6:.0f} MB of weights per token)\n")
    head = ["engine", "load s", "prefill 512 tok/s", "prefill 2048 tok/s", "TTFT 512 ms"] + [f"decode @{n} tok/s" for n in contexts]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    table: dict[str, list[float]] = {}
    for name in names:
        row = [load[name], 512 / med(prefill[(name, 512)]), 2048 / med(prefill[(name, 2048)]), 1000 * med(prefill[(name, 512)])]
        row += [1 / med(decode[(name, n)]) if (name, n) in decode else float("nan") for n in contexts]
        table[name] = row
        print(f"| {name} | " + " | ".join(f"{v:.2f}" if i == 0 else f"{v:.1f}" for i, v in enumerate(row)) + " |")

    print(f"\nmedians of {args.rounds} rounds, engines in turns, {args.steps} decode steps per round")
    for ours in [n for n in names if n.startswith("kvcandle") and n in table]:
        print(f"\n{ours}:")
        d5 = table[ours][4]
        print("  decode vs its own 5-token context: " + ", ".join(f"@{n} {table[ours][4 + i] / d5:.2f}" for i, n in enumerate(contexts)))
        engine = next(e for e in engines if e.name == ours)
        step_bytes = engine.model.weight_bytes if isinstance(engine, Kvcandle) else f32_bytes
        print(f"  decode @5 is {d5 * step_bytes / (rate * 1e9):.0%} of its memory-read ceiling ({step_bytes / 1e6:.0f} MB of weights per token)")
        for other in names:
            if other.startswith("kvcandle"):
                continue
            r = [table[ours][i] / table[other][i] for i in (1, 2)]
            at = ", ".join(f"@{n} {table[ours][4 + i] / table[other][4 + i]:.2f}x" for i, n in enumerate(contexts))
            print(f"  vs {other}: prefill 512 {r[0]:.2f}x, prefill 2048 {r[1]:.2f}x, decode {at}")

    if not (args.quick or args.no_lecture):
        lecture(engines, ids_for[5], args)
    if args.plot:
        plot(args.plot, names, contexts, decode, threads)


def lecture(engines: list[Engine], prompt: list[int], args: argparse.Namespace) -> None:
    """The lecture's experiment: greedy generation of 64 and 256 tokens with the cache
    and without it (every step runs the whole sequence again). One round each (the
    uncached runs are long); both orders of engines are not needed for a 1.3x-100x gap."""
    print("\nlecture experiment (seconds; one run each):")
    print("| engine | 64 with cache | 64 without | 256 with cache | 256 without |")
    print("|---|---|---|---|---|")
    for e in engines:
        row = []
        for n in (64, 256):
            t = time.perf_counter()
            token = e.start(prompt)
            for _ in range(n - 1):
                token = e.step(token)
            row.append(time.perf_counter() - t)
            seq = list(prompt)
            t = time.perf_counter()
            for _ in range(n):
                seq.append(e.uncached_step(seq))
            row.append(time.perf_counter() - t)
        print(f"| {e.name} | " + " | ".join(f"{v:.2f}" for v in row) + " |")


def plot(path: str, names: list[str], contexts: list[int], decode: dict[tuple[str, int], list[float]], threads: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: skipped (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        xs = [n for n in contexts if (name, n) in decode]
        ax.plot(xs, [1000 * med(decode[(name, n)]) for n in xs], marker="o", label=name)
    ax.set_xlabel("tokens of context")
    ax.set_ylabel("decode step (ms, median)")
    ax.set_title(f"Decode step time against context ({threads} threads)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path + ".partial.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    print(f"plot written to {path}")


if __name__ == "__main__":
    sys.exit(main())
