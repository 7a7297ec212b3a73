"""Parity with Hugging Face transformers, measured against a float64 reference: the
reference document's experiments, run on the default model (SmolLM2-135M-Instruct GGUF)
against transformers' LlamaForCausalLM (eager attention) loaded from the same file, in
the same process.

Float32 results differ between engines by rounding noise that moves with the CPU, the
thread count and the kernels chosen, so two float32 results are never compared with each
other here. transformers is loaded in float64 from the same weights; that model is the
reference, and every float32 path (kvcandle with and without its cache, chunked;
transformers with and without its cache; candle's own Llama) is measured as its distance
from it, with one bound for all of them (:data:`TOLERANCE`).

    python -m kvcandle.parity        # prints the tables (needs torch, transformers, gguf, accelerate)

The test suite (tests/test_parity.py) calls the same functions and asserts on them.
"""

from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .model import Model, load

PROMPT = "The capital of France is"
# The sequences measured: each prompt plus the float64 reference's 19 greedy tokens (24 ids).
# Germany's has one position (17) where a one-pass float32 prefill is unusually sensitive.
SEQUENCE_PROMPTS = [PROMPT, "The capital of Germany is"]
GREEDY_PROMPTS = [
    PROMPT,
    "The capital of Germany is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time",
]
#: prompts outside the sequences above, each longer than SMALL_CHUNK tokens, so that a
#: one-pass prefill takes the matrix-product path (the ``chat`` one is rendered with the
#: model's template)
PREFILL_PROMPTS = {
    "plain text": "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable metal type with an oil-based ink and a wooden press. " * 3,
    "code": "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n        self.items.append(x)\n" * 2,
    "Chinese": "从前有一座山，山里有一座庙，庙里有一个老和尚在给小和尚讲故事。他讲的是什么故事呢？" * 3,
    "a story": "Once upon a time, a small llama named Pico lived at the edge of a quiet mountain village. Every morning she climbed the hill to watch the sun rise over the lake, " * 2,
    "chat": "",
    "whitespace runs": "word    word\n\n\n\t\tindent    more     spaces\n" * 8,
}
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

# The bound every float32 path must keep to: max |logit - float64 logit| at every position.
# Measured on this project's machines (2 vCPUs, 1 and 2 threads): kvcandle's worst 2.7e-4
# (a one-pass prefill, Germany sequence, position 17), transformers' float32 worst 1.5e-4,
# out of logits up to 38 in magnitude. Float32 noise moves by tens of percent between CPUs,
# thread counts and kernels; a real defect (a wrong position, a stale or mixed cache, a
# half-precision step) moves logits by 0.1 or more. 1e-3 sits between the two.
TOLERANCE = 1e-3
KV_TOLERANCE = 1e-4  # max |key or value - float64| in the cache (measured worst: 2.1e-5)
# Where the float64 reference's top-1 leads its top-2 by more than this, any path within
# TOLERANCE has the same argmax; closer calls are reported, not judged.
CLEAR_GAP = 2 * TOLERANCE


def thread_count() -> int:
    """The thread count kvcandle runs with (it pins RAYON_NUM_THREADS at import); torch is
    given the same, so both engines are measured alike."""
    return int(os.environ.get("RAYON_NUM_THREADS") or os.cpu_count() or 1)


def top2_gap(logits: np.ndarray) -> np.ndarray:
    """top-1 minus top-2 logit, per row."""
    part = np.partition(np.asarray(logits, dtype=np.float64), -2, axis=-1)
    return part[..., -1] - part[..., -2]


@dataclass
class Row:
    """One float32 path measured against the float64 reference along a sequence."""

    path: str
    first: int  # the first position measured (a path may give only the later positions)
    max_err: float  # max |logit - float64 logit| over those positions
    worst_at: int  # where it was largest
    top1: int  # positions with the reference's argmax, among the clear ones
    clear: int  # positions whose reference top-2 gap exceeds CLEAR_GAP
    positions: int

    def line(self) -> str:
        return (
            f"| {self.path} | {self.first}-{self.first + self.positions - 1} | {self.max_err:.2e} | "
            f"{self.worst_at} | {self.max_err / TOLERANCE:.2f} | {self.top1}/{self.clear} |"
        )


TABLE_HEADER = (
    "| float32 path | positions | max abs error vs float64 | at position | of the bound | top-1 (clear gaps) |\n"
    "|---|---|---|---|---|---|"
)


