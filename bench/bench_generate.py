"""Side-by-side speed of kvcandle, transformers and (when llama-cpp-python is installed)
llama.cpp on the default model, same machine, same run: prefill tok/s for a long prompt
and greedy decode tok/s with a KV cache.

    python bench/bench_generate.py [--decode 64] [--prompt-tokens 256] [--repeat 3]

kvcandle f32 and transformers run the GGUF dequantized to float32; kvcandle with
quantized=True and llama.cpp run the file's Q4_1 blocks with int8 activations, the same
model at a lower precision. Prints each engine's best-of-N figures and kvcandle's ratios.
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
    kq = kvcandle.load(quantized=True)
    tf = parity.Transformers()
    torch = tf.torch
    print(f"machine: {os.cpu_count()} cores; torch threads {torch.get_num_threads()}; kvcandle {kvcandle.__version__} ({kv.dtype}, {kv.device})")
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(100, 40000, args.prompt_tokens).tolist()
    short = kv.tokenizer.encode(parity.PROMPT)

    def kvcandle_timings(model) -> tuple[float, float]:
        prefill = best(lambda: model.forward(long_prompt, model.new_cache()), args.repeat)
        short_prefill = best(lambda: model.forward(short, model.new_cache()), args.repeat)
        greedy = best(lambda: parity.kv_greedy(model, short, args.decode), args.repeat)
        return prefill, (greedy - short_prefill) / (args.decode - 1)

    engines = {"kvcandle f32": kvcandle_timings(kv), "kvcandle Q4_1 (quantized=True)": kvcandle_timings(kq)}
    tf_prefill = best(lambda: tf.logits(long_prompt, tf.new_cache()), args.repeat)
    tf_short = best(lambda: tf.logits(short, tf.new_cache()), args.repeat)
    tf_greedy = best(lambda: tf.greedy(short, args.decode), args.repeat)
    engines["transformers f32"] = (tf_prefill, (tf_greedy - tf_short) / (args.decode - 1))
    llama = llama_cpp_timings(long_prompt, short, args)
    if llama is not None:
        engines["llama.cpp Q4_1"] = llama

    measures = [f"prefill {args.prompt_tokens} tokens (tok/s)", f"greedy decode, {args.decode} tokens (tok/s)"]
    speed = {name: (args.prompt_tokens / t[0], 1 / t[1]) for name, t in engines.items()}
    print("| engine | " + " | ".join(measures) + " |")
    print("|---|" + "---|" * len(measures))
    for name, (p, d) in speed.items():
        print(f"| {name} | {p:.1f} | {d:.1f} |")
    print()
    for ours in ("kvcandle f32", "kvcandle Q4_1 (quantized=True)"):
        for other in [n for n in speed if not n.startswith("kvcandle")]:
            p, d = (speed[ours][i] / speed[other][i] for i in range(2))
            print(f"{ours} / {other}: prefill {p:.2f}x, decode {d:.2f}x")


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
