"""Generation: ``generate_step`` (token ids) -> ``stream_generate`` (text pieces) ->
``generate`` (one result).

With a ``cache``, the prompt is the *whole* sequence: the cache is cropped back to the
longest common prefix of its tokens and the prompt's (never mixed with something else),
and only the rest is run. Afterwards the cache holds the prompt and every generated
token but the last, so the next turn's prompt (the conversation so far) reuses it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generator, Iterator, Optional, Sequence, Union

import numpy as np

from .cache import KVCache
from ._checks import check_int, refuse, show
from ._ids import as_ids
from .errors import InputError
from .model import Model
from .prompt_cache import PromptCache
from .sampling import apply_repetition_penalty, check_settings, sample

Prompt = Union[str, Sequence[int]]


@dataclass
class Stats:
    prompt_tokens: int = 0
    """Tokens in the prompt."""
    prefill_tokens: int = 0
    """Prompt tokens actually run (the rest came from the cache)."""
    reused_tokens: int = 0
    """Prompt tokens taken from a cache (given, or found in a prompt cache) instead of
    run: ``prompt_tokens - prefill_tokens``."""
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    """The prefill and the first token's sampling: the time to the first token."""
    decode_seconds: float = 0.0
    """The forwards and samplings of every later token (never the caller's time between
    tokens)."""

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str
    """"eos", "stop" (a stop string), "length" (max_tokens) or "context" (cache full)."""
    stats: Stats = field(default_factory=Stats)

    @property
    def prompt_tokens(self) -> int:
        return self.stats.prompt_tokens

    @property
    def prefill_tps(self) -> float:
        return self.stats.prefill_tps

    @property
    def decode_tps(self) -> float:
        return self.stats.decode_tps


@dataclass
class Piece:
    """One piece of streamed text; the last one carries the finish reason."""

    text: str
    tokens: list[int]
    """Token ids generated since the previous piece (text may be held back across ids)."""
    finish_reason: Optional[str] = None


def encode_prompt(model: Model, prompt: Prompt) -> list[int]:
    """The prompt's token ids: a str is encoded with the model's tokenizer.

    Raises:
        InputError: the prompt is a str and the model has no tokenizer, or the prompt
            is empty (no ids).
        TypeError: the prompt is neither a str nor token ids.
    """
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise InputError(f"{model.path} has no tokenizer: pass the prompt as token ids")
        ids = model.tokenizer.encode(prompt)
    else:
        ids = as_ids(prompt)
    if not ids:
        raise InputError(f"the prompt is empty: generation needs at least one token, got {show(prompt)}")
    return ids


def _max_tokens(value: object) -> int:
    return check_int("max_tokens", value, minimum=1, rule="a positive int")


def _stop_strings(stop: object) -> list[str]:
    """``stop`` (None, a str or an iterable of str) as a list of non-empty str."""
    rule = "a non-empty str, a list of non-empty str, or None"
    if stop is None:
        return []
    if isinstance(stop, str):
        if not stop:
            raise refuse("stop", rule, stop)
        return [stop]
    if isinstance(stop, (bytes, bytearray)) or not isinstance(stop, Iterable):
        raise refuse("stop", rule, stop)
    stops = list(stop)
    for i, s in enumerate(stops):
        if not isinstance(s, str) or not s:
            raise refuse(f"stop[{i}]", "a non-empty str", s)
    return stops


def generate_step(
    model: Model,
    prompt_ids: Sequence[int],
    cache: KVCache,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    repetition_penalty: Optional[float] = None,
    seed: Optional[int] = None,
    stats: Optional[Stats] = None,
) -> Generator[int, None, None]:
    """Yields token ids forever (the caller stops). Each yielded token is fed to the
    model only when the next one is asked for; the cache is cropped to the prompt's
    longest common prefix first.

    Raises:
        InputError: a bad sampling setting (see :func:`kvcandle.sampling.check_settings`),
            raised on the first ``next()`` before the cache is touched.
    """
    temperature, top_k, top_p, repetition_penalty, seed = check_settings(
        temperature, top_k, top_p, repetition_penalty, seed
    )
    stats = stats if stats is not None else Stats()
    rng = np.random.default_rng(seed)
    ids = list(prompt_ids)
    history = list(ids)
    # Only the work done here is timed, never the caller's time between tokens: the
    # prefill and the first sample are the time to the first token, each later forward
    # plus its sample one decode step.
    clock = time.perf_counter()
    # the cache keeps its common prefix with the prompt; everything that could refuse
    # the call is checked before it changes
    synced = model.sync(ids, cache, diverged="crop")
    stats.prompt_tokens = len(ids)
    stats.prefill_tokens = synced.ran
    stats.reused_tokens = synced.kept
    logits = synced.logits
    while True:
        if repetition_penalty is not None:
            logits = apply_repetition_penalty(logits, history, repetition_penalty)
        token = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, rng=rng)
        elapsed = time.perf_counter() - clock
        if stats.generated_tokens == 0:
            stats.prefill_seconds += elapsed
        else:
            stats.decode_seconds += elapsed
        stats.generated_tokens += 1
        yield token
        history.append(token)
        clock = time.perf_counter()
        logits = model.forward([token], cache)


