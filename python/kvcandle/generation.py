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
from .errors import InputError, KVCandleError
from .model import Model, crop_back, prompt_chunk
from .prompt_cache import PromptCache
from .sampling import apply_repetition_penalty, check_settings, sample
from .speculative import Counts, Draft, Drafter, check_num_draft, drafter, speculative_step

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
    draft_rounds: int = 0
    """With ``draft=``: chunks of guessed tokens the model checked."""
    drafted_tokens: int = 0
    """With ``draft=``: tokens the drafter guessed."""
    accepted_tokens: int = 0
    """With ``draft=``: guesses the model kept and gave out (each a token it did not run
    a step of its own for)."""

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

    @property
    def acceptance(self) -> float:
        """With ``draft=``: the share of guesses kept (0 when nothing was guessed)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str
    """"eos", "stop" (a stop string), "length" (max_tokens) or "context" (cache full)."""
    stats: Stats = field(default_factory=Stats)
    cache: Optional[KVCache] = None
    """With ``generate(..., n=...)``, ``batch_generate``, :class:`BatchGenerator` and
    :func:`kvcandle.beam_search`: the cache of this continuation (the prompt and every
    generated token but the last)."""
    score: Optional[float] = None
    """With :func:`kvcandle.beam_search`: the hypothesis's summed log-probability divided
    by its length to the power ``length_penalty``."""

    @property
    def prompt_tokens(self) -> int:
        return self.stats.prompt_tokens

    @property
    def prefill_tps(self) -> float:
        return self.stats.prefill_tps

    @property
    def decode_tps(self) -> float:
        return self.stats.decode_tps


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (the log-softmax of its
    logits, before temperature, top-k, top-p or a repetition penalty reshape them), and
    the most likely tokens at that position with theirs."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    """``(token, logprob)`` of the most likely tokens, most likely first (as many as
    asked for)."""


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """The :class:`TokenLogprob` of ``token`` given its position's ``logits``, with the
    ``top`` most likely tokens (computed in float64)."""
    z = np.asarray(logits, dtype=np.float64)
    shifted = z - np.max(z)
    logp = shifted - np.log(np.sum(np.exp(shifted)))
    best: list[tuple[int, float]] = []
    if top > 0:
        idx = np.argpartition(-logp, top - 1)[:top] if top < len(logp) else np.arange(len(logp))
        idx = idx[np.lexsort((idx, -logp[idx]))]  # most likely first, ties by id
        best = [(int(i), float(logp[i])) for i in idx]
    return TokenLogprob(int(token), float(logp[token]), best)


@dataclass
class Piece:
    """One piece of streamed text; the last one carries the finish reason."""

    text: str
    tokens: list[int]
    """Token ids generated since the previous piece (text may be held back across ids)."""
    finish_reason: Optional[str] = None
    draft_tokens: int = 0
    """With ``draft=``: how many of ``tokens`` were guesses of the drafter the model kept
    (the rest it chose itself)."""
    index: int = 0
    """Which sequence the piece belongs to: the continuation's index with
    ``stream_generate(..., n=...)``, the id :meth:`BatchGenerator.add` returned."""
    result: Optional["GenerationResult"] = None
    """On a sequence's last piece from ``stream_generate(..., n=...)`` and
    :class:`BatchGenerator`: its whole result, its cache included."""
    logprobs: Optional[list[TokenLogprob]] = None
    """With ``BatchGenerator.add(..., logprobs=k)``: one :class:`TokenLogprob` for each
    of ``tokens``, in order."""


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
    draft: Optional[Draft] = None,
    num_draft: int = 4,
) -> Generator[int, None, None]:
    """Yields token ids forever (the caller stops). Each yielded token is fed to the
    model only when the next one is asked for; the cache is cropped to the prompt's
    longest common prefix first. With ``draft``, tokens come from speculative decoding
    (:mod:`kvcandle.speculative`): the same tokens greedily, the same distribution when
    sampling; the cache then holds the prompt and every yielded token but the last
    whenever the generator waits or is closed.

    Raises:
        InputError: a bad sampling setting (see :func:`kvcandle.sampling.check_settings`)
            or a bad ``draft``/``num_draft``, raised on the first ``next()`` before the
            cache is touched.
    """
    steps = _steps(model, prompt_ids, cache, check_settings(temperature, top_k, top_p, repetition_penalty, seed), stats, draft, num_draft)
    try:
        for token, _ in steps:
            yield token
    finally:
        steps.close()


def _steps(
    model: Model, prompt_ids: Sequence[int], cache: KVCache, settings: tuple, stats: Optional[Stats], draft: Optional[Draft], num_draft: object
) -> Generator[tuple[int, bool], None, None]:
    """``(token, from_draft)`` pairs: :func:`generate_step`'s tokens, and whether each
    was a drafter's guess the model kept."""
    stats = stats if stats is not None else Stats()
    ids = list(prompt_ids)
    if draft is not None:
        return _draft_steps(model, ids, cache, settings, drafter(draft, model, settings), check_num_draft(num_draft), stats)
    return _plain_steps(model, ids, cache, settings, stats)


