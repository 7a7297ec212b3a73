"""Choosing the next token from logits: pure functions of (logits, settings, rng)."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np

from ._checks import check_int, check_number


def apply_repetition_penalty(logits: np.ndarray, context: Sequence[int], penalty: float) -> np.ndarray:
    """CTRL-style penalty: logits of ids already in ``context`` are divided by ``penalty``
    when positive and multiplied by it when negative. Returns a new array.

    A penalty far from 1 (any finite number > 0 is allowed) can take a logit past
    float32's range: it is kept at the largest float32 of its sign, so sampling still
    sees a finite, overwhelming logit (an infinite one would make the probabilities NaN)."""
    out = np.array(logits, dtype=np.float32, copy=True)
    if penalty == 1.0 or not context:
        return out
    ids = np.unique(np.asarray(context, dtype=np.int64))
    seen = out[ids]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        penalized = np.where(seen > 0, seen / penalty, seen * penalty)
        past = ~np.isfinite(penalized)
        if past.any():  # float32 overflowed (or the penalty itself is past its range): float64, kept in range
            wide = seen[past].astype(np.float64)
            big = np.finfo(np.float32).max
            penalized[past] = np.clip(np.where(wide > 0, wide / penalty, wide * penalty), -big, big)
    out[ids] = penalized
    return out


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keeps the ``k`` largest logits (ties at the boundary kept), the rest to -inf.
    Returns an array of the same dtype."""
    if k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k)[-k]
    out = np.array(logits, copy=True)
    out[logits < kth] = -np.inf
    return out


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Keeps the smallest set of most likely tokens whose probability reaches ``p``."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, kind="stable")
    probs = softmax(logits[order])
    keep = np.cumsum(probs) - probs < p  # a token is kept if the mass before it is below p
    out = np.full_like(logits, -np.inf)
    out[order[keep]] = logits[order[keep]]
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.asarray(x, dtype=np.float64)
    z = np.exp(z - np.max(z))
    return z / z.sum()


# One function per setting: each checks its rule and returns the plain Python value.


def _temperature(value: object) -> float:
    return check_number("temperature", value, allowed=lambda t: t >= 0, rule="a finite number >= 0")


def _top_k(value: object) -> Optional[int]:
    return None if value is None else check_int("top_k", value, minimum=1, rule="a positive int or None")


def _top_p(value: object) -> Optional[float]:
    return None if value is None else check_number("top_p", value, allowed=lambda p: 0 < p <= 1, rule="a number in (0, 1] or None")


def _repetition_penalty(value: object) -> Optional[float]:
    if value is None:
        return None
    return check_number("repetition_penalty", value, allowed=lambda r: r > 0, rule="a finite number > 0 or None")


def _seed(value: object) -> Optional[int]:
    return None if value is None else check_int("seed", value, minimum=0, rule="an int >= 0 or None")


def sample(
    logits: np.ndarray,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    rng: Optional[np.random.Generator] = None,
) -> int:
    """The next token id: argmax for temperature 0, otherwise a draw from the
    temperature-scaled distribution restricted by top-k and top-p.

    Any positive finite temperature works: the logits are shifted so their maximum is 0
    before they are divided (in float64), so a tiny temperature is effectively greedy and
    a huge one uniform over the tokens top-k and top-p keep.

    Raises:
        InputError: ``temperature``, ``top_k`` or ``top_p`` breaks its rule (see
            :func:`check_settings`); the message names the setting and the value.
    """
    t, k, p = _temperature(temperature), _top_k(top_k), _top_p(top_p)
    if t == 0.0:
        return int(np.argmax(np.asarray(logits, dtype=np.float64)))
    probs = distribution(logits, temperature=t, top_k=k, top_p=p)
    rng = rng if rng is not None else np.random.default_rng()
    return int(rng.choice(len(probs), p=probs))


def distribution(logits: np.ndarray, *, temperature: float, top_k: Optional[int] = None, top_p: Optional[float] = None) -> np.ndarray:
    """The float64 probabilities :func:`sample` draws from at a temperature above 0 (the
    settings already checked)."""
    z = np.asarray(logits, dtype=np.float64)
    with np.errstate(over="ignore", under="ignore"):  # a tiny temperature sends the rest to -inf
        scaled = (z - np.max(z)) / temperature
    if top_k is not None:
        scaled = top_k_filter(scaled, top_k)
    if top_p is not None:
        scaled = top_p_filter(scaled, top_p)
    return softmax(scaled)


class Settings(NamedTuple):
    """Sampling settings as :func:`check_settings` returns them: plain Python numbers."""

    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    repetition_penalty: Optional[float]
    seed: Optional[int]


def check_settings(
    temperature: float,
    top_k: Optional[int],
    top_p: Optional[float],
    repetition_penalty: Optional[float],
    seed: Optional[int] = None,
) -> Settings:
    """Checks the sampling settings. Numbers may be Python or numpy scalars (never bools).

    Returns:
        The settings converted to plain Python ``int`` / ``float``.

    Raises:
        InputError: the first bad setting (a ``ValueError``), named with its value:
            ``temperature`` not a finite number >= 0, ``top_k`` not a positive int,
            ``top_p`` not in (0, 1], ``repetition_penalty`` not a finite number > 0,
            ``seed`` not an int >= 0 (each but ``temperature`` may also be None).
    """
    return Settings(
        _temperature(temperature),
        _top_k(top_k),
        _top_p(top_p),
        _repetition_penalty(repetition_penalty),
        _seed(seed),
    )
