"""Side-by-side speed of kvcandle, transformers and (when llama-cpp-python is installed)
llama.cpp on the default model, same machine, same run: prefill tok/s for a long prompt
and greedy decode tok/s with a KV cache.

    python bench/bench_generate.py [--decode 64] [--prompt-tokens 256] [--repeat 3]

kvcandle and transformers run the GGUF dequantized to float32; llama.cpp runs the same
file as stored (Q4_1 weights, quantized matmuls), so it is the same model at a lower
precision. Prints each engine's best-of-N figures and kvcandle's ratio to each.
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
        [f"prefill {args.prompt_tokens} tokens (tok/s)", args.prompt_tokens / kv_prefill, args.prompt_tokens / tf_prefill],
        [f"greedy decode, {args.decode} tokens (tok/s)", 1 / kv_dec, 1 / tf_dec],
    ]
    header = ["measure", "kvcandle f32", "transformers f32", "kvcandle / transformers"]
    llama = llama_cpp_timings(long_prompt, short, args)
    if llama is not None:
        rows[0].append(args.prompt_tokens / llama[0])
        rows[1].append(1 / llama[1])
        header += ["llama.cpp Q4_1", "kvcandle / llama.cpp"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for name, a, b, *c in rows:
        cells = [name, f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}x"] + ([f"{c[0]:.1f}", f"{a / c[0]:.2f}x"] if c else [])
        print("| " + " | ".join(cells) + " |")


def llama_cpp_timings(long_prompt: list[int], short: list[int], args: argparse.Namespace):
    """(prefill seconds, seconds per decode token) for llama.cpp, or None if absent."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama.cpp: llama-cpp-python is not installed; skipped")
        return None
    llm = Llama(model_path=str(kvcandle.default_model_path()), n_ctx=2048, n_threads=os.cpu_count(), n_batch=512, verbose=False)

    def prefill() -> None:
        llm.reset()
        llm.eval(long_prompt)

    def decode() -> None:
        llm.reset()
        llm.eval(short)
        for _ in range(args.decode - 1):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])

    def short_prefill() -> None:
        llm.reset()
        llm.eval(short)

    return best(prefill, args.repeat), (best(decode, args.repeat) - best(short_prefill, args.repeat)) / (args.decode - 1)


if __name__ == "__main__":
    main()
