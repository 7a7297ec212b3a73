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
from typing import Any, Generator, Iterator, Optional, Sequence, Union, overload

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

    def count(self, seconds: float) -> None:
        """A token generated in ``seconds`` (the first counts as the prefill's)."""
        if self.generated_tokens == 0:
            self.prefill_seconds += seconds
        else:
            self.decode_seconds += seconds
        self.generated_tokens += 1

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
    cache: Optional[KVCache] = None
    """With ``generate(..., n=...)`` and ``batch_generate``: the cache of this
    continuation (the prompt and every generated token but the last)."""

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
    sampler = _Sampler(check_settings(temperature, top_k, top_p, repetition_penalty, seed), prompt_ids)
    stats = stats if stats is not None else Stats()
    ids = list(prompt_ids)
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
        token = sampler(logits)
        stats.count(time.perf_counter() - clock)
        yield token
        clock = time.perf_counter()
        logits = model.forward([token], cache)


class _Sampler:
    """One sequence's sampling: its checked settings, its random stream (from ``seed``)
    and the ids so far (for the repetition penalty)."""

    def __init__(self, settings: tuple, history: Sequence[int]) -> None:
        self.temperature, self.top_k, self.top_p, self.penalty, seed = settings
        self.rng = np.random.default_rng(seed)
        self.history = list(history)

    def __call__(self, logits: np.ndarray) -> int:
        if self.penalty is not None:
            logits = apply_repetition_penalty(logits, self.history, self.penalty)
        token = sample(logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, rng=self.rng)
        self.history.append(token)
        return token


class _Text:
    """One sequence's text as its tokens arrive: decoded by a streaming decoder (each id
    costs the same however long the text already is, a character split across ids comes
    out once complete), text that may begin a stop string held back, and the reasons to
    finish (EOS, a stop string, ``max_tokens``, a full cache)."""

    def __init__(self, model: Model, stops: list[str], max_tokens: int) -> None:
        tok = model.tokenizer
        assert tok is not None
        self.eos = set(tok.eos_token_ids) | set(model.config.eos_token_ids)
        self.stops = stops
        self.max_tokens = max_tokens
        self.decoder = tok.decode_stream()
        self.pending: list[int] = []  # ids generated since the last piece
        self.held = ""  # decoded text not given out yet: it may be the start of a stop string
        self.generated = 0

    def add(self, token: int, cache: KVCache) -> tuple[Optional[Piece], Optional[str]]:
        """Takes the next token: the piece of text it lets out (if any), and the finish
        reason if generation ends with it."""
        if token in self.eos:
            return None, "eos"
        self.generated += 1
        self.pending.append(token)
        self.held += self.decoder.add(token)
        held, stops = self.held, self.stops
        hit = min((i for i in (held.find(s) for s in stops) if i >= 0), default=-1)
        if hit >= 0:
            before = Piece(held[:hit], self.pending)
            self.pending, self.held = [], ""
            return before, "stop"
        safe = len(held)
        for s in stops:  # hold back a suffix that may grow into a stop string
            for n in range(min(len(s) - 1, safe), 0, -1):
                if held[:safe].endswith(s[:n]):
                    safe -= n
                    break
        piece: Optional[Piece] = None
        if safe > 0:
            piece = Piece(held[:safe], self.pending)
            self.pending, self.held = [], held[safe:]
        if self.generated >= self.max_tokens:
            return piece, "length"
        if len(cache) + 1 > cache.max_length:
            return piece, "context"
        return piece, None

    def last(self, reason: str) -> Piece:
        """The last piece (an incomplete UTF-8 sequence cut by ``max_tokens`` never left
        the decoder), carrying the finish reason."""
        return Piece(self.held, self.pending, reason)


