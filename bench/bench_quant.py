"""The default model re-quantized by llama.cpp to the GGUF types people download, each
loaded with ``kvcandle.load(path, quantized=True)`` (its blocks kept as stored) and, when
llama-cpp-python is installed, by llama.cpp on the same file:

    python bench/bench_quant.py [--threads N] [--types Q8_0 Q4_K_M ...] [--tokens 20]

Per type: the file's size and the tensor types llama.cpp chose, the bytes of weights
kvcandle holds, decode and 512-token prefill speed of both engines (engines in turns,
medians of 3; llama.cpp's prefill context keeps only the last logits, as kvcandle), and
quality against float32: along reference sequences (the float32 model's greedy
continuations of four prompts), teacher-forced one token at a time as generation runs (both
engines then multiply quantized weights with int8 activations), the positions where the quantized model's top token equals
float32's, and the largest logit difference from float32.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llamacpp import requantize, write_f32_gguf  # noqa: E402

import kvcandle  # noqa: E402
from kvcandle._default import default_model_path  # noqa: E402
from kvcandle._platform import cpu_description  # noqa: E402

# llama.cpp's LLAMA_FTYPE_MOSTLY_* numbers
FTYPES = {"F16": 1, "BF16": 32, "Q8_0": 7, "Q6_K": 18, "Q5_K_M": 17, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q4_0": 2, "Q4_1": 3, "Q3_K_M": 12, "Q2_K": 10}
# each prompt's float32 greedy continuation is a reference sequence; agreement is summed
PROMPTS = [
    "The history of the printing press begins in",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village by the sea,",
]


def quantize(f32: Path, name: str, threads: int) -> Path:
    dst = Path(tempfile.gettempdir()) / f"kvcandle-bench-{name}.gguf"
    if not requantize(f32, dst, FTYPES[name], threads):
        raise RuntimeError(f"llama.cpp's quantizer failed to write {name}")
    return dst


def tensor_types(path: Path) -> str:
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return " ".join(f"{k}x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def kvcandle_logits(model: kvcandle.Model, ids: list[int]) -> np.ndarray:
    """Teacher-forced one token at a time: the path generation takes (single-token steps
    multiply the blocks with int8 activations; prompts longer than 8 tokens dequantize)."""
    cache = model.new_cache()
    return np.stack([np.asarray(model.forward([t], cache), dtype=np.float64) for t in ids])


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    """Teacher-forced one token at a time, as for kvcandle."""
    llm.reset()
    for t in ids:
        llm.eval([t])
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def agreement(logits: np.ndarray, ref: np.ndarray, start: int) -> tuple[int, int, float]:
    """(agreeing positions, positions, largest |logit - ref|) over positions start..."""
    a, r = logits[start:], ref[start:]
    return int((a.argmax(-1) == r.argmax(-1)).sum()), len(r), float(np.abs(a - r).max())


def decode_speed(step, first: int, steps: int = 16) -> float:
    t = time.perf_counter()
    tok = first
    for _ in range(steps):
        tok = step(tok)
    return steps / (time.perf_counter() - t)


PREFILL = 512


def prefill_speed(run, ids: list[int]) -> float:
    t = time.perf_counter()
    run(ids)
    return len(ids) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--types", nargs="*", default=["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K"])
    ap.add_argument("--tokens", type=int, default=60, help="length of the reference continuation")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    print(f"cpu: {cpu_description()}")
    print(f"threads: {args.threads}; kvcandle {kvcandle.__version__}\n")

    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    src = default_model_path()
    f32 = write_f32_gguf(src, args.threads) if llama_cpp else None
    if f32 is None:
        sys.exit("bench_quant needs llama-cpp-python (pip install llama-cpp-python) to re-quantize the model")

    base = kvcandle.load(f32)
    # (ids, float32 logits, the first position scored: the logits that predict the continuation)
    sequences = []
    for text in PROMPTS:
        prompt = base.tokenizer.encode(text)
        ids = prompt + kvcandle.generate(base, prompt, max_tokens=args.tokens).tokens[: args.tokens]
        sequences.append((ids, kvcandle_logits(base, ids), len(prompt) - 1))
    prompt = base.tokenizer.encode(PROMPTS[0])
    del base

    def quality(logits_of) -> tuple[int, int, float]:
        parts = [agreement(logits_of(ids), ref, start) for ids, ref, start in sequences]
        return sum(p[0] for p in parts), sum(p[1] for p in parts), max(p[2] for p in parts)

    rows = []
    for name in args.types:
        path = quantize(f32, name, args.threads)
        model = kvcandle.load(path, quantized=True)
        ours = quality(lambda ids: kvcandle_logits(model, ids))
        llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=args.threads, n_threads_batch=args.threads, logits_all=True, verbose=False)
        theirs = quality(lambda ids: llama_logits(llm, ids))

        def ours_step(tok, cache=model.new_cache()):
            return int(np.argmax(model.forward([tok], cache)))

        def theirs_step(tok):
            llm.eval([tok])
            return int(np.argmax(llm.scores[llm.n_tokens - 1]))

        batch = llama_cpp.Llama(str(path), n_ctx=PREFILL + 8, n_batch=PREFILL, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
        long_ids = [(prompt[i % len(prompt)] + 7 * i) % model.config.vocab_size for i in range(PREFILL)]

        def theirs_prefill(ids):
            batch.reset()
            batch.eval(ids)

        speeds: dict[str, list[float]] = {k: [] for k in ("kvcandle", "llama.cpp", "kvcandle prefill", "llama.cpp prefill")}
        for _ in range(args.rounds):
            speeds["kvcandle"].append(decode_speed(ours_step, prompt[0]))
            llm.reset()
            llm.eval(prompt[:1])
            speeds["llama.cpp"].append(decode_speed(theirs_step, prompt[0]))
            speeds["kvcandle prefill"].append(prefill_speed(lambda ids: model.forward(ids, model.new_cache()), long_ids))
            speeds["llama.cpp prefill"].append(prefill_speed(theirs_prefill, long_ids))
        rows.append((name, path.stat().st_size, tensor_types(path), model.weight_bytes, ours, theirs, {k: statistics.median(v) for k, v in speeds.items()}))
        del llm, batch, model

    scored = sum(len(ids) - start for ids, _, start in sequences)
    print(f"references: float32 greedy continuations of {len(PROMPTS)} prompts, {scored} positions scored\n")
    print(
        "| file | size MB | tensor types | kvcandle weights MB | top-1 vs f32: kvcandle | llama.cpp | max logit diff: kvcandle | llama.cpp "
        f"| decode tok/s: kvcandle | llama.cpp | prefill {PREFILL} tok/s: kvcandle | llama.cpp |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, size, types, held, ours, theirs, sp in rows:
        print(
            f"| {name} | {size / 1e6:.0f} | {types} | {held / 1e6:.0f} | {ours[0]}/{ours[1]} | {theirs[0]}/{theirs[1]} | "
            f"{ours[2]:.2f} | {theirs[2]:.2f} | {sp['kvcandle']:.1f} | {sp['llama.cpp']:.1f} | {sp['kvcandle prefill']:.0f} | {sp['llama.cpp prefill']:.0f} |"
        )


if __name__ == "__main__":
    main()
