"""Parity with Hugging Face transformers: the reference document's experiments, run on
the default model (SmolLM2-135M-Instruct GGUF) against transformers' LlamaForCausalLM
(eager attention, float32) loaded from the same file, in the same process.

    python -m kvcandle.parity        # prints the table (needs torch, transformers, gguf, accelerate)

The test suite (tests/test_parity.py) calls the same functions and asserts on them.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from .model import Model, load

PROMPT = "The capital of France is"
GREEDY_PROMPTS = [
    PROMPT,
    "The capital of Germany is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time",
]
TOKENIZER_CORPUS = [
    "The capital of France is",
    "Hello, world! How are you doing today?",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(3))",
    "北京是中国的首都。我爱自然语言处理。",
    "emoji: 😀🎉👍🏽 and flags 🇫🇷🇩🇪",
    "many    spaces   and\t\ttabs\n\n\n\nnewlines\r\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|> numbers 1234567890 3.14159 1e-5",
    "  leading spaces, trailing spaces  ",
    "Ünïcödé àccénts, ß, Ωmega, русский текст",
    "",
]


@dataclass
class Row:
    """One line of the parity table: kvcandle (or transformers) against a reference."""

    experiment: str
    steps: int
    max_all: float
    max_first: float
    max_last: float
    top1: int
    max_ref: float

    def line(self) -> str:
        return (
            f"| {self.experiment} | {self.steps} | {self.max_all:.3e} | {self.max_first:.3e} | "
            f"{self.max_last:.3e} | {self.top1}/{self.steps} | {self.max_ref:.2f} |"
        )


def compare(name: str, rows: np.ndarray, ref: np.ndarray) -> Row:
    rows, ref = np.asarray(rows, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert rows.shape == ref.shape, (rows.shape, ref.shape)
    diff = np.abs(rows - ref).max(axis=-1)
    return Row(
        name,
        len(rows),
        float(diff.max()),
        float(diff[0]),
        float(diff[-1]),
        int((rows.argmax(-1) == ref.argmax(-1)).sum()),
        float(np.abs(ref).max()),
    )


class Transformers:
    """transformers' LlamaForCausalLM and tokenizer on the default GGUF file."""

    def __init__(self, path: Optional[str] = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

        from ._default import default_model_path

        p = default_model_path() if path is None else __import__("pathlib").Path(path)
        # transformers' own cache-vs-no-cache noise (the bar of experiment 2) depends on
        # torch's thread count: pin it to every core, as the reference document ran it.
        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        self.DynamicCache = DynamicCache
        self.model = AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def new_cache(self) -> Any:
        return self.DynamicCache(config=self.model.config)

    def logits(self, ids: Sequence[int], cache: Any = None) -> np.ndarray:
        """All positions' logits of ``ids`` (appended to ``cache`` if given)."""
        kw = {self._cache_kw: cache, "use_cache": True} if cache is not None else {"use_cache": False}
        with self.torch.inference_mode():
            return self.model(self.torch.tensor([list(ids)]), **kw).logits[0].float().numpy()

    def greedy(self, ids: Sequence[int], n: int = 20, cache: Any = None) -> list[int]:
        cache = self.new_cache() if cache is None else cache
        out = [int(self.logits(ids, cache)[-1].argmax())]
        for _ in range(n - 1):
            out.append(int(self.logits([out[-1]], cache)[-1].argmax()))
        return out


def kv_greedy(model: Model, ids: Sequence[int], n: int = 20, cache: Any = None) -> list[int]:
    cache = model.new_cache() if cache is None else cache
    out = [int(model.forward(ids, cache).argmax())]
    for _ in range(n - 1):
        out.append(int(model.forward([out[-1]], cache).argmax()))
    return out


def reference_sequence(kv: Model, tf: Transformers) -> list[int]:
    """The prompt plus transformers' first 19 greedy tokens: 24 ids."""
    assert kv.tokenizer is not None
    ids = kv.tokenizer.encode(PROMPT)
    return ids + tf.greedy(ids, 19)


def cache_object(kv: Model, tf: Transformers) -> dict[str, Any]:
    """Experiment 1: both caches after 20 greedy tokens."""
    assert kv.tokenizer is not None
    ids = kv.tokenizer.encode(PROMPT)
    ours, theirs = kv.new_cache(), tf.new_cache()
    a, b = kv_greedy(kv, ids, 20, ours), tf.greedy(ids, 20, theirs)
    key_diff = max(float(np.abs(l.keys - t.keys.numpy()).max()) for l, t in zip(ours.layers, theirs.layers))
    value_diff = max(float(np.abs(l.values - t.values.numpy()).max()) for l, t in zip(ours.layers, theirs.layers))
    return {
        "kvcandle": {"len": len(ours), "layers": len(ours.layers), "keys": ours.layers[0].keys.shape, "dtype": str(ours.layers[0].keys.dtype)},
        "transformers": {
            "len": theirs.get_seq_length(),
            "layers": len(theirs.layers),
            "keys": tuple(theirs.layers[0].keys.shape),
            "dtype": str(theirs.layers[0].keys.dtype).replace("torch.", ""),
        },
        "same_tokens": a == b,
        "max_key_diff": key_diff,
        "max_value_diff": value_diff,
    }


def teacher_forcing(kv: Model, tf: Transformers, seq: Sequence[int]) -> list[Row]:
    """Experiment 2: logits at each of the 20 steps along the reference sequence, every
    step fed the reference token; all compared with transformers without cache."""
    prefill = 5
    ref = tf.logits(seq)[prefill - 1 :]

    tf_cache = tf.new_cache()
    tf_rows = [tf.logits(seq[:prefill], tf_cache)[-1]] + [tf.logits([t], tf_cache)[-1] for t in seq[prefill:]]

    cache = kv.new_cache()
    kv_rows = [kv.forward(seq[:prefill], cache)] + [kv.forward([t], cache) for t in seq[prefill:]]
    kv_nocache = kv.forward(seq, all_logits=True)[prefill - 1 :]
    kv_fresh = [kv.forward(seq[:end]) for end in range(prefill, len(seq) + 1)]

    up = kv.upstream()
    ucache = up.new_cache(True)
    up_rows = [up.forward(seq[:prefill], 0, ucache)] + [up.forward([t], p, ucache) for p, t in enumerate(seq[prefill:], prefill)]

    return [
        compare("transformers cache vs transformers no cache", np.stack(tf_rows), ref),
        compare("kvcandle cache vs transformers no cache", np.stack(kv_rows), ref),
        compare("kvcandle no cache (one pass) vs transformers no cache", kv_nocache, ref),
        compare("kvcandle no cache (fresh prefix each step) vs transformers no cache", np.stack(kv_fresh), ref),
        compare("candle upstream cache vs transformers no cache", np.stack(up_rows), ref),
        compare("kvcandle cache vs candle upstream cache", np.stack(kv_rows), np.stack(up_rows)),
    ]


def run_chunks(kv: Model, tf: Transformers, seq: Sequence[int], chunks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Feeds ``seq`` in ``chunks`` (then one token at a time) to both; all positions' logits."""
    assert sum(chunks) <= len(seq)
    sizes = list(chunks) + [1] * (len(seq) - sum(chunks))
    cache, tf_cache = kv.new_cache(), tf.new_cache()
    ours, theirs, start = [], [], 0
    for n in sizes:
        ours.append(kv.forward(seq[start : start + n], cache, all_logits=True))
        theirs.append(tf.logits(seq[start : start + n], tf_cache))
        start += n
    return np.concatenate(ours), np.concatenate(theirs)


def chunked_prefill(kv: Model, tf: Transformers, seq: Sequence[int]) -> list[Row]:
    """Experiment 3: 3 + 2 tokens then decode vs 5 at once; uneven chunkings of the
    24-token sequence judged against transformers fed the same chunks."""
    ours_32, theirs_32 = run_chunks(kv, tf, seq, [3, 2])
    ours_5, theirs_5 = run_chunks(kv, tf, seq, [5])
    rows = [
        compare("kvcandle chunked 3+2 vs 5 at once", ours_32[4:], ours_5[4:]),
        compare("transformers chunked 3+2 vs 5 at once", theirs_32[4:], theirs_5[4:]),
    ]
    for chunks in ([7, 1, 9, 3, 4], [2, 11, 5], [1, 23], [13, 6, 5]):
        ours, theirs = run_chunks(kv, tf, seq, chunks)
        name = "+".join(map(str, chunks))
        rows.append(compare(f"kvcandle vs transformers, chunks {name}", ours, theirs))
    return rows


def greedy_generation(kv: Model, tf: Transformers, prompts: Sequence[str] = GREEDY_PROMPTS) -> list[dict[str, Any]]:
    """Experiment 4: 20 greedy tokens from each prompt, kvcandle vs transformers."""
    assert kv.tokenizer is not None
    out = []
    for prompt in prompts:
        ids = kv.tokenizer.encode(prompt)
        a, b = kv_greedy(kv, ids), tf.greedy(ids)
        out.append({"prompt": prompt, "kvcandle": a, "transformers": b, "equal": a == b, "text": kv.tokenizer.decode(a)})
    return out


def fork_branches(kv: Model) -> list[dict[str, Any]]:
    """Experiment 5: "The capital of" prefilled once and forked; each branch continued
    and compared with a fresh run of its whole prompt."""
    assert kv.tokenizer is not None
    stem = kv.tokenizer.encode("The capital of")
    base = kv.new_cache()
    kv.forward(stem, base)
    out = []
    for cache, country in ((base.fork(), "France"), (base.fork(), "Germany")):
        full = kv.tokenizer.encode(f"The capital of {country} is")
        assert full[: len(stem)] == stem
        logits = [kv.forward(full[len(stem) :], cache)]
        fresh_cache = kv.new_cache()
        fresh_logits = [kv.forward(full, fresh_cache)]
        tokens, fresh = [int(logits[0].argmax())], [int(fresh_logits[0].argmax())]
        for _ in range(19):
            logits.append(kv.forward([tokens[-1]], cache))
            fresh_logits.append(kv.forward([fresh[-1]], fresh_cache))
            tokens.append(int(logits[-1].argmax()))
            fresh.append(int(fresh_logits[-1].argmax()))
        out.append(
            {
                "branch": country,
                "equal": tokens == fresh,
                "max_diff": float(np.abs(np.stack(logits) - np.stack(fresh_logits)).max()),
                "text": kv.tokenizer.decode(tokens),
                "cache_tokens_ok": cache.tokens == full + tokens[:-1],
            }
        )
    return out


def misuse(kv: Model, tf: Transformers) -> dict[str, Any]:
    """Experiment 6: the reference document's misuses, in candle (upstream), transformers
    and kvcandle."""
    from .errors import CacheError, EngineError, PositionError

    assert kv.tokenizer is not None
    first, second = kv.tokenizer.encode(PROMPT), kv.tokenizer.encode("The capital of Germany is")
    up = kv.upstream()
    out: dict[str, Any] = {}

    # index_pos 0 at every decode step (upstream only: kvcandle has no position argument)
    def up_greedy(ids: list[int], fixed: Optional[int]) -> list[int]:
        cache = up.new_cache(True)
        toks = [int(up.forward(ids, 0, cache).argmax())]
        for pos in range(len(ids), len(ids) + 19):
            toks.append(int(up.forward([toks[-1]], pos if fixed is None else fixed, cache).argmax()))
        return toks

    right, wrong = up_greedy(first, None), up_greedy(first, 0)
    out["index_pos_0"] = {"upstream_right": kv.tokenizer.decode(right), "upstream_pos0": kv.tokenizer.decode(wrong), "differs": right != wrong}

    # a used cache given a new prompt
    tf_cache = tf.new_cache()
    tf.greedy(first, 20, tf_cache)
    tf_reuse = tf.greedy(second, 20, tf_cache)
    tf_fresh = tf.greedy(second, 20)
    ucache = up.new_cache(True)
    up_greedy_cache = [int(up.forward(first, 0, ucache).argmax())]
    for pos in range(5, 24):
        up_greedy_cache.append(int(up.forward([up_greedy_cache[-1]], pos, ucache).argmax()))
    try:
        up.forward(second, 0, ucache)
        up_multi = "no error"
    except EngineError as e:
        up_multi = str(e)
    mixed = up.forward([504], 0, ucache)
    clean = up.forward([504], 0, up.new_cache(True))
    cache = kv.new_cache()
    kv_greedy(kv, first, 20, cache)
    before = cache.tokens
    try:
        kv.prefill(second, cache)
        kv_result = "no error"
    except CacheError as e:
        kv_result = str(e)
    unchanged = cache.tokens == before
    cache.crop(3)  # keep "The capital of", the part both prompts share
    kv_after_crop = [int(kv.prefill(second, cache).argmax())]
    for _ in range(19):
        kv_after_crop.append(int(kv.forward([kv_after_crop[-1]], cache).argmax()))
    out["reuse"] = {
        "transformers_len": tf_cache.get_seq_length(),
        "transformers_reuse_equals_fresh": tf_reuse == tf_fresh,
        "transformers_reuse": kv.tokenizer.decode(tf_reuse),
        "transformers_fresh": kv.tokenizer.decode(tf_fresh),
        "upstream_multi_token": up_multi,
        "upstream_one_token_max_diff_vs_fresh": float(np.abs(mixed - clean).max()),
        "kvcandle_prefill": kv_result,
        "kvcandle_cache_unchanged": unchanged,
        "kvcandle_after_crop_equals_fresh": kv_after_crop == tf_fresh,
    }

    # position 8192
    try:
        up.forward([504], 8192, up.new_cache(True))
        up_far = "no error"
    except EngineError as e:
        up_far = str(e)
    with tf.torch.inference_mode():
        far = tf.model(tf.torch.tensor([[504]]), position_ids=tf.torch.tensor([[8192]]), use_cache=False).logits
    cache = kv.new_cache()
    kv.forward(first, cache)
    try:
        kv.forward([504] * (8193 - len(cache)), cache)
        kv_far = "no error"
    except PositionError as e:
        kv_far = str(e)
    out["position_8192"] = {
        "upstream": up_far,
        "transformers_finite": bool(tf.torch.isfinite(far).all()),
        "transformers_shape": tuple(far.shape),
        "kvcandle": kv_far,
        "kvcandle_len_after": len(cache),
    }
    return out


def tokenizer_parity(kv: Model, tf: Transformers, corpus: Sequence[str] = TOKENIZER_CORPUS) -> list[dict[str, Any]]:
    """Experiment 7: encode and decode against transformers' GGUF tokenizer."""
    assert kv.tokenizer is not None
    out = []
    for text in corpus:
        ours = kv.tokenizer.encode(text)
        theirs = tf.tokenizer.encode(text)
        out.append(
            {
                "text": text,
                "encode_equal": ours == theirs,
                "decode_equal": kv.tokenizer.decode(ours) == tf.tokenizer.decode(theirs),
                "roundtrip": kv.tokenizer.decode(ours) == text,
                "ours": ours,
                "theirs": theirs,
            }
        )
    return out


def main() -> None:
    kv = load()
    tf = Transformers()
    seq = reference_sequence(kv, tf)
    print("## 1. The cache object after 20 greedy tokens")
    for k, v in cache_object(kv, tf).items():
        print(f"- {k}: {v}")
    print("\n## 2-3. Logits: teacher forcing along the 24-token reference sequence, chunked prefill\n")
    print("| experiment | steps | max abs diff (all) | first | last | top-1 | max abs ref |")
    print("|---|---|---|---|---|---|---|")
    for row in teacher_forcing(kv, tf, seq) + chunked_prefill(kv, tf, seq):
        print(row.line())
    print("\n## 4. Greedy generation, 20 tokens, kvcandle vs transformers")
    for g in greedy_generation(kv, tf):
        print(f"- {'equal' if g['equal'] else 'DIFFERENT'}: {g['prompt']!r} -> {g['text']!r}")
    print("\n## 5. Fork: 'The capital of' prefilled once, two branches")
    for f in fork_branches(kv):
        print(f"- {f['branch']}: equal to fresh run {f['equal']}, max|diff| {f['max_diff']:.3e}: {f['text']!r}")
    print("\n## 6. Misuse")
    for k, v in misuse(kv, tf).items():
        print(f"- {k}:")
        for kk, vv in v.items():
            print(f"  - {kk}: {vv!r}")
    print("\n## 7. Tokenizer")
    toks = tokenizer_parity(kv, tf)
    print(f"- encode equal {sum(t['encode_equal'] for t in toks)}/{len(toks)}, decode equal {sum(t['decode_equal'] for t in toks)}/{len(toks)}")


if __name__ == "__main__":
    main()