@dataclass
class RefSequence:
    """A prompt, the float64 reference's greedy continuation, and its logits everywhere."""

    prompt: str
    ids: list[int]
    logits: np.ndarray  # float64, (len(ids), vocab)

    def measure(self, path: str, rows: np.ndarray) -> Row:
        """``rows`` are the logits of the last ``len(rows)`` positions."""
        rows = np.asarray(rows, dtype=np.float64)
        first = len(self.ids) - len(rows)
        ref = self.logits[first:]
        assert rows.shape == ref.shape, (path, rows.shape, ref.shape)
        err = np.abs(rows - ref).max(axis=-1)
        clear = top2_gap(ref) > CLEAR_GAP
        return Row(
            path,
            first,
            float(err.max()),
            first + int(err.argmax()),
            int((rows.argmax(-1) == ref.argmax(-1))[clear].sum()),
            int(clear.sum()),
            len(rows),
        )


class Transformers:
    """transformers' LlamaForCausalLM (eager attention) and tokenizer on a GGUF file (the
    default model unless ``path``), dequantized, in ``dtype``; torch uses
    :func:`thread_count` threads."""

    def __init__(self, path: Optional[str] = None, dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

        from ._default import default_model_path

        p = default_model_path() if path is None else Path(path)
        torch.set_num_threads(thread_count())
        self.torch = torch
        self.DynamicCache = DynamicCache
        self.model = AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=getattr(torch, dtype), attn_implementation="eager"
        ).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        self._check_dtype()
        params = inspect.signature(self.model.forward).parameters
        # transformers >= 5.24 names the cache argument `cache`; earlier 5.x `past_key_values`
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def astype(self, dtype: str) -> "Transformers":
        """The same weights cast to ``dtype`` (float64 -> float32 is exact: the GGUF blocks
        dequantize to float32 values)."""
        other = copy.copy(self)
        other.model = copy.deepcopy(self.model).to(getattr(self.torch, dtype))
        other._check_dtype()
        return other

    @property
    def dtype(self) -> str:
        return str(self.model.dtype).replace("torch.", "")

    def _check_dtype(self) -> None:
        """Every weight is a plain tensor of the model's dtype: none stayed in GGUF blocks
        behind a kernel computing in another precision."""
        bad = [n for n, p in self.model.named_parameters() if p.dtype != self.model.dtype]
        packed = [n for n, m in self.model.named_modules() if type(m).__name__.startswith("Gguf")]
        if bad or packed:
            raise RuntimeError(f"transformers did not load a plain {self.dtype} model: {bad[:3]} {packed[:3]}")

    def new_cache(self) -> Any:
        return self.DynamicCache(config=self.model.config)

    def logits(self, ids: Sequence[int], cache: Any = None) -> np.ndarray:
        """All positions' logits of ``ids`` (appended to ``cache`` if given), as float64."""
        kw = {self._cache_kw: cache, "use_cache": True} if cache is not None else {"use_cache": False}
        with self.torch.inference_mode():
            return self.model(self.torch.tensor([list(ids)]), **kw).logits[0].double().numpy()

    def greedy(self, ids: Sequence[int], n: int = 20, cache: Any = None) -> tuple[list[int], list[float]]:
        """``n`` greedy tokens after ``ids`` with a cache, and each step's top-2 gap."""
        cache = self.new_cache() if cache is None else cache
        out: list[int] = []
        gaps: list[float] = []
        logits = self.logits(ids, cache)[-1]
        for i in range(n):
            out.append(int(logits.argmax()))
            gaps.append(float(top2_gap(logits)))
            if i < n - 1:
                logits = self.logits([out[-1]], cache)[-1]
        return out, gaps


