"""Beam search over forks of one cache.

Every running beam is a cache: the prompt runs once, each beam's continuation is a fork
of its parent's cache (O(1): the blocks are shared until one of them writes), and all
running beams decode their next token together in one
:meth:`kvcandle.Model.forward_batch` step. Beams that are dropped release their blocks.

The search follows transformers' beam search (``generate(num_beams=...)``, no sampling):
the ``2 * num_beams`` best continuations of all beams by summed log-probability; those
that end (an end-of-sequence token, or ``max_tokens`` reached) among the first
``num_beams`` become finished hypotheses scored ``sum_logprobs / length **
length_penalty`` (length counting the generated tokens, the end token included); the
best ``num_beams`` that do not end run on. The search stops when every running
continuation ends, or, with ``num_beams`` finished hypotheses, when the best running
beam's score at its current length cannot beat the worst finished one
(``early_stopping=False``) or at once (``early_stopping=True``).
"""

from __future__ import annotations

import time
from typing import Optional, Union, overload

import numpy as np

from ._checks import check_int, refuse
from .cache import KVCache
from .errors import InputError
from .generation import GenerationResult, Prompt, Stats, encode_prompt
from .model import Model


class _Beam:
    __slots__ = ("tokens", "score", "cache")

    def __init__(self, tokens: list[int], score: float, cache: KVCache) -> None:
        self.tokens, self.score, self.cache = tokens, score, cache


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


@overload
def beam_search(
    model: Model, prompt: Prompt, *, num_beams: int = ..., max_tokens: int = ..., length_penalty: float = ...,
    early_stopping: bool = ..., cache: Optional[KVCache] = ..., n: None = ...,
) -> GenerationResult: ...
@overload
def beam_search(
    model: Model, prompt: Prompt, *, num_beams: int = ..., max_tokens: int = ..., length_penalty: float = ...,
    early_stopping: bool = ..., cache: Optional[KVCache] = ..., n: int,
) -> list[GenerationResult]: ...
def beam_search(
    model: Model,
    prompt: Prompt,
    *,
    num_beams: int = 4,
    max_tokens: int = 256,
    length_penalty: float = 1.0,
    early_stopping: bool = False,
    cache: Optional[KVCache] = None,
    n: Optional[int] = None,
) -> Union[GenerationResult, list[GenerationResult]]:
    """The most likely continuation of ``prompt`` by beam search over ``num_beams``
    forks of its cache (see the module's description for the rule).

    Args:
        prompt: a str (encoded with the model's tokenizer) or token ids.
        num_beams: beams kept at each step.
        max_tokens: the most tokens a continuation has.
        length_penalty: finished hypotheses are scored ``sum_logprobs / length **
            length_penalty``: above 0 favours longer ones.
        early_stopping: stop as soon as ``num_beams`` hypotheses have finished.
        cache: a cache to start from (cropped to its common prefix with the prompt); it
            keeps the prompt.
        n: return the ``n`` best hypotheses (at most ``num_beams``) instead of the best.

    Returns:
        The best hypothesis as a :class:`GenerationResult` (``score`` set; ``tokens``
        without the end-of-sequence token, ``finish_reason`` "eos", "length" or
        "context" (the model's context is full, as :func:`generate` ends);
        ``cache`` holding the prompt and every token but the last; ``text`` decoded
        when the model has a tokenizer), or a list of the ``n`` best.

    Raises:
        InputError: a bad setting (named with its value) or an empty prompt, before
            anything runs.
    """
    num_beams = check_int("num_beams", num_beams, minimum=1, rule="a positive int")
    max_tokens = check_int("max_tokens", max_tokens, minimum=1, rule="a positive int")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float, np.floating, np.integer)) or not np.isfinite(length_penalty):
        raise refuse("length_penalty", "a finite number", length_penalty)
    if not isinstance(early_stopping, bool):
        raise refuse("early_stopping", "a bool", early_stopping)
    count = 1 if n is None else check_int("n", n, minimum=1, rule="a positive int")
    if count > num_beams:
        raise InputError(f"n must be at most num_beams ({num_beams}): beam search keeps num_beams hypotheses, got n={count}")
    if cache is not None and not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a kvcandle.KVCache, got {type(cache).__name__}")
    ids = encode_prompt(model, prompt)
    eos = set(model.config.eos_token_ids) | (set(model.tokenizer.eos_token_ids) if model.tokenizer is not None else set())
    penalty = float(length_penalty)

    clock = time.perf_counter()
    cache = cache if cache is not None else model.new_cache()
    synced = model.sync(ids, cache, diverged="crop")
    running = [_Beam([], 0.0, cache.fork())]
    logits = [synced.logits]
    finished: list[tuple[float, list[int], str, KVCache]] = []  # (score, tokens, reason, cache)
    stats = Stats(prompt_tokens=len(ids), prefill_tokens=synced.ran, reused_tokens=synced.kept)
    improvable = True
    keep = 2 * num_beams if len(eos) <= 1 else (1 + len(eos)) * num_beams
    while True:
        # the best `keep` continuations of every running beam, by summed log-probability
        scores = np.concatenate([_log_softmax(lg) + b.score for b, lg in zip(running, logits)])
        vocab = len(logits[0])
        k = min(keep, len(scores))
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        nxt: list[tuple[_Beam, int, float]] = []
        for rank, flat in enumerate(top):
            parent, token, score = running[flat // vocab], int(flat % vocab), float(scores[flat])
            length = len(parent.tokens) + 1
            # as generate: a continuation whose last token the cache cannot take ends there
            full = len(ids) + length > cache.max_length
            ends = token in eos or length >= max_tokens or full
            if not ends:
                if len(nxt) < num_beams:
                    nxt.append((parent, token, score))
                continue
            if rank < num_beams and improvable and not (early_stopping and len(finished) >= num_beams):
                final = score / (length**penalty)
                reason = "eos" if token in eos else "length" if length >= max_tokens else "context"
                tokens = parent.tokens if token in eos else parent.tokens + [token]
                finished.append((final, tokens, reason, parent.cache))
                finished.sort(key=lambda f: -f[0])
                del finished[num_beams:]
        elapsed = time.perf_counter() - clock
        stats.count(elapsed)
        clock = time.perf_counter()
        if not nxt:
            break  # every continuation ended (max_tokens, a full context)
        # the early-stop rule: with num_beams finished, can the best running beam still win?
        if len(finished) >= num_beams:
            best_running = nxt[0][2] / ((len(nxt[0][0].tokens) + 1) ** penalty)
            improvable = improvable and best_running > finished[-1][0]
            if not improvable or early_stopping:
                break
        # each new beam a fork of its parent; all of them run their token in one step
        running = [_Beam(p.tokens + [t], s, p.cache.fork()) for p, t, s in nxt]
        logits = model.forward_batch([[b.tokens[-1]] for b in running], [b.cache for b in running])
    results = []
    for score, tokens, reason, beam_cache in finished[:count]:
        text = model.tokenizer.decode(tokens, skip_special_tokens=True) if model.tokenizer is not None else ""
        results.append(GenerationResult(text, tokens, reason, stats, cache=beam_cache, score=score))
    return results[0] if n is None else results
