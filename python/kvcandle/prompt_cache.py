"""Prefix reuse: caches kept by the token ids they hold, found again by the longest
common prefix with a new prompt.

    pc = kvcandle.PromptCache(model, max_bytes=512 * 2**20)
    kvcandle.generate(model, long_document + question_1, prompt_cache=pc)
    kvcandle.generate(model, long_document + question_2, prompt_cache=pc)  # document reused

Entries are forks (copy-on-write): inserting or looking up copies no keys or values.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Union

from . import _core
from ._checks import check_int
from ._ids import Ids, as_ids, common_prefix
from .cache import KVCache, held_bytes
from .errors import CacheError, CacheFileError, KVCandleError, KVCandleWarning
from .model import Model

#: the file name ending of a saved entry
SUFFIX = ".kvcache.safetensors"


class PromptCache:
    """Caches of one model, looked up by the longest prefix they share with a prompt.

    Args:
        model: the model whose caches it holds.
        max_bytes: the most bytes of keys and values the entries may hold together
            (their blocks, each counted once however many entries share it:
            :func:`kvcandle.held_bytes`); the least recently used entries are dropped to
            stay within it.
    """

    def __init__(self, model: Model, max_bytes: int) -> None:
        if not isinstance(model, Model):
            raise TypeError(f"model must be a kvcandle.Model, got {type(model).__name__}")
        self._model = model
        self._max_bytes = check_int("max_bytes", max_bytes, minimum=0, rule="a non-negative int")
        # token ids held -> a fork; the most recently used last
        self._entries: "OrderedDict[tuple[int, ...], KVCache]" = OrderedDict()
        # files of the earlier naming that :meth:`load` read: removed by a save to their
        # directory, which writes their entries under this naming
        self._renamed: list[Path] = []

    @property
    def model(self) -> Model:
        return self._model

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values the entries hold together (their blocks, shared
        blocks counted once)."""
        return held_bytes(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[list[int]]:
        """The token ids each entry holds, least recently used first."""
        return [list(k) for k in self._entries]

    def insert(self, cache: KVCache) -> bool:
        """Keeps a fork of ``cache`` (no keys or values copied). An entry whose tokens
        are a prefix of the new one's is replaced by it; a cache whose tokens an entry
        already holds (as a prefix) only marks that entry as recently used.

        Returns:
            True when the cache's tokens are held afterwards (False for an empty cache,
            or one larger than ``max_bytes``).

        Raises:
            CacheError: the cache belongs to another model.
        """
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a kvcandle.KVCache, got {type(cache).__name__}")
        if cache._model is not self._model:
            raise CacheError("this cache was made by another model than the prompt cache's")
        key = tuple(cache.tokens)
        if not key:
            return False
        for held in list(self._entries):
            if len(held) >= len(key) and held[: len(key)] == key:
                self._entries.move_to_end(held)
                return True
        if held_bytes([cache]) > self._max_bytes:  # would never fit: evict nothing for it
            return False
        for held in list(self._entries):
            if held == key[: len(held)]:
                del self._entries[held]
        self._entries[key] = cache.fork()
        self._evict()
        return key in self._entries

    def lookup(self, ids: Ids) -> KVCache:
        """A new cache holding the longest prefix of ``ids`` that any entry shares
        (empty when none does); only the rest of ``ids`` needs running. O(1) in the
        prefix's length: a fork, cropped.
        """
        wanted = as_ids(ids)
        best, best_len = None, 0
        for key in self._entries:
            n = common_prefix(key, wanted)
            if n > best_len:
                best, best_len = key, n
        if best is None:
            return self._model.new_cache()
        self._entries.move_to_end(best)
        cache = self._entries[best].fork()
        cache.crop(best_len)
        return cache

    def clear(self) -> None:
        self._entries.clear()

    def _evict(self) -> None:
        while self._entries and self.nbytes > self._max_bytes:
            self._entries.popitem(last=False)

    def _prefix(self) -> str:
        # the files of one model in a shared directory: the whole fingerprint, as a saved
        # cache loads only into a model of the same (a quantized or float16 load of one
        # file is another model)
        fingerprint = json.dumps(self._model.fingerprint, sort_keys=True)
        return hashlib.blake2b(fingerprint.encode(), digest_size=8).hexdigest() + "-"

    def _earlier_prefix(self) -> str:
        # how files were named until 2026-12-07: by the weights' hash alone, which every
        # load of one weights file shares (float32, quantized, float16)
        return self._model.fingerprint["model.weights"][:16] + "-"

    def save(self, directory: Union[str, "os.PathLike[str]"]) -> None:
        """Writes each entry to ``directory`` (made if missing) as a cache file
        (:meth:`KVCache.save`: atomic), and removes this model's files of entries no
        longer held and the temporary files of its saves that a killed process left
        (a process still running keeps its own). Files of other models in the directory
        are left alone.

        Raises:
            CacheFileError: the directory or a file cannot be made, written or removed.
        """
        folder = Path(directory)
        prefix = self._prefix()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            keep = set()
            for key, cache in self._entries.items():
                digest = hashlib.blake2b(repr(key).encode(), digest_size=12).hexdigest()
                path = folder / f"{prefix}{digest}{SUFFIX}"
                keep.add(path.name)
                if not path.is_file():
                    cache.save(path)
            for old in folder.glob(f"{prefix}*{SUFFIX}"):
                if old.name not in keep:
                    old.unlink(missing_ok=True)
            # what a save of this model's entries killed halfway left (as large as a cache)
            _core.remove_stale_temporaries(folder, prefix)
            for earlier in self._renamed:
                if earlier.parent.resolve() == folder.resolve():
                    earlier.unlink(missing_ok=True)
            self._renamed = [p for p in self._renamed if p.exists()]
        except OSError as e:
            raise CacheFileError(f"prompt cache directory {folder}: {e.strerror or e}" + (f": {e.filename}" if e.filename else "")) from None

    @classmethod
    def load(cls, directory: Union[str, "os.PathLike[str]"], model: Model, max_bytes: int) -> "PromptCache":
        """A prompt cache holding the entries :meth:`save` wrote to ``directory`` for
        ``model`` (the most recently written count as the most recently used). A missing
        directory gives an empty prompt cache; a damaged file is skipped with a
        :class:`kvcandle.KVCandleWarning` naming it. Files saved before 2026-12-07 (named
        by the weights' hash alone) are read too, this model's of them; the next
        :meth:`save` to the directory writes them under the current naming and removes
        them.

        Raises:
            CacheFileError: ``directory`` exists and is not a directory (:meth:`save`
                could never write there).
        """
        pc = cls(model, max_bytes)
        folder = Path(directory)
        if not folder.is_dir():
            if folder.exists():
                raise CacheFileError(f"prompt cache directory {folder}: not a directory")
            return pc
        current = list(folder.glob(f"{pc._prefix()}*{SUFFIX}"))
        # files of the earlier naming: this model's load (the others' are theirs to read)
        earlier = [] if pc._earlier_prefix() == pc._prefix() else list(folder.glob(f"{pc._earlier_prefix()}*{SUFFIX}"))
        for path in sorted(current + earlier, key=lambda p: p.stat().st_mtime):
            try:
                cache = model.load_cache(path)
            except KVCandleError as e:
                if path in earlier and isinstance(e, CacheError):  # another load of the same weights file saved it
                    continue
                warnings.warn(f"prompt cache: skipped {path.name}: {e}", KVCandleWarning, stacklevel=2)
                continue
            pc.insert(cache)
            if path in earlier:
                pc._renamed.append(path)
        return pc

    def __repr__(self) -> str:
        return f"PromptCache(entries={len(self)}, nbytes={self.nbytes}, max_bytes={self._max_bytes})"


__all__ = ["PromptCache"]