def _prepare(
    model: Model, prompt: Prompt, max_tokens: object, stop: object, cache: Optional[KVCache], prompt_cache: Optional["PromptCache"]
) -> tuple[list[int], list[str], int, KVCache]:
    """What every generation checks before anything runs; returns the prompt's ids, the
    stop strings, ``max_tokens`` and the cache to start from (the given one, the longest
    prefix ``prompt_cache`` holds, or a new one)."""
    if model.tokenizer is None:
        raise InputError(f"{model.path} has no tokenizer, so text cannot be streamed")
    max_tokens = _max_tokens(max_tokens)
    stops = _stop_strings(stop)
    ids = encode_prompt(model, prompt)
    if prompt_cache is not None and not isinstance(prompt_cache, PromptCache):
        raise TypeError(f"prompt_cache must be a kvcandle.PromptCache, got {type(prompt_cache).__name__}")
    if prompt_cache is not None and prompt_cache.model is not model:
        raise InputError("prompt_cache holds another model's caches")
    if cache is None:
        # the longest prefix any entry shares, or an empty cache
        cache = prompt_cache.lookup(ids) if prompt_cache is not None else model.new_cache()
    return ids, stops, max_tokens, cache


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
    ids, stops, max_tokens, cache = _prepare(model, prompt, max_tokens, stop, cache, prompt_cache)
    stats = stats if stats is not None else Stats()
    text = _Text(model, stops, max_tokens)
    steps = generate_step(
        model, ids, cache, temperature=temperature, top_k=top_k, top_p=top_p,
        repetition_penalty=repetition_penalty, seed=seed, stats=stats,
    )
    reason = "length"
    for token in steps:
        piece, done = text.add(token, cache)
        if piece is not None:
            yield piece
        if done is not None:
            reason = done
            break
    steps.close()
    if prompt_cache is not None:
        prompt_cache.insert(cache)
    yield text.last(reason)