def compute_in_float64(model: Any) -> None:
    """transformers computes three steps in float32 whatever the model's dtype: RMSNorm, the
    RoPE angles, and eager attention's softmax. On the reference model they are replaced by
    the same formulas in float64, so nothing in it rounds to float32. ``model`` is a
    float64 LlamaForCausalLM."""
    import types

    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama as llama

    def rms_norm(self: Any, x: Any) -> Any:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for module in model.modules():
        if isinstance(module, llama.LlamaRMSNorm):
            module.forward = types.MethodType(rms_norm, module)  # type: ignore[method-assign]

    config = model.config
    params = config.rope_parameters
    kind = params.get("rope_type", "default")
    if kind not in ("default", "llama3"):
        raise RuntimeError(f"the float64 reference implements default and llama3 RoPE only, not {params}")
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if kind == "llama3":
        # Llama 3.1's scaling (transformers' formula): long wavelengths slowed by `factor`,
        # short ones kept, the band between interpolated
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        original = params["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)
        band = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > original / low, inv_freq / factor, torch.where(wavelen < original / high, inv_freq, band))

    def rope(x: Any, position_ids: Any) -> Any:
        angles = position_ids[..., None].double() * inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos(), emb.sin()

    model.model.rotary_emb.forward = rope

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float, dropout: float = 0.0, **kwargs: Any) -> Any:
        keys = llama.repeat_kv(key, module.num_key_value_groups)
        values = llama.repeat_kv(value, module.num_key_value_groups)
        weights = torch.matmul(query, keys.transpose(2, 3)) * scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = torch.softmax(weights, dim=-1)
        return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights

    name = "kvcandle_float64_eager"
    AttentionInterface.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["eager"])  # an additive mask, as eager's
    model.set_attn_implementation(name)


class Reference:
    """The float64 reference and transformers' float32 model on the same weights."""

    def __init__(self, path: Optional[str] = None) -> None:
        self.f64 = Transformers(path, "float64")
        self.f32 = self.f64.astype("float32")
        compute_in_float64(self.f64.model)
        self.tokenizer = self.f64.tokenizer

    def sequence(self, kv: Model, prompt: str) -> RefSequence:
        """``prompt`` plus the float64 model's 19 greedy tokens: 24 ids for a 5-token prompt."""
        assert kv.tokenizer is not None
        ids = kv.tokenizer.encode(prompt)
        ids = ids + self.f64.greedy(ids, 19)[0]
        return RefSequence(prompt, ids, self.f64.logits(ids))

    def self_check(self, seq: RefSequence) -> float:
        """The float64 reference with its cache against itself without: float64 rounding
        only (about 1e-13), which shows the reference really computes in float64."""
        return float(np.abs(run_chunks(self.f64.logits, self.f64.new_cache, seq.ids, [5]) - seq.logits).max())


def kv_greedy(model: Model, ids: Sequence[int], n: int = 20, cache: Any = None) -> list[int]:
    """``n`` greedy tokens after ``ids`` (the last one not fed back)."""
    return continue_greedy(model, ids, model.new_cache() if cache is None else cache, n)[0]


def run_chunks(
    logits: Callable[[Sequence[int], Any], np.ndarray], new_cache: Callable[[], Any], seq: Sequence[int], chunks: Sequence[int]
) -> np.ndarray:
    """Feeds ``seq`` through one cache in ``chunks``, then one token at a time; every
    position's logits, as ``logits(ids, cache)`` returns them for each piece."""
    assert sum(chunks) <= len(seq)
    sizes = list(chunks) + [1] * (len(seq) - sum(chunks))
    cache, out, start = new_cache(), [], 0
    for n in sizes:
        out.append(np.asarray(logits(seq[start : start + n], cache), dtype=np.float64))
        start += n
    return np.concatenate(out)


CHUNKINGS = ([5], [3, 2], [7, 1, 9, 3, 4], [2, 11, 5], [1, 23], [13, 6, 5])


@dataclass
class Accuracy:
    rows: list[Row]
    kvcandle_vs_upstream: float  # max |diff| of kvcandle's and candle's cached decode logits


def accuracy(kv: Model, ref: Reference, seq: RefSequence) -> Accuracy:
    """Experiments 2 and 3 (teacher forcing, chunked prefill): every float32 path along
    ``seq``, each step fed the reference token, measured against the float64 logits."""
    ids = seq.ids

    def kv_all(piece: Sequence[int], cache: Any) -> np.ndarray:
        return kv.forward(piece, cache, all_logits=True)

    up = kv.upstream()
    ucache = up.new_cache(True)
    upstream = [up.forward(ids[:5], 0, ucache)] + [up.forward([t], p, ucache) for p, t in enumerate(ids[5:], 5)]
    cache = kv.new_cache()
    decode = [kv.forward(ids[:5], cache)] + [kv.forward([t], cache) for t in ids[5:]]
    tf = ref.f32
    rows = [
        seq.measure("transformers, no cache (one pass)", tf.logits(ids)),
        seq.measure("transformers, cache: 5 then 1 at a time", run_chunks(tf.logits, tf.new_cache, ids, [5])),
        seq.measure("transformers, cache: chunks 3+2 then 1 at a time", run_chunks(tf.logits, tf.new_cache, ids, [3, 2])),
        seq.measure("kvcandle, cache: 5 then 1 at a time (last-position logits)", np.stack(decode)),
        seq.measure("kvcandle, no cache (one pass)", kv.forward(ids, all_logits=True)),
        seq.measure("kvcandle, no cache (fresh prefix each step)", np.stack([kv.forward(ids[:end]) for end in range(5, len(ids) + 1)])),
        seq.measure("candle upstream, cache: 5 then 1 at a time", np.stack(upstream)),
    ]
    for chunks in CHUNKINGS:
        name = "+".join(map(str, chunks))
        rows.append(seq.measure(f"kvcandle, cache: chunks {name} then 1 at a time", run_chunks(kv_all, kv.new_cache, ids, chunks)))
    # not a distance to the reference: the native engine is built to do candle's arithmetic
    same = float(np.abs(np.stack(decode) - np.stack(upstream)).max())
    return Accuracy(rows, same)


