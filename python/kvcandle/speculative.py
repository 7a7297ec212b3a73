"""Speculative decoding on O(1) crop: a drafter guesses the next few tokens, the model
checks them all in one chunk, keeps the agreeing prefix plus one token of its own, and
crops the rejected tail from its cache in O(1).

A chunk of up to ``kvcandle.SMALL_CHUNK`` tokens runs as rows of one decode step (the
weights read once for all rows), and each row's logits are bit for bit the ones a plain
decode step gives: greedy speculative output is *identical* to plain greedy decoding,
whatever the drafter guesses. With sampling the rule of Leviathan et al. / Chen et al.
keeps the output distribution exactly the model's: a guess drawn from the drafter's
distribution q is kept with probability min(1, p/q), else the next token is drawn from
the normalised residual max(p - q, 0); a drafter that guesses without a distribution
(prompt lookup, a callable) counts as q = 1 on its guess.

Drafters (``draft=``):

- a :class:`kvcandle.Model` sharing the tokenizer (notably the same file loaded with
  ``quantized=True`` as the draft for the float32 model); it keeps its own cache,
  cropped in step with the model's;
- ``"prompt-lookup"``: the tokens that followed the latest earlier occurrence of the
  longest recent n-gram (3 tokens down to 1) in the prompt and the text so far;
- any callable ``f(tokens, k) -> list[int]``: ``tokens`` is the whole sequence so far
  (prompt and generated, the last one not yet run by the model), ``k`` how many guesses
  are wanted; it returns up to ``k`` guessed next tokens (fewer or none is fine).

The number of guesses adapts to what is accepted: two more after a round that accepted
all (up to 8 for a draft model, whose guesses each cost a step of its own, and 31 for
the others), one fewer after one that did not, and after rounds of a single rejected
guess, plain steps for a while (doubling up to 16), so poor guesses cost little.
"""

from __future__ import annotations

from typing import Callable, Generator, Optional, Protocol, Sequence, Union

import numpy as np

from ._core import SMALL_CHUNK
from .cache import KVCache
from ._checks import check_int
from .errors import InputError
from .model import Model
from .sampling import apply_repetition_penalty, distribution

Draft = Union[Model, str, Callable[[list[int], int], Sequence[int]]]

#: The most guesses one round checks: the chunk (the last token and the guesses) stays a
#: step of rows.
MAX_DRAFT = SMALL_CHUNK - 1
#: The most guesses a draft model makes in a round: each costs one of its decode steps,
#: so long runs of guesses past the first rejection are paid for. Measured (default
#: model, its Q4_1 copy as draft, greedy, 3 chat prompts of 120 tokens, 2 threads):
#: at most 6 guesses 1.61-1.73x plain decode, 10 1.48-1.81x, 16 1.43-1.89x, 31 1.39-1.84x.
MODEL_MAX_DRAFT = 8
#: The longest n-gram prompt lookup matches.
LOOKUP_NGRAM = 3
#: The most plain steps taken between tries after guesses keep failing.
MAX_PAUSE = 16


class Drafter(Protocol):
    """What speculation asks of a drafter (the three kinds below implement it)."""

    max_guesses: int

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], Optional[list[np.ndarray]]]:
        """Up to ``k`` guesses after ``tokens``, and with sampled guesses the
        distribution each was drawn from (None: deterministic guesses, q = 1)."""
        ...

    def settle(self, kept: int) -> None:
        """The model keeps ``kept`` positions: drop anything run past them."""
        ...


class SequenceSampler(Protocol):
    """The one sequence's sampling state speculation shares with plain generation."""

    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    penalty: Optional[float]
    rng: np.random.Generator
    history: list[int]


