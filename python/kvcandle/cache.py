"""The KV cache: a thin Python face over the Rust cache the native engine owns."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, Sequence, Union, overload

import numpy as np

from . import _core
from ._checks import int_arg

if TYPE_CHECKING:
    from .model import Model


class LayerView:
    """One layer of a cache. ``keys`` and ``values`` are fresh numpy copies of shape
    (1, kv_heads, len(cache), head_dim), keys after RoPE, before GQA expansion."""

    __slots__ = ("_cache", "_index")

    def __init__(self, cache: _core.KVCache, index: int) -> None:
        self._cache = cache
        self._index = index

    @property
    def keys(self) -> np.ndarray:
        return self._cache.keys(self._index)

    @property
    def values(self) -> np.ndarray:
        return self._cache.values(self._index)

    def __repr__(self) -> str:
        return f"LayerView(layer={self._index}, length={len(self._cache)})"


class Layers(Sequence[LayerView]):
    """``cache.layers``: indexable like a list, one :class:`LayerView` per layer."""

    def __init__(self, cache: _core.KVCache) -> None:
        self._cache = cache

    def __len__(self) -> int:
        return self._cache.num_layers

    @overload
    def __getitem__(self, index: int) -> LayerView: ...
    @overload
    def __getitem__(self, index: slice) -> list[LayerView]: ...
    def __getitem__(self, index: int | slice) -> LayerView | list[LayerView]:
        if isinstance(index, slice):
            return [LayerView(self._cache, i) for i in range(len(self))[index]]
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"layer indices must be ints or slices, got {type(index).__name__} {index!r}")
        n = len(self)
        i = int(index) + n if index < 0 else int(index)
        if not 0 <= i < n:
            raise IndexError(f"layer {index} is out of range: the cache has {n} layers")
        return LayerView(self._cache, i)

    def __iter__(self) -> Iterator[LayerView]:
        return (LayerView(self._cache, i) for i in range(len(self)))


class KVCache:
    """The keys and values of the tokens a model has seen, stored in Rust.

    Make one with :meth:`kvcandle.Model.new_cache`; :meth:`kvcandle.Model.forward` appends
    to it. The length always comes from the cache itself: positions are never passed.
    """

    __slots__ = ("_inner", "_model")

    def __init__(self, inner: _core.KVCache, model: "Model") -> None:
        self._inner = inner
        self._model = model

    def __len__(self) -> int:
        return len(self._inner)

    @property
    def seq_length(self) -> int:
        """Number of positions held (same as ``len(cache)``)."""
        return len(self._inner)

    @property
    def dtype(self) -> str:
        """How keys and values are stored: the model's dtype, or what
        ``model.new_cache(dtype=...)`` asked for (``"float16"``, or ``"q8_0"``: blocks of 32
        int8 values and a float16 scale, read back as float32 by :attr:`layers`)."""
        return self._inner.dtype

    @property
    def max_length(self) -> int:
        """The model's context length: the cache never holds more positions."""
        return self._inner.max_length

    @property
    def tokens(self) -> list[int]:
        """The token ids whose keys and values the cache holds, in order."""
        return self._inner.tokens

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values for the positions held (``len * bytes_per_token``)."""
        return self._inner.nbytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes of keys and values one position takes across all layers."""
        return self._inner.bytes_per_token

    @property
    def capacity(self) -> int:
        """Positions in the blocks the cache refers to (a whole number of blocks of
        ``kvcandle.BLOCK_LEN`` positions)."""
        return self._inner.capacity

    @property
    def held_bytes(self) -> int:
        """Bytes of the blocks the cache refers to, shared ones included:
        ``kvcandle.held_bytes([cache, *forks])`` counts what several hold together."""
        return held_bytes([self])

    @property
    def is_shared(self) -> bool:
        """True while the cache shares a block with another cache (a fork, a
        ``PromptCache`` entry)."""
        return self._inner.is_shared

    @property
    def layers(self) -> Layers:
        """Per-layer views: ``cache.layers[i].keys`` / ``.values`` as numpy arrays."""
        return Layers(self._inner)

    def reset(self) -> None:
        """Empties the cache, dropping its references to blocks."""
        self._inner.reset()

    def crop(self, n: int) -> int:
        """Keeps the first ``n`` positions and drops the rest.

        O(1): no keys or values are copied. To drop positions from the end, use
        :meth:`trim`; a negative ``n`` is refused (``crop(-0)`` could not be told from
        ``crop(0)``).

        Args:
            n: positions to keep, ``0 <= n <= len(cache)``.

        Returns:
            The number of positions dropped.

        Raises:
            InputError: ``n`` is outside ``[0, len(cache)]`` (a ``ValueError``).
            TypeError: ``n`` is not an int.
        """
        return self._inner.crop(int_arg(n, "n"))

    def trim(self, n: int) -> int:
        """Drops the last ``n`` positions (as mlx-lm's ``trim``). O(1).

        Args:
            n: positions to drop, ``0 <= n <= len(cache)``.

        Returns:
            The number of positions dropped (``n``).

        Raises:
            InputError: ``n`` is outside ``[0, len(cache)]`` (a ``ValueError``).
            TypeError: ``n`` is not an int.
        """
        return self._inner.trim(int_arg(n, "n"))

    def fork(self) -> "KVCache":
        """A new cache holding the same positions, sharing every block by reference.

        No keys or values are copied: the first side to append writes in place, another
        copies at most the one partly filled block it shares, and neither side ever sees
        what the other appends afterwards.
        """
        return KVCache(self._inner.fork(), self._model)

    def save(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Writes the cache to a safetensors file: each layer's keys and values for the
        positions held (not the capacity), the token ids, and in the metadata the model's
        fingerprint (:attr:`kvcandle.Model.fingerprint`). Load it with
        :func:`kvcandle.load_cache`.

        The file is written beside ``path`` under a temporary name, flushed to disk and
        renamed over ``path``: an interrupted save leaves an earlier file intact, and the
        temporary file of a save whose process was killed is removed by the next save to
        ``path``.

        Raises:
            CacheFileError: the file cannot be written (the message says why).
        """
        self._save(path, {})

    def _save(self, path: Union[str, "os.PathLike[str]"], extra: Mapping[str, str]) -> None:
        """:meth:`save` with more metadata (a conversation's own state)."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        self._inner.save(os.fspath(path), {**extra, **self._model.fingerprint})

    def __repr__(self) -> str:
        return f"KVCache(len={len(self)}, max_length={self.max_length}, layers={len(self.layers)}, dtype={self.dtype!r})"


def held_bytes(caches: Iterable[KVCache]) -> int:
    """Bytes of the blocks ``caches`` refer to together, each block counted once however
    many of them share it: the memory of keys and values they hold (``nbytes`` counts
    each cache's own positions, shared or not)."""
    inner = []
    for i, c in enumerate(caches):
        if not isinstance(c, KVCache):
            raise TypeError(f"caches[{i}] must be a kvcandle.KVCache, got {type(c).__name__}")
        inner.append(c._inner)
    return _core.held_bytes(inner)
