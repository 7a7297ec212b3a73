"""Choosing the next token from logits: pure functions of (logits, settings, rng)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def apply_repetition_penalty(logits: np.ndarray, context: Sequence[int], penalty: float) -> np.ndarray:
    """CTRL-style penalty: logits of ids already in ``context`` are divided by ``penalty``
    when positive and multiplied by it when negative. Returns a new array."""
    out = np.array(logits, dtype=np.float32, copy=True)
    if penalty == 1.0 or not context:
        return out
    ids = np.unique(np.asarray(context, dtype=np.int64))
    seen = out[ids]
    out[ids] = np.where(seen > 0, seen / penalty, seen * penalty)
    return out


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keeps the ``k`` largest logits (ties at the boundary kept), the rest to -inf."""
    if k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits >= kth, logits, -np.inf).astype(np.float32)


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


def sample(
    logits: np.ndarray,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    rng: Optional[np.random.Generator] = None,
) -> int:
    """The next token id: argmax for temperature 0, otherwise a draw from the
    temperature-scaled distribution restricted by top-k and top-p."""
    if temperature == 0.0:
        return int(np.argmax(logits))
    scaled = np.asarray(logits, dtype=np.float32) / np.float32(temperature)
    if top_k is not None:
        scaled = top_k_filter(scaled, top_k)
    if top_p is not None:
        scaled = top_p_filter(scaled, top_p)
    probs = softmax(scaled)
    rng = rng if rng is not None else np.random.default_rng()
    return int(rng.choice(len(probs), p=probs))


def check_settings(temperature: float, top_k: Optional[int], top_p: Optional[float], repetition_penalty: Optional[float]) -> None:
    """Raises ValueError naming the first bad sampling setting."""
    if not (isinstance(temperature, (int, float)) and np.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if repetition_penalty is not None and not (isinstance(repetition_penalty, (int, float)) and repetition_penalty > 0):
        raise ValueError(f"repetition_penalty must be > 0 or None, got {repetition_penalty!r}")