class _ModelDrafter:
    """A draft model with its own cache."""

    def __init__(self, draft: Model, target: Model, settings: tuple, seed: Optional[int]) -> None:
        if draft.config.vocab_size != target.config.vocab_size:
            raise InputError(
                f"draft has a vocabulary of {draft.config.vocab_size} tokens and the model {target.config.vocab_size}: "
                "a draft model must share the model's tokenizer"
            )
        self.model = draft
        self.max_guesses = MODEL_MAX_DRAFT
        self.cache = draft.new_cache()
        self.temperature, self.top_k, self.top_p = settings[0], settings[1], settings[2]
        # its own random stream, apart from the acceptance draws
        self.rng = np.random.default_rng(None if seed is None else [seed, 1])

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], Optional[list[np.ndarray]]]:
        k = min(k, self.cache.max_length - len(tokens))
        if k <= 0:
            return [], None
        logits = self.model.sync(tokens, self.cache, diverged="crop").logits
        guesses: list[int] = []
        qs: list[np.ndarray] = []
        for i in range(k):
            if self.temperature == 0.0:
                guess = int(np.argmax(logits))
            else:
                q = distribution(logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
                guess = int(self.rng.choice(len(q), p=q))
                qs.append(q)
            guesses.append(guess)
            if i + 1 < k:
                logits = self.model.forward([guess], self.cache)
        return guesses, (qs if self.temperature != 0.0 else None)

    def settle(self, kept: int) -> None:
        """Drops what the draft ran past the ``kept`` positions the model keeps."""
        if len(self.cache) > kept:
            self.cache.crop(kept)


class _PromptLookup:
    max_guesses = MAX_DRAFT

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], Optional[list[np.ndarray]]]:
        return prompt_lookup(tokens, k), None

    def settle(self, kept: int) -> None:
        pass


class _Callable:
    max_guesses = MAX_DRAFT

    def __init__(self, f: Callable[[list[int], int], Sequence[int]], vocab: int) -> None:
        self.f, self.vocab = f, vocab

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], Optional[list[np.ndarray]]]:
        got = self.f(list(tokens), k)
        try:
            guesses = [int(g) for g in got][:k]
        except (TypeError, ValueError):
            raise InputError(f"draft must return a list of token ids, returned {type(got).__name__}") from None
        bad = [g for g in guesses if not 0 <= g < self.vocab]
        if bad:
            raise InputError(f"draft returned token id {bad[0]}, outside the vocabulary (0..{self.vocab - 1})")
        return guesses, None

    def settle(self, kept: int) -> None:
        pass