# A cache that stores keys and values in fewer bits than float32 rounds them by a chosen
# precision before attention reads them (like llama.cpp's float16 and q8_0 caches), not by
# float32 noise, so each such type has its own bound on the logits against float64:
# - "float16" rounds to 11 significant bits (relative error up to 4.9e-4). Measured on
#   this project's machines: worst 2.3e-2 along the reference sequences, out of logits
#   up to 38. A defect (a wrong position, a mixed cache) moves logits by 0.1 or more; 5e-2
#   sits between.
# - "q8_0" rounds each block of 32 dimensions to 255 steps of its largest magnitude
#   (error up to 1/254 of it, relative to the block's largest value: about 20 times
#   float16's rounding on SmolLM2's keys). Measured on this project's machines: worst
#   0.42 along the reference sequences. 0.6 leaves room for float32 noise moving a
#   value across a rounding step; the greedy token agrees wherever the reference's top-2
#   gap exceeds twice that.
CACHE_TOLERANCE = {"float16": 5e-2, "q8_0": 0.6}


def stored_cache(kv: Model, seq: RefSequence, dtype: str) -> list[Row]:
    """A cache of ``dtype`` (a key of :data:`CACHE_TOLERANCE`) along ``seq`` (teacher
    forcing), decoded one token at a time and in uneven chunks, against the float64
    reference. ``Row.clear`` counts the positions whose reference top-2 gap exceeds twice
    the dtype's bound, ``Row.top1`` those among them with the same argmax."""
    ids, bound = seq.ids, CACHE_TOLERANCE[dtype]
    new = lambda: kv.new_cache(dtype=dtype)  # noqa: E731
    cache = new()
    runs = {"5 then 1 at a time": np.stack([kv.forward(ids[:5], cache)] + [kv.forward([t], cache) for t in ids[5:]])}
    for chunks in ([3, 2], [7, 1, 9, 3, 4]):
        name = f"chunks {'+'.join(map(str, chunks))} then 1 at a time"
        runs[name] = run_chunks(lambda piece, c: kv.forward(piece, c, all_logits=True), new, ids, chunks)
    rows = []
    for name, logits in runs.items():
        r = seq.measure(f"kvcandle, {dtype} cache: {name}", logits)
        ref = seq.logits[r.first:]
        clear = top2_gap(ref) > 2 * bound
        r.clear = int(clear.sum())
        r.top1 = int((np.asarray(logits).argmax(-1) == ref.argmax(-1))[clear].sum())
        rows.append(r)
    return rows


