"""candle-transformers' own ``models::llama::{Llama, Cache}``, wrapped exactly as they ship.

The caller passes ``index_pos``; only the last position's logits come back; nothing is
checked that candle does not check. :meth:`UpstreamModel.tracked` adds, in Python, what
candle's ``Cache`` lacks (a length, tokens, positions from the length, reset, crop, fork)
over the same ``Cache``, so kvcandle's cache guarantees can be shown against candle's own. It exists to show that kvcandle's native engine
computes what candle's Llama computes, and to reproduce candle's behaviour (index_pos 0
at every step, a reused cache, position 8192, cloning for branches)::

    up = kvcandle.upstream.load()            # or model.upstream(), sharing weights
    cache = up.new_cache(use_kv_cache=True)
    logits = up.forward(ids, 0, cache)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import numpy as np

from . import _core
from ._default import default_model_path
from ._ids import Ids, as_ids
from ._checks import bool_arg, int_arg
from .errors import CacheError, InputError, PositionError


class UpstreamCache:
    """candle's ``Cache``: no length, no reset, no crop; ``clone()`` copies its handles."""

    __slots__ = ("_inner",)

    def __init__(self, inner: _core.UpstreamKVCache) -> None:
        self._inner = inner

    @property
    def use_kv_cache(self) -> bool:
        return self._inner.use_kv_cache

    def clone(self) -> "UpstreamCache":
        return UpstreamCache(self._inner.clone())


class UpstreamModel:
    """candle-transformers' ``Llama``."""

    __slots__ = ("_inner",)

    def __init__(self, inner: _core.UpstreamModel) -> None:
        self._inner = inner

    @property
    def vocab_size(self) -> int:
        return self._inner.vocab_size

    @property
    def max_length(self) -> int:
        """The context length (candle's RoPE tables end there)."""
        return self._inner.max_length

    def tracked(self) -> "TrackedEngine":
        """This model with caches that know their length (:class:`TrackedEngine`)."""
        return TrackedEngine(self)

    def new_cache(self, use_kv_cache: bool = True) -> UpstreamCache:
        """``Cache::new(use_kv_cache, dtype, config, device)``."""
        return UpstreamCache(self._inner.new_cache(bool_arg(use_kv_cache, "use_kv_cache")))

    def forward(self, ids: Ids, index_pos: int, cache: UpstreamCache) -> np.ndarray:
        """``Llama::forward(ids, index_pos, cache)``: float32 logits of the last position.

        Raises:
            TypeError: ``index_pos`` is not an int, or ``cache`` not an UpstreamCache.
            InputError: ``index_pos`` is negative or not below 2**63.
            TokenIdError, CacheError: as :meth:`kvcandle.Model.forward`.
            EngineError: whatever candle raises (for example its broadcast or narrow errors).
        """
        if isinstance(index_pos, bool) or not isinstance(index_pos, (int, np.integer)):
            raise TypeError(f"index_pos must be an int, got {type(index_pos).__name__} {index_pos!r}")
        if not 0 <= index_pos < 2**63:
            raise InputError(f"index_pos must be a non-negative int below 2**63, got {index_pos!r}")
        if not isinstance(cache, UpstreamCache):
            raise TypeError(f"cache must be an UpstreamCache, got {type(cache).__name__}")
        return self._inner.forward(as_ids(ids), int(index_pos), cache._inner)


class TrackedCache:
    """candle's ``Cache`` with the length it lacks, kept in Python: the tokens it holds
    (so ``len``), ``reset()`` (a new ``Cache``), ``crop(n)`` / ``trim(n)`` (a new
    ``Cache`` and the kept tokens run again: O(n) compute, where kvcandle's own cache
    crops in O(1)) and ``fork()`` (candle's ``Clone``). Made by
    :meth:`TrackedEngine.new_cache`."""

    __slots__ = ("_engine", "_inner", "_tokens")

    def __init__(self, engine: "TrackedEngine", inner: UpstreamCache, tokens: list[int]) -> None:
        self._engine = engine
        self._inner = inner
        self._tokens = tokens

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def max_length(self) -> int:
        return self._engine.max_length

    def reset(self) -> None:
        self._inner = self._engine._model.new_cache(True)
        self._tokens = []

    def crop(self, n: int) -> int:
        """Keeps the first ``n`` positions: a new ``Cache``, with the kept tokens run
        again (candle's cache cannot be shortened). Returns the positions dropped."""
        n = self._count("crop", n)
        kept, dropped = self._tokens[:n], len(self) - n
        self.reset()
        if kept:
            self._engine.forward(kept, self)
        return dropped

    def trim(self, n: int) -> int:
        """Drops the last ``n`` positions (:meth:`crop` to ``len - n``)."""
        n = self._count("trim", n)
        self.crop(len(self) - n)
        return n

    def _count(self, op: str, n: object) -> int:
        """``n`` as an int in ``[0, len]``, else the errors kvcandle's own cache raises."""
        value = int_arg(n, "n")
        if not 0 <= value <= len(self):
            raise InputError(f"{op}: n must be in [0, {len(self)}] (the cache length), got {value}")
        return value

    def fork(self) -> "TrackedCache":
        """candle's ``Cache::clone()``: its tensors are shared and never written in place."""
        return TrackedCache(self._engine, self._inner.clone(), list(self._tokens))

    def __repr__(self) -> str:
        return f"TrackedCache(len={len(self)}, max_length={self.max_length})"


class TrackedEngine:
    """candle's ``Llama`` driven like :class:`kvcandle.Model`: ``new_cache()`` and
    ``forward(ids, cache)``, positions taken from the cache's length."""

    __slots__ = ("_model",)

    def __init__(self, model: UpstreamModel) -> None:
        self._model = model

    @property
    def max_length(self) -> int:
        return self._model.max_length

    def new_cache(self) -> TrackedCache:
        return TrackedCache(self, self._model.new_cache(True), [])

    def forward(self, ids: Ids, cache: Optional[TrackedCache] = None) -> np.ndarray:
        """Runs ``ids`` at positions ``len(cache)..`` and appends them; returns the last
        position's float32 logits (candle's Llama returns no others).

        Raises:
            InputError: ``ids`` is empty.
            PositionError: the cache would grow past ``max_length``.
            CacheError: the cache belongs to another engine.
            TokenIdError, TypeError: as :meth:`kvcandle.Model.forward`.
        """
        if cache is None:
            cache = self.new_cache()
        elif not isinstance(cache, TrackedCache):
            raise TypeError(f"cache must be a TrackedCache, got {type(cache).__name__}")
        if cache._engine._model is not self._model:
            raise CacheError("this cache was made by another engine")
        wanted = as_ids(ids)
        if not wanted:
            raise InputError("ids is empty: forward needs at least one token id")
        start, limit = len(cache), self.max_length
        if start + len(wanted) > limit:
            raise PositionError(
                f"cannot run {len(wanted)} token(s) at position {start}: the model's context length is {limit} "
                f"(max_length), so at most {limit - start} more token(s) fit"
            )
        logits = self._model.forward(wanted, start, cache._inner)
        cache._tokens.extend(wanted)
        return logits


def load(path: Union[str, "os.PathLike[str]", None] = None, dtype: str = "float32", device: str = "cpu") -> UpstreamModel:
    """Loads candle's Llama from a GGUF file or Hugging Face directory (default model if None)."""
    resolved: Path = default_model_path() if path is None else Path(path)
    return UpstreamModel(_core.UpstreamModel.load(str(resolved), dtype, device))


__all__ = ["UpstreamModel", "UpstreamCache", "TrackedEngine", "TrackedCache", "load"]