def prompt_lookup(tokens: Sequence[int], k: int, max_ngram: int = LOOKUP_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` (``max_ngram`` tokens down to 1) found earlier in ``tokens``."""
    seq = list(tokens)
    n_total = len(seq)
    for n in range(min(max_ngram, n_total - 1), 0, -1):
        tail = seq[n_total - n:]
        for start in range(n_total - n - 1, -1, -1):  # latest first
            if seq[start:start + n] == tail:
                follow = seq[start + n:start + n + k]
                if follow:
                    return follow
    return []


def drafter(draft: Draft, model: Model, settings: tuple) -> Drafter:
    """The drafter for ``draft=`` (checked)."""
    if isinstance(draft, Model):
        return _ModelDrafter(draft, model, settings, settings[4])
    if isinstance(draft, str):
        if draft == "prompt-lookup":
            return _PromptLookup()
        raise InputError(f'draft must be a kvcandle.Model, "prompt-lookup" or a callable, got {draft!r}')
    if callable(draft):
        return _Callable(draft, model.config.vocab_size)
    raise InputError(f'draft must be a kvcandle.Model, "prompt-lookup" or a callable, got {type(draft).__name__}')


def check_num_draft(value: object) -> int:
    n = check_int("num_draft", value, minimum=1, rule=f"an int from 1 to {MAX_DRAFT}")
    if n > MAX_DRAFT:
        raise InputError(f"num_draft must be an int from 1 to {MAX_DRAFT} (a chunk of guesses runs as one step of rows), got {n}")
    return n


class Counts:
    """What speculation did in one generation."""

    def __init__(self) -> None:
        self.rounds = 0
        """Chunks of guesses the model checked."""
        self.drafted = 0
        """Tokens guessed."""
        self.accepted = 0
        """Guesses kept and given out (a generation stopped mid-round never gives out
        the rest)."""


def speculative_step(
    model: Model,
    prompt_ids: Sequence[int],
    cache: KVCache,
    first_logits: np.ndarray,
    draft: Drafter,
    num_draft: int,
    sampler: SequenceSampler,
    counts: Counts,
) -> Generator[tuple[int, bool], None, None]:
    """Yields ``(token, from_draft)`` forever (the caller stops), as ``generate_step``
    yields tokens: the cache holds the prompt and every yielded token but the last
    whenever the generator waits, and after it is closed (rejected guesses are cropped).

    ``sampler`` is the sequence's ``_Sampler`` (settings, random stream, history).
    """
    ids = list(prompt_ids)
    rng = sampler.rng
    temperature, top_k, top_p, penalty = sampler.temperature, sampler.top_k, sampler.top_p, sampler.penalty
    history = sampler.history

    def target_probs(logits: np.ndarray, context: list[int]) -> np.ndarray:
        if penalty is not None:
            logits = apply_repetition_penalty(logits, context, penalty)
        return distribution(logits, temperature=temperature, top_k=top_k, top_p=top_p)

    def choose(logits: np.ndarray, context: list[int]) -> int:
        if penalty is not None:
            logits = apply_repetition_penalty(logits, context, penalty)
        if temperature == 0.0:
            return int(np.argmax(logits))
        p = distribution(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        return int(rng.choice(len(p), p=p))

    token = choose(first_logits, history)
    history.append(token)
    most = min(draft.max_guesses, MAX_DRAFT)
    k, pause, wait = min(num_draft, most), 1, 0
    yielded = 0
    try:
        yielded += 1
        yield token, False
        while True:
            seq = list(history)  # prompt + generated; the last not run yet
            room = cache.max_length - len(seq)
            guesses: list[int] = []
            qs: Optional[list[np.ndarray]] = None
            if wait == 0 and room > 0:
                guesses, qs = draft.propose(seq, min(k, room))
            else:
                wait = max(wait - 1, 0)
            if not guesses:
                logits = model.forward([seq[-1]], cache)
                token = choose(logits, history)
                history.append(token)
                yielded += 1
                yield token, False
                continue
            counts.rounds += 1
            counts.drafted += len(guesses)
            rows = model.forward([seq[-1]] + guesses, cache, all_logits=True)
            kept: list[int] = []
            new: Optional[int] = None
            for i, guess in enumerate(guesses):
                context = history + kept
                if temperature == 0.0:
                    own = choose(rows[i], context)
                    if own == guess:
                        kept.append(guess)
                        continue
                    new = own
                    break
                p = target_probs(rows[i], context)
                q_guess = 1.0 if qs is None else float(qs[i][guess])
                if rng.random() < min(1.0, p[guess] / q_guess):
                    kept.append(guess)
                    continue
                residual = p.copy()
                if qs is None:
                    residual[guess] = 0.0
                else:
                    residual = np.maximum(p - qs[i], 0.0)
                total = residual.sum()
                new = int(rng.choice(len(p), p=residual / total)) if total > 0 else choose(rows[i], context)
                break
            if new is None:  # every guess kept: the model's own next token comes free
                new = choose(rows[len(guesses)], history + kept)
            # the cache keeps the last token and the kept guesses; the new token is not run
            cache.crop(len(seq) + len(kept))
            draft.settle(len(seq) + len(kept))
            if len(kept) == len(guesses):
                k, pause = min(k + 2, most), 1
            elif not kept and k == 1:
                wait, pause = pause, min(2 * pause, MAX_PAUSE)
            else:
                k = max(k - 1, 1)
            for t in kept:
                history.append(t)
                yielded += 1
                counts.accepted += 1
                yield t, True
            history.append(new)
            yielded += 1
            yield new, False
    finally:
        # closed after any yielded token: the cache holds the prompt and every yielded
        # token but the last, never a guess past it
        keep = len(ids) + yielded - 1
        if len(cache) > keep:
            cache.crop(keep)
        draft.settle(min(keep, len(cache)))