@overload
def generate(
    model: Model, prompt: Prompt, *, max_tokens: int = ..., cache: Optional[KVCache] = ..., temperature: float = ...,
    top_k: Optional[int] = ..., top_p: Optional[float] = ..., repetition_penalty: Optional[float] = ..., seed: Optional[int] = ...,
    stop: Union[str, Sequence[str], None] = ..., prompt_cache: Optional["PromptCache"] = ..., n: None = ...,
) -> GenerationResult: ...
@overload
def generate(
    model: Model, prompt: Prompt, *, max_tokens: int = ..., cache: Optional[KVCache] = ..., temperature: float = ...,
    top_k: Optional[int] = ..., top_p: Optional[float] = ..., repetition_penalty: Optional[float] = ..., seed: Optional[int] = ...,
    stop: Union[str, Sequence[str], None] = ..., prompt_cache: Optional["PromptCache"] = ..., n: int,
) -> list[GenerationResult]: ...
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
    n: Optional[int] = None,
) -> Union[GenerationResult, list[GenerationResult]]:
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
        n: generate this many continuations of the prompt, returned as a list: the
            prompt runs once, then ``n`` forks of its cache (sharing its blocks) decode
            together, one step for all (:meth:`kvcandle.Model.forward_batch`).
            Continuation ``i`` samples with seed ``seed + i`` and is exactly what
            ``generate(..., seed=seed + i)`` gives alone (greedy: all the same). The
            given cache (or the prompt cache's) keeps the prompt; each result's
            ``cache`` holds its own continuation.

    Returns:
        The text, the generated token ids, the finish reason and timings (a list of
        ``n`` of them with ``n``).

    Raises:
        InputError: as :func:`stream_generate` (no tokenizer, empty prompt, a bad
            setting, ``n`` not a positive int); a refused call leaves ``cache`` as it was.
        TypeError: the prompt is neither a str nor token ids.
    """
    if n is not None:
        n = check_int("n", n, minimum=1, rule="a positive int")
        return _generate_n(model, prompt, n, max_tokens, cache, (temperature, top_k, top_p, repetition_penalty, seed), stop, prompt_cache)
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


def _generate_n(
    model: Model, prompt: Prompt, n: int, max_tokens: int, cache: Optional[KVCache], settings: tuple, stop: object,
    prompt_cache: Optional["PromptCache"],
) -> list[GenerationResult]:
    """:func:`generate` with ``n``: the prompt once, then ``n`` forks in one batch."""
    settings = check_settings(*settings)
    ids, stops, max_tokens, cache = _prepare(model, prompt, max_tokens, stop, cache, prompt_cache)
    clock = time.perf_counter()
    synced = model.sync(ids, cache, diverged="crop")
    results = _decode_together(model, [(ids, cache.fork(), synced) for _ in range(n)], settings, stops, max_tokens, clock)
    if prompt_cache is not None:
        for r in results:
            prompt_cache.insert(r.cache)  # type: ignore[arg-type]
    return results


def batch_generate(
    model: Model,
    prompts: Sequence[Prompt],
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    repetition_penalty: Optional[float] = None,
    seed: Optional[int] = None,
    stop: Union[str, Sequence[str], None] = None,
) -> list[GenerationResult]:
    """Generates a continuation of each prompt (str or token ids, of any lengths), all
    decoding together: one :meth:`kvcandle.Model.forward_batch` step per token for every
    prompt still going. Each prompt is prefilled on its own cache first.

    Prompt ``i`` samples with seed ``seed + i``, and its result is exactly what
    ``generate(model, prompts[i], seed=seed + i, ...)`` gives alone (its ``cache`` is the
    prompt's cache). The settings are :func:`generate`'s.

    Raises:
        InputError: no prompts, or as :func:`generate` (a bad setting; an empty prompt,
            named by its index), before anything runs.
        TypeError: ``prompts`` is not a sequence of prompts.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a sequence of prompts (str or token ids), got {type(prompts).__name__}")
    if not prompts:
        raise InputError("prompts is empty: batch_generate needs at least one prompt")
    settings = check_settings(temperature, top_k, top_p, repetition_penalty, seed)
    prepared = []
    for i, prompt in enumerate(prompts):
        try:
            prepared.append(_prepare(model, prompt, max_tokens, stop, None, None))
        except InputError as e:
            raise InputError(f"prompts[{i}]: {e}") from None
    clock = time.perf_counter()
    starts = [(ids, cache, model.sync(ids, cache, diverged="crop")) for ids, _, _, cache in prepared]
    _, stops, max_tokens, _ = prepared[0]
    return _decode_together(model, starts, settings, stops, max_tokens, clock)


def _decode_together(
    model: Model, starts: list[tuple[list[int], KVCache, Any]], settings: tuple, stops: list[str], max_tokens: int, clock: float
) -> list[GenerationResult]:
    """Sequence ``i`` (its prompt ids, its cache holding them, and the sync that gave the
    last prompt position's logits) sampled with seed ``seed + i``, every sequence still
    going fed to the model together, one step per token."""
    temperature, top_k, top_p, penalty, seed = settings
    n = len(starts)
    caches = [cache for _, cache, _ in starts]
    samplers = [_Sampler((temperature, top_k, top_p, penalty, None if seed is None else seed + i), ids) for i, (ids, _, _) in enumerate(starts)]
    texts = [_Text(model, stops, max_tokens) for _ in range(n)]
    stats = [Stats(prompt_tokens=len(ids), prefill_tokens=s.ran, reused_tokens=s.kept) for ids, _, s in starts]
    parts: list[list[str]] = [[] for _ in range(n)]
    tokens: list[list[int]] = [[] for _ in range(n)]
    reasons: list[str] = ["length"] * n
    logits = [s.logits for _, _, s in starts]
    active = list(range(n))
    while active:
        fed: list[int] = []
        for i in active:
            token = samplers[i](logits[i])
            piece, done = texts[i].add(token, caches[i])
            if piece is not None:
                parts[i].append(piece.text)
                tokens[i].extend(piece.tokens)
            if done is None:
                fed.append(i)
            else:
                reasons[i] = done
                last = texts[i].last(done)
                parts[i].append(last.text)
                tokens[i].extend(last.tokens)
        # every active sequence's time is the step's (they ran together)
        elapsed = time.perf_counter() - clock
        for i in active:
            stats[i].count(elapsed)
        clock = time.perf_counter()
        if fed:
            out = model.forward_batch([[samplers[i].history[-1]] for i in fed], [caches[i] for i in fed])
            for i, row in zip(fed, out):
                logits[i] = row
        active = fed
    return [GenerationResult("".join(parts[i]), tokens[i], reasons[i], stats[i], cache=caches[i]) for i in range(n)]
