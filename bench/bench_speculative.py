"""Speculative decoding against plain decoding, default model, greedy.

    python bench/bench_speculative.py [--threads N] [--rounds 3] [--tokens 160]

Decode tokens/s (the prefill excluded: ``stats.decode_tps``), medians over rounds with
plain and speculative runs in turns, and the share of guesses kept:

- float32 with its own ``quantized=True`` copy as the draft, on chat prompts;
- prompt lookup on an input-grounded task (repeat a 1,000-token text given in the
  prompt), float32 and ``quantized=True`` as the target;
- a poor drafter (random guesses), float32.

Greedy speculative output is identical to plain decoding: every run checks it. With
llama-cpp-python installed, llama.cpp's prompt lookup (``LlamaPromptLookupDecoding``, its
high-level API) runs beside it on the repeat task, on the float32 GGUF and the Q4_1 file:
decode tokens/s from the first streamed token to the last, in a process of its own per
figure. Printed with them: the CPU's SIMD features and the thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _machine import cpu_features  # bench/ is on the path when a script runs

CHAT = [
    "Write a short story about a llama who learns to code.",
    "Explain how a KV cache speeds up transformer decoding.",
    "List five facts about the planet Mars.",
]
PARAGRAPH = (
    "The village sat at the edge of a wide green valley, where the river bent twice before it reached the sea. "
    "Every morning the baker opened his shop before sunrise, and the smell of fresh bread drifted along the narrow streets. "
    "Children walked to the small stone school on the hill, carrying their books and their lunches in woven baskets. "
    "In the afternoon the farmers came back from the fields, tired but happy, and sat together in the square to talk about the weather. "
)

LLAMA_CPP = r"""
import sys, time, json, statistics
import llama_cpp
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

path, prompt, tokens, rounds, threads, lookup = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None
llm = llama_cpp.Llama(model_path=path, n_ctx=4096, n_threads=threads, n_threads_batch=threads, draft_model=draft, logits_all=lookup, verbose=False)
def rate():
    # streamed: the time from the first token to the last, over the tokens after the first
    llm.reset()
    times = []
    for chunk in llm.create_completion(prompt, max_tokens=tokens, temperature=0.0, stream=True):
        times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])
print(json.dumps(statistics.median(rate() for _ in range(rounds))))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=160)
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    import numpy as np

    import kvcandle

    print(f"CPU features: {cpu_features()}; {args.threads} thread(s)")
    f32, q4 = kvcandle.load(), kvcandle.load(quantized=True)
    tok = f32.tokenizer
    chat = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True) for c in CHAT]
    passage = tok.decode(tok.encode(PARAGRAPH * 12)[:1000])
    repeat = tok.apply_chat_template([{"role": "user", "content": "Repeat the following text exactly:\n\n" + passage}], add_generation_prompt=True)
    rng = np.random.default_rng(0)

    def compare(label: str, model, prompts: list[str], draft) -> None:
        plain_rates, spec_rates, kept, guessed = [], [], 0, 0
        for _ in range(args.rounds):
            for p in prompts:
                plain = kvcandle.generate(model, p, max_tokens=args.tokens)
                spec = kvcandle.generate(model, p, max_tokens=args.tokens, draft=draft)
                assert spec.tokens == plain.tokens, "greedy speculative output differs from plain decoding"
                plain_rates.append(plain.stats.decode_tps)
                spec_rates.append(spec.stats.decode_tps)
                kept, guessed = kept + spec.stats.accepted_tokens, guessed + spec.stats.drafted_tokens
        a, b = statistics.median(plain_rates), statistics.median(spec_rates)
        print(f"{label}: plain {a:.1f} tok/s, speculative {b:.1f} tok/s ({b / a:.2f}x), guesses kept {kept}/{guessed} ({kept / max(guessed, 1):.0%})")

    compare("float32, quantized copy as draft, chat", f32, chat, q4)
    compare("float32, prompt lookup, repeat 1,000 tokens", f32, [repeat], "prompt-lookup")
    compare("quantized=True, prompt lookup, repeat 1,000 tokens", q4, [repeat], "prompt-lookup")
    compare("float32, random guesses, chat", f32, chat, lambda tokens, k: rng.integers(0, 49152, k).tolist())

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama.cpp: skipped (pip install llama-cpp-python to compare)")
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from _llamacpp import write_f32_gguf

    for name, path in (("f32", write_f32_gguf(kvcandle.default_model_path(), args.threads)), ("Q4_1", kvcandle.default_model_path())):
        rates = {}
        for lookup in ("0", "1"):
            run = subprocess.run([sys.executable, "-c", LLAMA_CPP, str(path), repeat, str(args.tokens), str(args.rounds), str(args.threads), lookup],
                                 capture_output=True, text=True)  # fmt: skip
            if run.returncode != 0:
                print(f"llama.cpp {name} failed (exit {run.returncode}): {run.stderr.strip().splitlines()[-1:]}")
                break
            rates[lookup] = json.loads(run.stdout.strip().splitlines()[-1])
        if len(rates) == 2:
            print(f"llama.cpp {name}, prompt lookup, repeat 1,000 tokens: plain {rates['0']:.1f} tok/s, lookup {rates['1']:.1f} tok/s ({rates['1'] / rates['0']:.2f}x)")


if __name__ == "__main__":
    main()