def stream_generate(
    model: Model,
    prompt: Prompt,
    *,
    max_tokens: int = 256,
    cache: Optional[KVCache] = None,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    repetition_penalty: Optional[float] = None,
    seed: Optional[int] = None,
    stop: Union[str, Sequence[str], None] = None,
    stats: Optional[Stats] = None,
    prompt_cache: Optional["PromptCache"] = None,
) -> Iterator[Piece]:
    """Yields the generated text piece by piece. A piece never ends inside a multi-byte
    character, and text that could begin a stop string is held back until it cannot;
    the pieces join to exactly :func:`generate`'s text.

    Raises:
        InputError: the model has no tokenizer, the prompt is empty, or a setting is bad
            (``max_tokens``, ``stop``, or a sampling setting as
            :func:`kvcandle.sampling.check_settings` checks them); raised before the
            cache is touched. The message names the setting and its value.
        TypeError: the prompt is neither a str nor token ids.
    """
    if model.tokenizer is None:
        raise InputError(f"{model.path} has no tokenizer, so text cannot be streamed")
    max_tokens = _max_tokens(max_tokens)
    stops = _stop_strings(stop)
    tok = model.tokenizer
    ids = encode_prompt(model, prompt)
    if prompt_cache is not None and not isinstance(prompt_cache, PromptCache):
        raise TypeError(f"prompt_cache must be a kvcandle.PromptCache, got {type(prompt_cache).__name__}")
    if prompt_cache is not None and prompt_cache.model is not model:
        raise InputError("prompt_cache holds another model's caches")
    if cache is None:
        # the longest prefix any entry shares, or an empty cache
        cache = prompt_cache.lookup(ids) if prompt_cache is not None else model.new_cache()
    stats = stats if stats is not None else Stats()
    eos = set(tok.eos_token_ids) | set(model.config.eos_token_ids)
    pending: list[int] = []  # ids generated since the last piece
    held = ""  # decoded text not yielded yet: it may be the start of a stop string
    # text arrives from a streaming decoder: each id costs the same however long the
    # text already is, and a character split across ids comes out once it is complete
    decoder = tok.decode_stream()
    steps = generate_step(
        model, ids, cache, temperature=temperature, top_k=top_k, top_p=top_p,
        repetition_penalty=repetition_penalty, seed=seed, stats=stats,
    )
    reason = "length"
    generated = 0
    for token in steps:
        if token in eos:
            reason = "eos"
            break
        generated += 1
        pending.append(token)
        held += decoder.add(token)
        hit = min((i for i in (held.find(s) for s in stops) if i >= 0), default=-1)
        if hit >= 0:
            yield Piece(held[:hit], pending)
            pending, held = [], ""
            reason = "stop"
            break
        safe = len(held)
        for s in stops:  # hold back a suffix that may grow into a stop string
            for n in range(min(len(s) - 1, safe), 0, -1):
                if held[:safe].endswith(s[:n]):
                    safe -= n
                    break
        if safe > 0:
            yield Piece(held[:safe], pending)
            pending, held = [], held[safe:]
        if generated >= max_tokens:
            break
        if len(cache) + 1 > cache.max_length:
            reason = "context"
            break
    steps.close()
    if prompt_cache is not None:
        prompt_cache.insert(cache)
    # an incomplete UTF-8 sequence at the very end (cut by max_tokens) never left the decoder
    yield Piece(held, pending, reason)


def generate(
    model: Model,
    prompt: Prompt,
    *,
    max_tokens: int = 256,
    cache: Optional[KVCache] = None,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    repetition_penalty: Optional[float] = None,
    seed: Optional[int] = None,
    stop: Union[str, Sequence[str], None] = None,
    prompt_cache: Optional["PromptCache"] = None,
) -> GenerationResult:
    """Generates a continuation of ``prompt`` (a str or token ids).

    Args:
        model: the model.
        prompt: the whole prompt; with ``cache``, only what the cache lacks is run.
        max_tokens: the most tokens to generate.
        cache: a cache to reuse and extend (cropped to its common prefix with the prompt).
        prompt_cache: a :class:`kvcandle.PromptCache`: without ``cache``, generation
            starts from the longest prefix of the prompt it holds; the cache used is
            inserted into it afterwards. ``result.stats.reused_tokens`` says how many
            prompt tokens were not run.
        temperature: 0 is greedy; otherwise sampling, reproducible with ``seed``.
        top_k, top_p, repetition_penalty: sampling filters.
        stop: strings that end generation; the text ends before the first one.

    Returns:
        The text, the generated token ids, the finish reason and timings.

    Raises:
        InputError: as :func:`stream_generate` (no tokenizer, empty prompt, a bad
            setting); a refused call leaves ``cache`` as it was.
        TypeError: the prompt is neither a str nor token ids.
    """
    stats = Stats()
    pieces: list[str] = []
    reason = "length"
    token_list: list[int] = []
    for piece in stream_generate(
        model, prompt, max_tokens=max_tokens, cache=cache, temperature=temperature, top_k=top_k,
        top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop, stats=stats,
        prompt_cache=prompt_cache,
    ):
        pieces.append(piece.text)
        token_list.extend(piece.tokens)
        if piece.finish_reason is not None:
            reason = piece.finish_reason
    return GenerationResult("".join(pieces), token_list, reason, stats)