def _plain_steps(model: Model, ids: list[int], cache: KVCache, settings: tuple, stats: Stats) -> Generator[tuple[int, bool], None, None]:
    sampler = _Sampler(settings, ids)
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
        yield token, False
        clock = time.perf_counter()
        logits = model.forward([token], cache)


def _draft_steps(
    model: Model, ids: list[int], cache: KVCache, settings: tuple, draft: Drafter, num_draft: int, stats: Stats
) -> Generator[tuple[int, bool], None, None]:
    """:func:`kvcandle.speculative.speculative_step` after the prompt's prefill, timed as
    ``generate_step`` times its tokens (a round's time goes to its first token)."""
    sampler = _Sampler(settings, ids)
    clock = time.perf_counter()
    synced = model.sync(ids, cache, diverged="crop")
    stats.prompt_tokens, stats.prefill_tokens, stats.reused_tokens = len(ids), synced.ran, synced.kept
    counts = Counts()
    inner = speculative_step(model, ids, cache, synced.logits, draft, num_draft, sampler, counts)
    try:
        for token, from_draft in inner:
            stats.count(time.perf_counter() - clock)
            stats.draft_rounds, stats.drafted_tokens, stats.accepted_tokens = counts.rounds, counts.drafted, counts.accepted
            yield token, from_draft
            clock = time.perf_counter()
    finally:
        inner.close()


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

    def __init__(self, model: Model, stops: list[str], max_tokens: int, prompt_len: int, max_length: int) -> None:
        tok = model.tokenizer
        assert tok is not None
        self.eos = set(tok.eos_token_ids) | set(model.config.eos_token_ids)
        self.stops = stops
        self.max_tokens = max_tokens
        self.decoder = tok.decode_stream()
        self.pending: list[int] = []  # ids generated since the last piece
        self.drafted = 0  # how many of them were kept guesses
        self.held = ""  # decoded text not given out yet: it may be the start of a stop string
        self.generated = 0
        # the cache holds the prompt and every generated token but the last: the context
        # is full when the next token would not fit
        self.prompt_len, self.max_length = prompt_len, max_length

    def add(self, token: int, from_draft: bool = False) -> tuple[Optional[Piece], Optional[str]]:
        """Takes the next token: the piece of text it lets out (if any), and the finish
        reason if generation ends with it."""
        if token in self.eos:
            return None, "eos"
        self.generated += 1
        self.pending.append(token)
        self.drafted += from_draft
        self.held += self.decoder.add(token)
        held, stops = self.held, self.stops
        hit = min((i for i in (held.find(s) for s in stops) if i >= 0), default=-1)
        if hit >= 0:
            before = Piece(held[:hit], self.pending, draft_tokens=self.drafted)
            self.pending, self.held, self.drafted = [], "", 0
            return before, "stop"
        safe = len(held)
        for s in stops:  # hold back a suffix that may grow into a stop string
            for n in range(min(len(s) - 1, safe), 0, -1):
                if held[:safe].endswith(s[:n]):
                    safe -= n
                    break
        piece: Optional[Piece] = None
        if safe > 0:
            piece = Piece(held[:safe], self.pending, draft_tokens=self.drafted)
            self.pending, self.held, self.drafted = [], held[safe:], 0
        if self.generated >= self.max_tokens:
            return piece, "length"
        if self.prompt_len + self.generated > self.max_length:
            return piece, "context"
        return piece, None

    def last(self, reason: str) -> Piece:
        """The last piece (an incomplete UTF-8 sequence cut by ``max_tokens`` never left
        the decoder), carrying the finish reason."""
        return Piece(self.held, self.pending, reason, draft_tokens=self.drafted)


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
    if cache is not None and not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a kvcandle.KVCache, got {type(cache).__name__}")
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
    n: Optional[int] = None,
    draft: Optional[Draft] = None,
    num_draft: int = 4,
) -> Iterator[Piece]:
    """Yields the generated text piece by piece. A piece never ends inside a multi-byte
    character, and text that could begin a stop string is held back until it cannot;
    the pieces join to exactly :func:`generate`'s text.

    With ``draft`` (see :mod:`kvcandle.speculative`), a drafter guesses up to
    ``num_draft`` tokens ahead (adapted to what is kept) and the model checks them in one
    chunk: greedy output is identical to plain decoding, sampled output has exactly the
    model's distribution. Each piece's ``draft_tokens`` counts its kept guesses; the
    stats count rounds, guesses and kept guesses.

    With ``n``, the ``n`` continuations of :func:`generate` with ``n`` are streamed
    together: each piece's ``index`` says whose it is, and each continuation's last
    piece carries its ``finish_reason`` and its whole ``result`` (its cache included).

    Raises:
        InputError: the model has no tokenizer, the prompt is empty, or a setting is bad
            (``max_tokens``, ``stop``, or a sampling setting as
            :func:`kvcandle.sampling.check_settings` checks them); raised before the
            cache is touched. The message names the setting and its value.
        TypeError: the prompt is neither a str nor token ids.
    """
    if n is not None:
        n = check_int("n", n, minimum=1, rule="a positive int")
        if draft is not None:
            raise InputError("draft with n is not supported: speculation runs one sequence (use n=None)")
        settings = check_settings(temperature, top_k, top_p, repetition_penalty, seed)
        yield from _stream_n(model, prompt, n, max_tokens, cache, settings, stop, prompt_cache)
        return
    ids, stops, max_tokens, cache = _prepare(model, prompt, max_tokens, stop, cache, prompt_cache)
    stats = stats if stats is not None else Stats()
    text = _Text(model, stops, max_tokens, len(ids), cache.max_length)
    settings = check_settings(temperature, top_k, top_p, repetition_penalty, seed)
    steps = _steps(model, ids, cache, settings, stats, draft, num_draft)
    reason = "length"
    for token, from_draft in steps:
        piece, done = text.add(token, from_draft)
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
    draft: Optional[Draft] = ..., num_draft: int = ...,
) -> GenerationResult: ...
@overload
def generate(
    model: Model, prompt: Prompt, *, max_tokens: int = ..., cache: Optional[KVCache] = ..., temperature: float = ...,
    top_k: Optional[int] = ..., top_p: Optional[float] = ..., repetition_penalty: Optional[float] = ..., seed: Optional[int] = ...,
    stop: Union[str, Sequence[str], None] = ..., prompt_cache: Optional["PromptCache"] = ..., n: int,
    draft: None = ..., num_draft: int = ...,
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
    draft: Optional[Draft] = None,
    num_draft: int = 4,
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
        draft, num_draft: speculative decoding (see :func:`stream_generate` and
            :mod:`kvcandle.speculative`); ``result.stats`` counts the guesses.

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
        if draft is not None:
            raise InputError("draft with n is not supported: speculation runs one sequence (use n=None)")
        return _generate_n(model, prompt, n, max_tokens, cache, (temperature, top_k, top_p, repetition_penalty, seed), stop, prompt_cache)
    stats = Stats()
    pieces: list[str] = []
    reason = "length"
    token_list: list[int] = []
    for piece in stream_generate(
        model, prompt, max_tokens=max_tokens, cache=cache, temperature=temperature, top_k=top_k,
        top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop, stats=stats,
        prompt_cache=prompt_cache, draft=draft, num_draft=num_draft,
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
    return _collect(_stream_n(model, prompt, n, max_tokens, cache, settings, stop, prompt_cache), n)


def _stream_n(
    model: Model, prompt: Prompt, n: int, max_tokens: object, cache: Optional[KVCache], settings: tuple, stop: object,
    prompt_cache: Optional["PromptCache"],
) -> Iterator[Piece]:
    """The prompt run once on ``cache``; ``n`` forks of it decode together in a
    :class:`BatchGenerator`, fork ``i`` sampling with seed ``seed + i``."""
    ids, stops, max_tokens_, cache = _prepare(model, prompt, max_tokens, stop, cache, prompt_cache)
    temperature, top_k, top_p, penalty, seed = settings
    clock = time.perf_counter()
    synced = model.sync(ids, cache, diverged="crop")
    elapsed = time.perf_counter() - clock
    batch = BatchGenerator(model)
    for i in range(n):
        each = (temperature, top_k, top_p, penalty, None if seed is None else seed + i)
        batch._add_started(ids, cache.fork(), synced, elapsed, each, stops, max_tokens_, prompt_cache)
    while batch:
        yield from batch.step()


def _collect(pieces: Iterator[Piece], n: int) -> list[GenerationResult]:
    """Every sequence's result, in index order, from a stream of pieces of ``n``."""
    results: dict[int, GenerationResult] = {}
    for piece in pieces:
        if piece.result is not None:
            results[piece.index] = piece.result
    return [results[i] for i in range(n)]


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
    together in a :class:`BatchGenerator`: every step runs each prompt's next prefill
    chunk and each started sequence's last token in one
    :meth:`kvcandle.Model.forward_batch` call.

    Prompt ``i`` samples with seed ``seed + i``, and its result is exactly what
    ``generate(model, prompts[i], seed=seed + i, ...)`` gives alone (its ``cache`` is the
    prompt's cache). The settings are :func:`generate`'s.

    Raises:
        InputError: no prompts, or as :func:`generate` (a bad setting; an empty prompt),
            before anything runs.
        TokenIdError, PositionError, TypeError: as :func:`generate`, before anything
            runs; a prompt's error names its index (``prompts[i]: ...``).
        TypeError: ``prompts`` is not a sequence of prompts.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a sequence of prompts (str or token ids), got {type(prompts).__name__}")
    if not prompts:
        raise InputError("prompts is empty: batch_generate needs at least one prompt")
    check_settings(temperature, top_k, top_p, repetition_penalty, seed)
    batch = BatchGenerator(model)
    for i, prompt in enumerate(prompts):
        try:
            batch.add(
                prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                repetition_penalty=repetition_penalty, seed=None if seed is None else seed + i, stop=stop,
            )
        except (KVCandleError, TypeError) as e:  # each kind as add raised it, naming the prompt
            raise type(e)(f"prompts[{i}]: {e}") from None

    def pieces() -> Iterator[Piece]:
        while batch:
            yield from batch.step()

    return _collect(pieces(), len(prompts))


class _Sequence:
    """One sequence of a :class:`BatchGenerator`: its prompt, cache, sampler, text and
    stats, the ids still to run and the logits not sampled yet."""

    def __init__(
        self, uid: int, ids: list[int], cache: Optional[KVCache], sampler: _Sampler, text: _Text, stats: Stats,
        prompt_cache: Optional[PromptCache], logprobs: Optional[int],
    ) -> None:
        self.uid, self.ids, self.cache, self.sampler, self.text, self.stats = uid, ids, cache, sampler, text, stats
        self.prompt_cache = prompt_cache
        self.feed: list[int] = []  # ids to run next: the rest of the prompt, or the last token
        self.logits: Optional[np.ndarray] = None  # the last position's, waiting to be sampled
        self.elapsed = 0.0  # time of the steps since the last token came out
        self.parts: list[str] = []
        self.tokens: list[int] = []
        self.logprobs = logprobs  # how many top tokens each token's TokenLogprob lists; None: no logprobs
        self.pending_logprobs: list[TokenLogprob] = []  # of the tokens not given out in a piece yet
        # add(n=k): the other k - 1 sequences wait (cache None) for this one's prompt, then
        # start from forks of its cache and its last logits
        self.waiting: list[_Sequence] = []
        self.parent: Optional[_Sequence] = None

    def take_logprobs(self) -> Optional[list[TokenLogprob]]:
        if self.logprobs is None:
            return None
        out, self.pending_logprobs = self.pending_logprobs, []
        return out

    def result(self, reason: str) -> GenerationResult:
        return GenerationResult("".join(self.parts), list(self.tokens), reason, self.stats, cache=self.cache)


class BatchGenerator:
    """Continuous batching: sequences join and leave at any step, each with its own
    prompt, cache and settings, and every step runs all of them in one
    :meth:`kvcandle.Model.forward_batch` call (the weights read once for all rows).

    A step runs, for each sequence still prefilling, the next chunk of its prompt (up
    to :data:`kvcandle.PREFILL_CHUNK` tokens, as :meth:`kvcandle.Model.forward` chunks
    it), and for each sequence generating, the token it sampled last; then it samples
    every sequence whose prompt is done. A sequence's tokens are exactly what
    :func:`generate` gives it alone with the same settings, whatever else is in the
    batch. Adding or removing a sequence copies no keys or values.

        batch = kvcandle.BatchGenerator(model)
        a = batch.add("The capital of France is", max_tokens=20)
        b = batch.add("Once upon a time", temperature=0.8, seed=1, stop=".")
        while batch:
            for piece in batch.step():
                print(piece.index, piece.text, piece.finish_reason)

    Each finished sequence's last piece carries ``finish_reason`` and ``result`` (its
    :class:`GenerationResult`, with the cache holding the prompt and every generated
    token but the last: ready for a :class:`kvcandle.PromptCache` or the next turn).

    If a step raises (Ctrl-C included), every cache holds exactly its ``tokens`` and
    the generator can step again.
    """

    def __init__(self, model: Model) -> None:
        if not isinstance(model, Model):
            raise TypeError(f"model must be a kvcandle.Model, got {type(model).__name__}")
        if model.tokenizer is None:
            raise InputError(f"{model.path} has no tokenizer, so text cannot be streamed")
        self.model = model
        self._seqs: dict[int, _Sequence] = {}
        self._next = 0
        self._pieces: list[Piece] = []  # let out by a step that then raised: the next step returns them

    def __len__(self) -> int:
        """Sequences in the batch (prefilling or generating)."""
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    @property
    def indices(self) -> list[int]:
        """The ids of the sequences in the batch, in the order they were added."""
        return list(self._seqs)

    @overload
    def add(
        self, prompt: Prompt, *, max_tokens: int = ..., temperature: float = ..., top_k: Optional[int] = ..., top_p: Optional[float] = ...,
        repetition_penalty: Optional[float] = ..., seed: Optional[int] = ..., stop: Union[str, Sequence[str], None] = ...,
        cache: Optional[KVCache] = ..., prompt_cache: Optional[PromptCache] = ..., n: None = ..., logprobs: Optional[int] = ...,
    ) -> int: ...
    @overload
    def add(
        self, prompt: Prompt, *, max_tokens: int = ..., temperature: float = ..., top_k: Optional[int] = ..., top_p: Optional[float] = ...,
        repetition_penalty: Optional[float] = ..., seed: Optional[int] = ..., stop: Union[str, Sequence[str], None] = ...,
        cache: Optional[KVCache] = ..., prompt_cache: Optional[PromptCache] = ..., n: int, logprobs: Optional[int] = ...,
    ) -> list[int]: ...
    def add(
        self,
        prompt: Prompt,
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        repetition_penalty: Optional[float] = None,
        seed: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = None,
        cache: Optional[KVCache] = None,
        prompt_cache: Optional[PromptCache] = None,
        n: Optional[int] = None,
        logprobs: Optional[int] = None,
    ) -> Union[int, list[int]]:
        """Adds a sequence; it starts at the next :meth:`step`. The settings are
        :func:`generate`'s; ``cache`` (or the longest prefix ``prompt_cache`` holds) is
        cropped to its common prefix with the prompt, and ``prompt_cache`` gets the
        cache back when the sequence finishes. Returns the sequence's id (``index`` of
        its pieces).

        With ``n``, adds ``n`` sequences of one prompt and returns their ids: the prompt
        runs once (for the first), then the others start from forks of its cache (no
        keys or values copied), sequence ``i`` sampling with seed ``seed + i`` as
        :func:`generate` with ``n`` does.

        With ``logprobs=k``, each piece carries a :class:`TokenLogprob` for each of its
        tokens, listing the ``k`` most likely tokens too (``k`` may be 0).

        Raises:
            InputError: a bad setting or an empty prompt (named with its value), or
                ``cache`` already generating in this batch; nothing is added and no
                cache changes.
            PositionError: the prompt does not fit the context.
            CacheError: ``cache`` belongs to another model.
        """
        settings = check_settings(temperature, top_k, top_p, repetition_penalty, seed)
        count = 1 if n is None else check_int("n", n, minimum=1, rule="a positive int or None")
        top = None if logprobs is None else check_int("logprobs", logprobs, minimum=0, rule="a non-negative int or None")
        ids, stops, max_tokens_, cache = _prepare(self.model, prompt, max_tokens, stop, cache, prompt_cache)
        for other in self._seqs.values():
            if other.cache is not None and (other.cache is cache or other.cache._inner is cache._inner):
                raise InputError(f"this cache is already generating in this batch (sequence {other.uid}): fork() it for another sequence")
        keep = self.model._sync_start(ids, cache, "crop")
        first = self._new(ids, cache, settings, stops, max_tokens_, prompt_cache, top, cache.max_length)
        first.stats.prefill_tokens, first.stats.reused_tokens = len(ids) - keep, keep
        first.feed = ids[keep:]
        temperature_, top_k_, top_p_, penalty_, seed_ = settings
        for i in range(1, count):
            each = (temperature_, top_k_, top_p_, penalty_, None if seed_ is None else seed_ + i)
            other = self._new(ids, None, each, stops, max_tokens_, prompt_cache, top, cache.max_length)
            other.parent = first
            first.waiting.append(other)
        if n is None:
            return first.uid
        return [first.uid] + [w.uid for w in first.waiting]

    def _add_started(
        self, ids: list[int], cache: KVCache, synced: Any, elapsed: float, settings: tuple, stops: list[str], max_tokens: int,
        prompt_cache: Optional[PromptCache],
    ) -> int:
        """A sequence whose prompt already ran (``synced``: its last position's logits),
        sampled at the next step; ``elapsed`` is its prefill's time."""
        seq = self._new(ids, cache, settings, stops, max_tokens, prompt_cache, None, cache.max_length)
        seq.stats.prefill_tokens, seq.stats.reused_tokens = synced.ran, synced.kept
        seq.logits, seq.elapsed = synced.logits, elapsed
        return seq.uid

    def _new(
        self, ids: list[int], cache: Optional[KVCache], settings: tuple, stops: list[str], max_tokens: int,
        prompt_cache: Optional[PromptCache], logprobs: Optional[int], max_length: int,
    ) -> _Sequence:
        uid, self._next = self._next, self._next + 1
        text = _Text(self.model, stops, max_tokens, len(ids), max_length)
        seq = _Sequence(uid, ids, cache, _Sampler(settings, ids), text, Stats(prompt_tokens=len(ids)), prompt_cache, logprobs)
        self._seqs[uid] = seq
        return seq

    def _start_waiting(self, parent: _Sequence) -> None:
        """The sequences waiting for ``parent``'s prompt start from forks of its cache
        (which holds the prompt) and its last logits."""
        assert parent.cache is not None
        for w in parent.waiting:
            w.cache, w.logits, w.elapsed, w.parent = parent.cache.fork(), parent.logits, parent.elapsed, None
            w.stats.prefill_tokens, w.stats.reused_tokens = parent.stats.prefill_tokens, parent.stats.reused_tokens
        parent.waiting = []

    def remove(self, index: int) -> GenerationResult:
        """Takes a sequence out now. Returns its result so far (``finish_reason``
        "removed"; text held back for a possible stop string included); its cache holds
        exactly its ``tokens`` (part of the prompt if it was still prefilling).

        Raises:
            InputError: no sequence with this id is in the batch.
        """
        seq = self._seqs.pop(index, None) if isinstance(index, int) else None
        if seq is None:
            raise InputError(f"no sequence {show(index)} in this batch: its sequences are {self.indices}")
        self._pieces = [p for p in self._pieces if p.index != index]  # their text is in the result
        if seq.parent is not None:  # still waiting for its parent's prompt
            assert seq.parent.cache is not None
            seq.parent.waiting.remove(seq)
            seq.cache, seq.parent = seq.parent.cache.fork(), None
        elif seq.waiting:  # the next waiting sequence runs the rest of the prompt instead
            assert seq.cache is not None
            heir, *rest = seq.waiting
            heir.cache, heir.feed, heir.parent, heir.waiting = seq.cache.fork(), seq.feed, None, rest
            heir.elapsed = seq.elapsed
            heir.stats.prefill_tokens, heir.stats.reused_tokens = seq.stats.prefill_tokens, seq.stats.reused_tokens
            for w in rest:
                w.parent = heir
            seq.waiting, seq.feed = [], []
        last = seq.text.last("removed")
        seq.parts.append(last.text)
        seq.tokens.extend(last.tokens)
        return seq.result("removed")

    def step(self) -> list[Piece]:
        """Runs one step for every sequence in the batch; returns the pieces of text it
        let out, in the order the sequences were added (a finished sequence's last piece
        carries ``finish_reason`` and ``result``; finished sequences leave the batch)."""
        running = [s for s in self._seqs.values() if s.feed]
        if running:
            inputs = [s.feed[: prompt_chunk(len(s.feed))] for s in running]
            caches = [s.cache for s in running]
            lengths = [len(c) for c in caches]  # type: ignore[arg-type]
            clock = time.perf_counter()
            out = self.model.forward_batch(inputs, caches)  # type: ignore[arg-type]  # raises: every cache as it was
            elapsed = time.perf_counter() - clock
            taken = 0
            try:
                for s, fed, logits in zip(running, inputs, out):
                    n = len(fed)
                    del s.feed[:n]  # no call between these two: nothing is raised between them
                    taken += 1
                    s.elapsed += elapsed
                    if not s.feed:
                        s.logits = logits
                        self._start_waiting(s)
            except BaseException:  # interrupted here: the sequences not taken run their ids again
                crop_back(caches[taken:], lengths[taken:])  # type: ignore[arg-type]
                for s in running[:taken]:
                    if s.logits is not None and s.waiting:
                        self._start_waiting(s)
                raise
        pieces = self._pieces  # kept if sampling raises: the next step returns them
        for s in list(self._seqs.values()):
            if s.logits is None:
                continue
            clock = time.perf_counter()
            logits = s.logits
            token = s.sampler(logits)  # raises: the logits stay, sampled again next step
            s.logits = None
            piece, done = s.text.add(token)
            if s.logprobs is not None and done != "eos":  # an end token is not one of the tokens
                s.pending_logprobs.append(token_logprob(logits, token, s.logprobs))
            s.stats.count(s.elapsed + time.perf_counter() - clock)
            s.elapsed = 0.0
            if piece is not None:
                s.parts.append(piece.text)
                s.tokens.extend(piece.tokens)
                pieces.append(Piece(piece.text, piece.tokens, index=s.uid, logprobs=s.take_logprobs()))
            if done is None:
                s.feed = [token]
                continue
            last = s.text.last(done)
            s.parts.append(last.text)
            s.tokens.extend(last.tokens)
            del self._seqs[s.uid]
            if s.prompt_cache is not None:
                assert s.cache is not None
                s.prompt_cache.insert(s.cache)
            pieces.append(Piece(last.text, last.tokens, done, index=s.uid, result=s.result(done), logprobs=s.take_logprobs()))
        self._pieces = []
        return pieces
