"""Token ids as the Python layer accepts them."""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

Ids = Union[Sequence[int], np.ndarray]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def as_ids(ids: object) -> list[int]:
    """Converts token ids to a list of Python ints, rejecting what is not ids."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1:
            raise TypeError(f"ids must be a 1-D array, got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise TypeError(f"ids must be an integer array, got dtype {ids.dtype}")
        return [int(i) for i in ids.tolist()]
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"ids must be a list of ints or a 1-D integer numpy array, got {type(ids).__name__}")
    out = []
    for i, x in enumerate(ids):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"ids[{i}] must be an int, got {type(x).__name__} {x!r}")
        out.append(int(x))
    return out
