"""candle-transformers' own ``models::llama::{Llama, Cache}``, wrapped exactly as they ship.

The caller passes ``index_pos``; only the last position's logits come back; nothing is
checked that candle does not check. It exists to show that kvcandle's native engine
computes what candle's Llama computes, and to reproduce candle's behaviour (index_pos 0
at every step, a reused cache, position 8192, cloning for branches)::

    up = kvcandle.upstream.load()            # or model.upstream(), sharing weights
    cache = up.new_cache(use_kv_cache=True)
    logits = up.forward(ids, 0, cache)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import numpy as np

from . import _core
from ._default import default_model_path
from ._ids import Ids, as_ids
from .errors import InputError


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

    def new_cache(self, use_kv_cache: bool = True) -> UpstreamCache:
        """``Cache::new(use_kv_cache, dtype, config, device)``."""
        return UpstreamCache(self._inner.new_cache(bool(use_kv_cache)))

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


def load(path: Union[str, "os.PathLike[str]", None] = None, dtype: str = "float32", device: str = "cpu") -> UpstreamModel:
    """Loads candle's Llama from a GGUF file or Hugging Face directory (default model if None)."""
    resolved: Path = default_model_path() if path is None else Path(path)
    return UpstreamModel(_core.UpstreamModel.load(str(resolved), dtype, device))


__all__ = ["UpstreamModel", "UpstreamCache", "load"]