def cache_object(kv: Model, ref: Reference) -> dict[str, Any]:
    """Experiment 1: both caches after 20 greedy tokens; kvcandle's keys and values (and
    transformers' float32 ones) against the float64 reference's DynamicCache."""
    assert kv.tokenizer is not None
    ids = kv.tokenizer.encode(PROMPT)
    ours, f64, f32 = kv.new_cache(), ref.f64.new_cache(), ref.f32.new_cache()
    tokens = kv_greedy(kv, ids, 20, ours)
    reference, gaps = ref.f64.greedy(ids, 20, f64)
    ref.f32.greedy(ids, 20, f32)

    def as64(t: Any) -> np.ndarray:
        return t.double().numpy() if hasattr(t, "double") else np.asarray(t, dtype=np.float64)

    def worst(layers: Any, values: bool) -> float:
        err = 0.0
        for a, b in zip(layers, f64.layers):
            x, y = (a.values, b.values) if values else (a.keys, b.keys)
            err = max(err, float(np.abs(as64(x) - as64(y)).max()))
        return err

    return {
        "kvcandle": {"len": len(ours), "layers": len(ours.layers), "keys": ours.layers[0].keys.shape, "dtype": str(ours.layers[0].keys.dtype)},
        "transformers": {
            "len": f32.get_seq_length(),
            "layers": len(f32.layers),
            "keys": tuple(f32.layers[0].keys.shape),
            "dtype": str(f32.layers[0].keys.dtype).replace("torch.", ""),
        },
        "greedy": greedy_agreement(tokens, reference, gaps),
        "kvcandle_key_err": worst(ours.layers, False),
        "kvcandle_value_err": worst(ours.layers, True),
        "transformers_key_err": worst(f32.layers, False),
        "transformers_value_err": worst(f32.layers, True),
    }


def greedy_agreement(tokens: Sequence[int], reference: Sequence[int], gaps: Sequence[float]) -> dict[str, Any]:
    """How far a float32 greedy run follows the float64 one. They may part only at a step
    whose reference top-2 gap is within CLEAR_GAP (a near tie); after that they are on
    different sequences and no longer comparable."""
    n = len(reference)
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), n)
    return {"same_steps": same, "steps": n, "ok": same == n or gaps[same] <= CLEAR_GAP, "gap_at_split": None if same == n else gaps[same]}


def greedy_generation(kv: Model, ref: Reference, prompts: Sequence[str] = GREEDY_PROMPTS) -> list[dict[str, Any]]:
    """Experiment 4: 20 greedy tokens from each prompt, kvcandle and transformers' float32
    judged against the float64 reference's greedy tokens."""
    assert kv.tokenizer is not None
    out = []
    for prompt in prompts:
        ids = kv.tokenizer.encode(prompt)
        reference, gaps = ref.f64.greedy(ids)
        ours, theirs = kv_greedy(kv, ids), ref.f32.greedy(ids)[0]
        out.append(
            {
                "prompt": prompt,
                "reference": reference,
                "kvcandle": greedy_agreement(ours, reference, gaps),
                "transformers": greedy_agreement(theirs, reference, gaps),
                "min_gap": min(gaps),
                "text": kv.tokenizer.decode(ours),
            }
        )
    return out


def continue_greedy(kv: Model, ids: Sequence[int], cache: Any, n: int = 20) -> tuple[list[int], np.ndarray]:
    """Runs ``ids`` after what ``cache`` holds, then ``n - 1`` greedy steps: the tokens and
    each step's logits."""
    logits = [kv.forward(ids, cache)]
    tokens = [int(logits[0].argmax())]
    for _ in range(n - 1):
        logits.append(kv.forward([tokens[-1]], cache))
        tokens.append(int(logits[-1].argmax()))
    return tokens, np.stack(logits)


def fork_branches(kv: Model) -> list[dict[str, Any]]:
    """Experiment 5: "The capital of" prefilled once and forked; each branch continued
    and compared with a fresh cache fed the same pieces (the stem, then the rest): the
    same arithmetic on the same inputs, so any difference at all is the cache's fault."""
    assert kv.tokenizer is not None
    stem = kv.tokenizer.encode("The capital of")
    base = kv.new_cache()
    kv.forward(stem, base)
    out = []
    for cache, country in ((base.fork(), "France"), (base.fork(), "Germany")):
        full = kv.tokenizer.encode(f"The capital of {country} is")
        assert full[: len(stem)] == stem
        tokens, logits = continue_greedy(kv, full[len(stem) :], cache)
        fresh_cache = kv.new_cache()
        kv.forward(stem, fresh_cache)
        fresh, fresh_logits = continue_greedy(kv, full[len(stem) :], fresh_cache)
        out.append(
            {
                "branch": country,
                "equal": tokens == fresh,
                "max_diff": float(np.abs(logits - fresh_logits).max()),
                "text": kv.tokenizer.decode(tokens),
                "cache_tokens_ok": cache.tokens == full + tokens[:-1],
                "base_unchanged": base.tokens == stem,
            }
        )
    return out


def misuse(kv: Model, ref: Reference) -> dict[str, Any]:
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
    tf = ref.f32
    tf_cache = tf.new_cache()
    tf.greedy(first, 20, tf_cache)
    tf_reuse = tf.greedy(second, 20, tf_cache)[0]
    tf_fresh = tf.greedy(second, 20)[0]
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
        "kvcandle_after_crop_equals_fresh": kv_after_crop == kv_greedy(kv, second),
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


