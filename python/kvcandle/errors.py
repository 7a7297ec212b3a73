"""Exceptions raised by kvcandle, one class per kind of failure.

Every class derives from :class:`KVCandleError`; where a built-in exception also fits
(``IndexError`` for an id outside the vocabulary, ``ValueError`` for a bad argument,
``FileNotFoundError`` for a missing model) the class derives from it too, so callers can
catch either.
"""

from __future__ import annotations


class KVCandleError(Exception):
    """Base class of every kvcandle error."""


class ModelNotFoundError(KVCandleError, FileNotFoundError):
    """The model file or directory does not exist (or the default model is not installed)."""


class ModelLoadError(KVCandleError, ValueError):
    """The model file is malformed, incomplete or of an unsupported architecture."""


class DeviceError(KVCandleError, ValueError):
    """The device is unknown or not compiled into this build."""


class DTypeError(KVCandleError, ValueError):
    """The dtype is unknown or not supported on the device."""


class PositionError(KVCandleError, IndexError):
    """The call would grow the cache past the model's context length (``max_length``)."""


class TokenIdError(KVCandleError, IndexError):
    """A token id is negative or not below the vocabulary size."""


class InputError(KVCandleError, ValueError):
    """An argument has a bad value (empty ids, crop length out of range, ...)."""


class CacheError(KVCandleError, ValueError):
    """A cache was used with a model that did not create it, or concurrently."""


class CacheFileError(KVCandleError, ValueError):
    """A saved cache (or prompt-cache entry, or conversation) file cannot be read or
    written: missing, truncated, corrupted, not a kvcandle cache, of another format
    version, or with sizes that do not fit the model. (A file saved from another model
    raises :class:`CacheError`, naming what differs.)"""


class EngineError(KVCandleError, RuntimeError):
    """candle failed while computing (for the upstream engine: candle's own errors)."""


__all__ = [
    "KVCandleError",
    "ModelNotFoundError",
    "ModelLoadError",
    "DeviceError",
    "DTypeError",
    "PositionError",
    "TokenIdError",
    "InputError",
    "CacheError",
    "CacheFileError",
    "EngineError",
]


class KVCandleWarning(UserWarning):
    """Something kvcandle could do only in part (for example a GGUF tokenizer kind it does
    not build yet: the model loads, ``model.tokenizer`` is None)."""