def tokenizer_parity(kv: Model, ref: Reference, corpus: Sequence[str] = TOKENIZER_CORPUS) -> list[dict[str, Any]]:
    """Experiment 7: encode and decode against transformers' GGUF tokenizer."""
    assert kv.tokenizer is not None
    out = []
    for text in corpus:
        ours = kv.tokenizer.encode(text)
        theirs = ref.tokenizer.encode(text)
        out.append(
            {
                "text": text,
                "encode_equal": ours == theirs,
                "decode_equal": kv.tokenizer.decode(ours) == ref.tokenizer.decode(theirs),
                "roundtrip": kv.tokenizer.decode(ours) == text,
                "ours": ours,
                "theirs": theirs,
            }
        )
    return out


def prefill_accuracy(kv: Model, ref: Reference) -> list[tuple[str, Row, Row]]:
    """For each of :data:`PREFILL_PROMPTS`: transformers float32 and kvcandle's one-pass
    prefill (every position's logits), each against float64 on the same weights."""
    assert kv.tokenizer is not None
    out = []
    for name, text in PREFILL_PROMPTS.items():
        if name == "chat":
            text = kv.tokenizer.apply_chat_template([
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Explain why the sky is blue in two sentences, and then list three colours of sunsets."},
            ])
        ids = kv.tokenizer.encode(text)
        seq = RefSequence(name, ids, ref.f64.logits(ids))
        theirs = seq.measure("transformers, one pass", ref.f32.logits(ids))
        ours = seq.measure("kvcandle, one pass", kv.forward(ids, kv.new_cache(), all_logits=True))
        out.append((name, theirs, ours))
    return out


def main() -> None:
    kv = load()
    ref = Reference()
    print(f"kvcandle and torch on {thread_count()} thread(s); bound {TOLERANCE:g} on every float32 path\n")
    print("## 1. The cache object after 20 greedy tokens")
    for k, v in cache_object(kv, ref).items():
        print(f"- {k}: {v}")
    for prompt in SEQUENCE_PROMPTS:
        seq = ref.sequence(kv, prompt)
        assert kv.tokenizer is not None
        print(f"\n## 2-3. Along {prompt!r} + {kv.tokenizer.decode(seq.ids[5:])!r} ({len(seq.ids)} ids)\n")
        print(f"float64 reference with its cache vs without: {ref.self_check(seq):.1e}\n")
        acc = accuracy(kv, ref, seq)
        print(TABLE_HEADER)
        for row in acc.rows:
            print(row.line())
        print(f"\nkvcandle's cached decode vs candle's own Llama (own decode attention kernel): max|diff| {acc.kvcandle_vs_upstream:.1e}")
    print("\n## 4. Greedy generation, 20 tokens, against the float64 reference's tokens")
    for g in greedy_generation(kv, ref):
        print(f"- {g['prompt']!r} -> {g['text']!r} (min top-2 gap {g['min_gap']:.3f}): kvcandle {g['kvcandle']}, transformers {g['transformers']}")
    print("\n## 5. Fork: 'The capital of' prefilled once, two branches")
    for f in fork_branches(kv):
        print(f"- {f['branch']}: equal to a fresh run {f['equal']}, max|diff| {f['max_diff']:.3e}: {f['text']!r}")
    print("\n## 6. Misuse")
    for k, v in misuse(kv, ref).items():
        print(f"- {k}:")
        for kk, vv in v.items():
            print(f"  - {kk}: {vv!r}")
    print("\n## 7. One-pass prefill of prompts outside the suite (the matrix-product path)\n")
    print("| prompt | tokens | transformers float32 | kvcandle | kvcandle / transformers |\n|---|---|---|---|---|")
    for name, theirs, ours in prefill_accuracy(kv, ref):
        print(f"| {name} | {ours.positions} | {theirs.max_err:.2e} | {ours.max_err:.2e} | {ours.max_err / theirs.max_err:.2f} |")
    print("\n## 8. Tokenizer")
    toks = tokenizer_parity(kv, ref)
    print(f"- encode equal {sum(t['encode_equal'] for t in toks)}/{len(toks)}, decode equal {sum(t['decode_equal'] for t in toks)}/{len(toks)}")


if __name__ == "__main__":
    main()
